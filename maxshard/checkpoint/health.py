"""What a checkpoint failure means: damage to fall back from, or a fault that must stop the run untouched.

Damage is a property of the stored bytes: a file missing, truncated or undecodable. Setting a damaged step aside and
resuming from the previous one loses only the steps since then, and retrying would fail the same way. Anything else
(a permission problem, an I/O or network error, memory running out) says nothing about the checkpoint: treating it
as damage would throw away up to `checkpoint_period` steps on every process for a fault that a restart may not
even see again. So only recognised integrity failures count as damage; every other error stops the run in one line.

Every process first reads the step on its own, outside orbax's barriers, then all of them agree through one
allgather: all use it, all set it aside (some process saw damage), or all stop (some process hit a real fault).
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import re
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["CheckpointError", "SaveFailed", "Damaged", "Outcome", "is_damage", "reason", "outcome_of", "agree",
           "one_line", "QuietBackground"]


class CheckpointError(Exception):
    """A checkpoint could not be written or read for a reason other than damage: the run stops (exit 1)."""


class SaveFailed(CheckpointError):
    """A save (usually its background commit) failed: the run must not train on believing it is saved."""

    def __init__(self, step: int, cause: BaseException) -> None:
        reason = "the disk is full (no space left on device); free space and start again: the run resumes from " \
                 "its last committed checkpoint. " if _disk_full(cause) else ""
        super().__init__(f"checkpoint save at step {step} failed: {reason}{one_line(cause)}")
        self.step = step


def _disk_full(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is ENOSPC: an OSError, or tensorstore's message that quotes it."""
    return any(getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e) for e in _chain(error))


class Damaged(Exception):
    """Raised by our own checks of a checkpoint's contents (e.g. an empty state tree): always damage."""


class Outcome(enum.IntEnum):
    """One process's result of reading a step; higher wins when processes disagree."""

    READ = 0
    DAMAGED = 1
    FAILED = 2


# tensorstore reports storage problems as ValueError("<STATUS_CODE>: ..."), orbax wraps array reads in Exception.
_DAMAGE_CODES = frozenset({"DATA_LOSS", "NOT_FOUND", "OUT_OF_RANGE"})
_DECODE_CODES = frozenset({"FAILED_PRECONDITION", "INVALID_ARGUMENT"})  # damage only with decoding words below
_DECODE_WORDS = ("Truncated", "Error decoding", "Error parsing")
_STATUS = re.compile(r"([A-Z][A-Z_]+): ")


def one_line(error: BaseException) -> str:
    """`Type: first line of the message` (cut at 160 characters): an error fit for a one-line report."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def _chain(error: BaseException) -> Iterator[BaseException]:
    """The error and what caused it, outermost first (orbax wraps tensorstore's errors in plain Exceptions)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _verdict(error: BaseException) -> bool | None:
    """True: damage; False: a fault that is not damage; None: this link does not tell (look at its cause)."""
    if isinstance(error, (Damaged, FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError)):
        return True
    if isinstance(error, (OSError, MemoryError)):  # PermissionError, EIO, ENOSPC, ...: the storage, not the bytes
        return False
    status = _STATUS.match(str(error)) if type(error) is ValueError else None
    if status is None:
        return None
    code = status.group(1)
    return code in _DAMAGE_CODES or (code in _DECODE_CODES and any(w in str(error) for w in _DECODE_WORDS))


def is_damage(error: BaseException) -> bool:
    """Whether reading failed because the stored bytes are missing or corrupt (the first telling link decides)."""
    for link in _chain(error):
        verdict = _verdict(link)
        if verdict is not None:
            return verdict
    return False


def reason(error: BaseException) -> str:
    """One line on what went wrong, from the link that decides damage or not (orbax's wrapper says little)."""
    telling = next((link for link in _chain(error) if _verdict(link) is not None), error)
    return one_line(telling)


def outcome_of(problem: BaseException | None) -> Outcome:
    if problem is None:
        return Outcome.READ
    return Outcome.DAMAGED if is_damage(problem) else Outcome.FAILED


def agree(mine: Outcome) -> Outcome:
    """The worst outcome over all processes (one allgather): they restore the same step, or none does."""
    if jax.process_count() == 1:
        return mine
    return Outcome(int(np.max(multihost_utils.process_allgather(np.int32(mine)))))


class _AbandonedWrites(logging.Filter):
    """Drops asyncio's reports of orbax write tasks whose error nobody retrieved (QuietBackground)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Task exception was never retrieved") or not record.exc_info:
            return True
        frames = traceback.extract_tb(record.exc_info[2])
        return not any("/orbax/" in frame.filename.replace("\\", "/") for frame in frames)


_ABANDONED_WRITES = _AbandonedWrites()


class QuietBackground(logging.Filter):
    """Keeps the tracebacks of orbax's background work off the console while a run's checkpoints are open.

    - orbax's error records (it logs through absl) from its save threads: every failure they describe reaches
      the run as an exception that `Checkpoints` reports in one line (SaveFailed, CheckpointError, damage).
    - "Event loop is closed" from tensorstore reads still in flight when a failed read has already ended orbax's
      event loop: they finish into nothing (Python reports them as unraisable), whatever the checkpoint holds.
    - asyncio's "Task exception was never retrieved" for the other writes of a save that failed (a full disk fails
      every fragment at once; orbax takes the first error): logged when the tasks are collected, often at exit, so
      that filter stays for the life of the process (`_ABANDONED_WRITES`).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from_orbax = "/orbax/" in record.pathname.replace("\\", "/")
        return not (from_orbax and record.levelno >= logging.ERROR)

    def _unraisable(self, info: Any) -> None:
        late_read = isinstance(info.exc_value, RuntimeError) and str(info.exc_value) == "Event loop is closed"
        if not late_read:
            self._previous_hook(info)

    def __enter__(self) -> QuietBackground:
        logging.getLogger("absl").addFilter(self)
        logging.getLogger("asyncio").addFilter(_ABANDONED_WRITES)  # once: a logger holds a filter at most once
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("absl").removeFilter(self)
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._previous_hook
