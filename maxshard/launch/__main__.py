"""`python -m maxshard.launch COMMAND ...`: `xpk` (GKE, maxshard/launch/xpk.py) or `slurm` (maxshard/launch/slurm.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from maxshard.launch import slurm, xpk

COMMANDS = {"xpk": xpk.main, "slurm": slurm.main}
USAGE = "usage: python -m maxshard.launch COMMAND --help  (commands: " + ", ".join(COMMANDS) + ")"


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if argv and argv[0] not in ("-h", "--help"):
        print(f"maxshard: error: unknown command {argv[0]!r}; {USAGE}", file=sys.stderr)
        return 2
    print(USAGE, file=sys.stderr)
    return 0 if argv else 2


if __name__ == "__main__":
    sys.exit(main())
