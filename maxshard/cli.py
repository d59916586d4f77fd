"""What every `python -m maxshard.<command>` entry point shares: help, and user mistakes as one line.

A ConfigError (a key or value the user can fix) exits 2; a CheckpointError (a failed save, or a checkpoint unreadable
for a reason other than damage) exits 1. Both print `maxshard: error: ...` on stderr, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from maxshard.checkpoint.health import CheckpointError
from maxshard.errors import ConfigError

__all__ = ["entry"]

_EXIT_CODES = ((ConfigError, 2), (CheckpointError, 1))


def entry(argv: Sequence[str] | None, usage: str, run: Callable[[Sequence[str]], int]) -> int:
    """`--help` (or no arguments) prints `usage`; else `run(argv)`, with its user errors as one line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        return run(argv)
    except tuple(error for error, _ in _EXIT_CODES) as e:
        print(f"maxshard: error: {e}", file=sys.stderr)
        return next(code for error, code in _EXIT_CODES if isinstance(e, error))
