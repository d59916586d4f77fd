"""Several JAX processes (multi-host) scoring as one: every process runs lm-eval on the same requests, and that is
checked, not assumed.

Each process runs the whole harness: lm-eval builds the requests, the scorer and the engine turn them into global
arrays from host batches that every process holds whole (as training's input does, data/pipeline.py), and every
process reads back the same scores and tokens. That is only right while the processes were given the same requests:
a host with another copy of a task's data files, another limit or another lm-eval would hand its devices other rows
of the same global array, scoring garbage without a word, or compile other shapes and wait forever. So before each
batch of requests reaches the devices, the processes compare a digest of them (one small all-gather), and compare
the answers afterwards; a difference is a ConfigError naming the processes that differ. Only process 0 writes files
and prints (`is_primary`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from maxshard.errors import ConfigError

__all__ = ["is_primary", "check_same"]


def is_primary() -> bool:
    """Whether this process writes eval_output and prints the scores (process 0, like training's metrics)."""
    return jax.process_index() == 0


def digest(what: str, sequences: Sequence[Sequence[Sequence[int]]] = (), other: Any = None) -> np.ndarray:
    """uint32 [8]: the SHA-256 of `what`, lists of token sequences (hashed as arrays: a task's requests hold
    millions of tokens) and `other` (JSON: floats, strings, settings)."""
    hashed = hashlib.sha256(json.dumps([what, other], separators=(",", ":"), default=str).encode())
    for rows in sequences:
        hashed.update(np.fromiter(map(len, rows), np.int64, len(rows)).tobytes())
        hashed.update(np.fromiter(itertools.chain.from_iterable(rows), np.int64).tobytes())
    return np.frombuffer(hashed.digest(), np.uint32)


def check_same(what: str, sequences: Sequence[Sequence[Sequence[int]]] = (), other: Any = None) -> None:
    """Every process holds the same `sequences` and `other` (what it calls `what`), else a ConfigError on every
    process. A no-op for one process; with several, every process must call it at the same point (an all-gather)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils  # deferred: one process never needs it

    digests = np.asarray(multihost_utils.process_allgather(digest(what, sequences, other)))  # [processes, 8]
    differ = [index for index in range(len(digests)) if not np.array_equal(digests[index], digests[0])]
    if differ:
        which = f"process {differ[0]}" if len(differ) == 1 else f"processes {', '.join(map(str, differ))}"
        raise ConfigError(f"{which} of {len(digests)} {'holds' if len(differ) == 1 else 'hold'} other {what} than "
                          "process 0: every host must run the same command on the same task files (eval_tasks_dir), "
                          "tokenizer and lm-eval version")
