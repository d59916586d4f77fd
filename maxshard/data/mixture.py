"""Several document streams -> one, interleaved so that each source's share of the tokens follows its weight.

Weights are shares of tokens, not of documents: a source of long documents must not take more than its weight just
because each of its documents is long. The rule is deterministic (no random draws): the next document comes from the
source whose tokens so far, divided by its weight, are lowest (ties: the first source). After any prefix of the
stream every source's token count is within one document of `weight * total`. Randomness lives inside each source
(its own seeded shuffle).

The same stage drops bad records (`BadRecord`) and carries the accounting into the packed rows as two extra
per-token features, which `GlobalBatchIterator` turns into counters for exactly the rows it delivered:

    SOURCE   int8   the source index of every token
    SKIPPED  int32  at a document's first token: the bad records dropped just before it; 0 elsewhere

A source that yields nothing but bad records for a whole epoch of its documents is a ConfigError, never an endless
search. The state (each source's position, token counts, pending skips) is part of grain's iterator state, so a
checkpoint resumes the interleave exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from maxshard.config import ConfigError
from maxshard.data.sources import BadRecord

__all__ = ["SOURCE", "SKIPPED", "TokenMixIterDataset"]

SOURCE, SKIPPED = "_source", "_skipped"
MAX_SOURCES = 127  # SOURCE is int8


class TokenMixIterDataset(grain.IterDataset):
    """Interleaves document pairs ({"inputs", "targets"}) of `parents` by token weight, dropping bad records."""

    def __init__(self, parents: Sequence[grain.IterDataset], weights: Sequence[float],
                 epoch_sizes: Sequence[int | None], names: Sequence[str], token_cap: int | None = None):
        """`epoch_sizes[s]`: documents in one epoch of source s (a run of that many bad records is an error; None: a
        stream of unknown length, which checks each of its epochs itself); `token_cap`: count at most this many
        tokens per document (rows without packing truncate documents)."""
        super().__init__(list(parents))
        if not 0 < len(parents) <= MAX_SOURCES:
            raise ValueError(f"1 to {MAX_SOURCES} sources, got {len(parents)}")
        total = float(sum(weights))
        self._weights = [float(w) / total for w in weights]
        self._epoch_sizes, self._names, self._token_cap = list(epoch_sizes), list(names), token_cap

    def __iter__(self) -> grain.DatasetIterator:
        return _TokenMixIterator([iter(p) for p in self._parents], self._weights, self._epoch_sizes, self._names,
                                 self._token_cap)

    def __str__(self) -> str:
        return f"TokenMixIterDataset(weights={self._weights})"


class _TokenMixIterator(grain.DatasetIterator):
    def __init__(self, parents: list[grain.DatasetIterator], weights: list[float], epoch_sizes: list[int | None],
                 names: list[str], token_cap: int | None):
        super().__init__(parents)
        self._weights, self._epoch_sizes, self._names, self._token_cap = weights, epoch_sizes, names, token_cap
        self._tokens = [0] * len(parents)  # tokens taken from each source so far
        self._bad_run = [0] * len(parents)  # bad records in a row, per source
        self._pending_skipped = 0  # bad records dropped since the last document handed on

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            source = min(range(len(self._parents)), key=lambda s: (self._tokens[s] / self._weights[s], s))
            element = next(self._parents[source])
            if isinstance(element, BadRecord):
                self._skip(source, element)
                continue
            self._bad_run[source] = 0
            length = len(element["inputs"])
            self._tokens[source] += length if self._token_cap is None else min(length, self._token_cap)
            skipped = np.zeros(length, np.int32)
            skipped[:1] = self._pending_skipped
            self._pending_skipped = 0
            return {**element, SOURCE: np.full(length, source, np.int8), SKIPPED: skipped}

    def _skip(self, source: int, record: BadRecord) -> None:
        self._pending_skipped += 1
        self._bad_run[source] += 1
        epoch_size = self._epoch_sizes[source]
        if epoch_size is not None and self._bad_run[source] > epoch_size:
            raise ConfigError(f"{self._names[source]}: every document of a whole epoch is a bad record "
                              f"(e.g. {record.where}: {record.reason}); check text_field and the files")

    def get_state(self) -> dict[str, Any]:
        return {"parents": [p.get_state() for p in self._parents], "tokens": list(self._tokens),
                "bad_run": list(self._bad_run), "pending_skipped": self._pending_skipped}

    def set_state(self, state: dict[str, Any]) -> None:
        for parent, parent_state in zip(self._parents, state["parents"]):
            parent.set_state(parent_state)
        self._tokens = [int(t) for t in state["tokens"]]
        self._bad_run = [int(b) for b in state["bad_run"]]
        self._pending_skipped = int(state["pending_skipped"])

    def __str__(self) -> str:
        return "TokenMixDatasetIterator"
