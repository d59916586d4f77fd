"""Bad records (`sources.BadRecord`): how many a run may skip, and what a person is shown of them.

Readers never raise for one bad record: they hand a BadRecord on, and the stage that consumes the stream drops it and
counts it (the mixture and `GlobalBatchIterator` for every reader of `make_input`, `prompts` for GRPO's prompts; a
token store, `store.py`, holds rows tokenized already and has nothing to skip). What this module adds to the counts:

  bounded   once a source has read `MIN_RECORDS` records (bad ones included), a share of bad ones above
            `max_bad_record_fraction` stops the run with one line naming the source, the share and its first
            reasons (`check`): a corpus that is a third broken (a wrong export, a field renamed in half the files)
            must not train quietly on what is left. The first records are not judged: a few bad ones among the
            first dozens say nothing about the corpus.
  visible   the console's step line reports the count, the share and the first few `where: reason` strings
            (`observe/console.py`). The reasons are text, and metrics are numbers (metrics.jsonl lines, TensorBoard
            scalars), so they reach the console through a small file, `run_dir/skipped_records.txt`, which the
            primary process writes (`write_examples`) from what the consuming stage kept in its iterator state.
            Why the state and a file, not a Python global: with `grain_worker_count > 0` the records are read in
            worker processes, whose state grain hands to the main process with each batch, and nothing else of
            theirs; the file is also there for a person after the run.

Both the counts and the first reasons are in the iterator state that checkpoints save, so a resumed run continues
them (and its messages still name the first bad records of the run, not of this start).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from maxshard.errors import ConfigError

__all__ = ["MIN_RECORDS", "SHOWN", "EXAMPLES_FILE", "STATE_KEY", "describe", "keep", "exceeded", "check",
           "examples_path", "write_examples", "read_examples"]

MIN_RECORDS = 1000  # records of a source read before its share of bad ones is judged
SHOWN = 3  # first bad records kept (per source) and shown
EXAMPLES_FILE = "skipped_records.txt"  # in run_dir: the first bad records, one `where: reason` a line
STATE_KEY = "bad_record_examples"  # the key of a stage's first bad records in its iterator state


def describe(where: str, reason: str) -> str:
    """`where: reason` on one line (a template's message, kept in `where`, may hold newlines)."""
    return " ".join(f"{where}: {reason}".split())


def keep(examples: list[str], where: str, reason: str) -> None:
    """Appends the record's description to `examples` unless `SHOWN` are kept already."""
    if len(examples) < SHOWN:
        examples.append(describe(where, reason))


def exceeded(skipped: int, read: int, limit: float | None) -> bool:
    """Whether `skipped` bad records of `read` pass the bound: more than `limit` of them once at least `MIN_RECORDS`
    are read (`limit` None: no bound)."""
    return limit is not None and read >= MIN_RECORDS and skipped > limit * read


def check(name: str, skipped: int, read: int, limit: float | None, examples: Sequence[str]) -> None:
    """ConfigError (one line naming the source, the share and the first reasons) where the share is `exceeded`."""
    if not exceeded(skipped, read, limit):
        return
    first = "; ".join(examples) or "none kept"
    raise ConfigError(f"{name}: {skipped:,} of the {read:,} records read are bad ({skipped / read:.1%}, above "
                      f"max_bad_record_fraction={limit:g}); first: {first}; fix the data or raise "
                      "max_bad_record_fraction")


def examples_path(run_dir: str, primary: bool) -> str | None:
    """Where the primary process writes the first bad records of a run (None for the other processes)."""
    return os.path.join(run_dir, EXAMPLES_FILE) if primary and run_dir else None


def write_examples(path: str, examples: Sequence[str]) -> None:
    """Replaces the file with `examples`, one a line; written under a temporary name and renamed, so a reader never
    sees half a file. Only into a run directory that exists: a training makes it before its input starts (the run
    lock, metrics.jsonl), while an iterator opened outside a run (a tool, a test) has no run to write into."""
    if not os.path.isdir(os.path.dirname(path) or "."):
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(f"{line}\n" for line in examples))
    os.replace(tmp, path)


def read_examples(run_dir: str) -> list[str]:
    """The first bad records of the run in `run_dir` ([] when none were written, or the file cannot be read)."""
    try:
        with open(os.path.join(run_dir, EXAMPLES_FILE), encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError):
        return []
