"""The records behind the rows a `GlobalBatchIterator` delivers: read and skipped, per source, and the first bad ones.

The mixture marks each document's first token with the records read to produce it (RECORDS) and the bad ones
skipped before it (SKIPPED), and keeps each source's first bad records in its iterator state (`mixture`). This
counter sums those marks over the delivered rows, so the counts are exact for the run whatever `grain_worker_count`
is, bounds each source's share (`bad_records.check`) in every process alike, and learns the first reasons from
grain's state (with worker processes: each worker's mixture's), which the primary process writes for the console.
Its counts travel in the iterator's saved state, so a resumed run continues them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from maxshard.data import bad_records
from maxshard.data.mixture import RECORDS, SKIPPED, SOURCE

__all__ = ["RecordCounts"]


class RecordCounts:
    """Records read and skipped per source for the rows delivered; the bound and the first reasons (module doc)."""

    def __init__(self, names: Sequence[str], max_bad_fraction: float | None = None,
                 examples_path: str | None = None) -> None:
        """`names`: each source as messages name it; `max_bad_fraction`: the bound on each source's share of bad
        records (None: none); `examples_path`: where to write the first bad records (None: nowhere)."""
        self._names = list(names)
        self._limit, self._examples_path = max_bad_fraction, examples_path
        self._skipped = np.zeros(len(self._names), np.int64)  # bad records dropped to fill the rows, per source
        self._read = np.zeros(len(self._names), np.int64)  # records read to fill them (bad ones too), per source
        self._skipped_before = 0  # bad records counted by a state from before per-source counts
        self._examples: list[list[str]] = [[] for _ in self._names]  # the first bad records of each source

    def count(self, rows: dict[str, np.ndarray], grain_state: Callable[[], Any]) -> None:
        """Adds a batch's rows; `grain_state` gives the pipeline's state, asked only while reasons are still to
        learn or a source passed its bound."""
        skipped, read = _records_per_source(rows, len(self._names))
        self._read += read
        if not skipped.any():
            return
        self._skipped += skipped
        sources = [int(s) for s in np.flatnonzero(skipped)]
        over = [s for s in sources if bad_records.exceeded(self._skipped[s], self._read[s], self._limit)]
        if over or sum(map(len, self._examples)) < bad_records.SHOWN:
            self.learn_examples(grain_state())
        for source in over:
            bad_records.check(self._names[source], int(self._skipped[source]), int(self._read[source]),
                              self._limit, self._examples[source])

    def learn_examples(self, grain_state: Any) -> None:
        """Takes the first bad records from grain's state; writes them where they grew.

        grain's state of packed rows is the packer's last checkpoint, which can be a row's documents behind the rows
        delivered: a bad record counted in the last row may be learned a batch later."""
        examples = _first_bad_records(grain_state, len(self._names))
        if sum(map(len, examples)) > sum(map(len, self._examples)):
            self._examples = examples
            if self._examples_path is not None:
                bad_records.write_examples(self._examples_path, [e for source in examples for e in source])

    def stats(self) -> dict[str, int]:
        """`data/skipped_records` (bad records dropped to fill the rows) and `data/records_read` (records read to
        fill them, bad ones included), of the run."""
        return {"data/skipped_records": self._skipped_before + int(self._skipped.sum()),
                "data/records_read": int(self._read.sum())}

    def state(self) -> dict[str, Any]:
        """The counts, for the iterator's saved state."""
        return {"skipped": self._skipped.tolist(), "read": self._read.tolist(), "skipped_before": self._skipped_before}

    def restore(self, stats: dict[str, Any], grain_state: Any) -> None:
        """The counts of a saved state (`stats`, as `state` wrote them) and the reasons its grain state kept."""
        if "read" in stats:
            self._skipped, self._read = np.asarray(stats["skipped"], np.int64), np.asarray(stats["read"], np.int64)
            self._skipped_before = int(stats.get("skipped_before", 0))
        else:  # a state from before records were counted: its total goes on, the share counts from here on
            self._skipped, self._read = np.zeros_like(self._skipped), np.zeros_like(self._read)
            self._skipped_before = int(stats["skipped"])
        self._examples = [[] for _ in self._names]
        self.learn_examples(grain_state)


def _records_per_source(rows: dict[str, np.ndarray], sources: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 [sources] twice: the bad records skipped and the records read for the batch's documents, by source.

    Both counts sit on a document's first token, where RECORDS is at least 1 (`mixture`): only those tokens are
    looked up."""
    first = np.flatnonzero(rows[RECORDS])
    source = rows[SOURCE].ravel()[first].astype(np.int64)
    skipped, read = (np.bincount(source, weights=rows[feature].ravel()[first], minlength=sources).astype(np.int64)
                     for feature in (SKIPPED, RECORDS))
    return skipped, read


def _first_bad_records(grain_state: Any, sources: int) -> list[list[str]]:
    """The first bad records of each source (`bad_records.SHOWN` at most) that the mixture kept in a grain state:
    its own, or with worker processes each worker's mixture's, taken in the workers' order."""
    merged: list[list[str]] = [[] for _ in range(sources)]
    for found in _found(grain_state, bad_records.STATE_KEY):
        for kept, more in zip(merged, found):
            kept.extend(more[: bad_records.SHOWN - len(kept)])
    return merged


def _found(tree: Any, key: str) -> Iterator[Any]:
    """Every value of `key` in a nested state of dicts and lists (grain nests its transformations' states)."""
    if isinstance(tree, dict):
        if key in tree:
            yield tree[key]
            return
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _found(item, key)
