"""Several document streams -> one, interleaved so that each source's share of the tokens follows its weight.

Weights are shares of tokens, not of documents: a source of long documents must not take more than its weight just
because each of its documents is long. The rule is deterministic (no random draws): the next document comes from the
source whose tokens so far, divided by its weight, are lowest (ties: the first source). After any prefix of the
stream every source's token count is within one document of `weight * total`. Randomness lives inside each source
(its own seeded shuffle).

The same stage drops bad records (`BadRecord`) and carries the accounting into the packed rows as extra per-token
features, which `GlobalBatchIterator` turns into counters for exactly the rows it delivered:

    SOURCE   int8   the source index of every token
    SKIPPED  int32  at a document's first token: the bad records dropped just before it; 0 elsewhere
    RECORDS  int32  at a document's first token: the records read for it, SKIPPED and itself; 0 elsewhere

The bad records before a document are its own source's: a skip leaves the token counts as they were, so the next
record is asked of the same source. It also keeps the first few bad records of each source, as `where: reason`
strings (`bad_records`), in its iterator state: that is how they reach the main process from grain's workers.

Conversations (`data/chat.py`, pairs that carry `WEIGHT`) are never cut by a packed row's end: with `row_length`
set, a conversation that does not fit in what is left of the row is held back and the row is ended with padding
(weight 0; it still counts in `data/tokens/<source>`), so every assistant turn is trained with its whole prompt.
Text documents are cut as before, and carry WEIGHT 1.

A source that yields nothing but bad records for a whole epoch of its documents is a ConfigError, never an endless
search. The state (each source's position, token counts, pending skips, first bad records) is part of grain's
iterator state, so a checkpoint resumes the interleave exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from maxshard.data import bad_records
from maxshard.data.chat import WEIGHT
from maxshard.data.sources import BadRecord
from maxshard.errors import ConfigError

__all__ = ["SOURCE", "SKIPPED", "RECORDS", "TokenMixIterDataset"]

SOURCE, SKIPPED, RECORDS = "_source", "_skipped", "_records"
MAX_SOURCES = 127  # SOURCE is int8
_DTYPES = {SOURCE: np.int8, SKIPPED: np.int32, RECORDS: np.int32, WEIGHT: np.float32}  # of a held conversation


def _filler(length: int, source: int) -> dict[str, np.ndarray]:
    """Padding that ends a packed row (weight 0 everywhere): the next conversation starts the next row whole."""
    zeros = np.zeros(length, np.int32)
    return {"inputs": zeros, "targets": zeros, WEIGHT: np.zeros(length, np.float32),
            SOURCE: np.full(length, source, np.int8), SKIPPED: zeros, RECORDS: zeros}


class TokenMixIterDataset(grain.IterDataset):
    """Interleaves document pairs ({"inputs", "targets"}) of `parents` by token weight, dropping bad records."""

    def __init__(self, parents: Sequence[grain.IterDataset], weights: Sequence[float],
                 epoch_sizes: Sequence[int | None], names: Sequence[str], token_cap: int | None = None,
                 row_length: int | None = None):
        """`epoch_sizes[s]`: documents in one epoch of source s (a run of that many bad records is an error; None: a
        stream of unknown length, which checks each of its epochs itself); `token_cap`: count at most this many
        tokens per document (rows without packing truncate documents); `row_length`: the packed row length, so
        that a conversation is never cut by a row's end (module doc; None: rows are not packed)."""
        super().__init__(list(parents))
        if not 0 < len(parents) <= MAX_SOURCES:
            raise ValueError(f"1 to {MAX_SOURCES} sources, got {len(parents)}")
        total = float(sum(weights))
        self._weights = [float(w) / total for w in weights]
        self._epoch_sizes, self._names, self._token_cap = list(epoch_sizes), list(names), token_cap
        self._row_length = row_length

    def __iter__(self) -> grain.DatasetIterator:
        return _TokenMixIterator([iter(p) for p in self._parents], self._weights, self._epoch_sizes, self._names,
                                 self._token_cap, self._row_length)

    def __str__(self) -> str:
        return f"TokenMixIterDataset(weights={self._weights})"


class _TokenMixIterator(grain.DatasetIterator):
    def __init__(self, parents: list[grain.DatasetIterator], weights: list[float], epoch_sizes: list[int | None],
                 names: list[str], token_cap: int | None, row_length: int | None = None):
        super().__init__(parents)
        self._weights, self._epoch_sizes, self._names, self._token_cap = weights, epoch_sizes, names, token_cap
        self._row_length = row_length
        self._filled = 0  # tokens already in the packed row being filled
        self._held: dict[str, np.ndarray] | None = None  # a conversation waiting for the next row
        self._tokens = [0] * len(parents)  # tokens taken from each source so far
        self._bad_run = [0] * len(parents)  # bad records in a row, per source
        self._pending_skipped = 0  # bad records dropped since the last document handed on
        self._examples: list[list[str]] = [[] for _ in parents]  # the first bad records of each source

    def __next__(self) -> dict[str, np.ndarray]:
        if self._held is not None:
            element, self._held = self._held, None
            return self._placed(element)
        element, whole = self._next_document()
        if self._row_length and whole and len(element["inputs"]) > self._row_length - self._filled:
            self._held = element  # a conversation that would be cut: fill the row with padding first
            return self._placed(_filler(self._row_length - self._filled, int(element[SOURCE][0])))
        return self._placed(element)

    def _placed(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._row_length:
            self._filled = (self._filled + len(element["inputs"])) % self._row_length
        return element

    def _next_document(self) -> tuple[dict[str, np.ndarray], bool]:
        """The next document of the mixture, and whether it must stay whole (a conversation: it carries WEIGHT)."""
        while True:
            source = min(range(len(self._parents)), key=lambda s: (self._tokens[s] / self._weights[s], s))
            element = next(self._parents[source])
            if isinstance(element, BadRecord):
                self._skip(source, element)
                continue
            self._bad_run[source] = 0
            length = len(element["inputs"])
            self._tokens[source] += length if self._token_cap is None else min(length, self._token_cap)
            skipped, records = np.zeros(length, np.int32), np.zeros(length, np.int32)
            skipped[:1], records[:1] = self._pending_skipped, self._pending_skipped + 1
            self._pending_skipped = 0
            weight = element.get(WEIGHT, np.ones(length, np.float32))
            whole = WEIGHT in element
            return {**element, WEIGHT: weight, SOURCE: np.full(length, source, np.int8), SKIPPED: skipped,
                    RECORDS: records}, whole

    def _skip(self, source: int, record: BadRecord) -> None:
        self._pending_skipped += 1
        self._bad_run[source] += 1
        bad_records.keep(self._examples[source], record.where, record.reason)
        epoch_size = self._epoch_sizes[source]
        if epoch_size is not None and self._bad_run[source] > epoch_size:
            raise ConfigError(f"{self._names[source]}: every document of a whole epoch is a bad record "
                              f"(e.g. {record.where}: {record.reason}); check text_field and the files")

    def get_state(self) -> dict[str, Any]:
        held = None if self._held is None else {k: v.tolist() for k, v in self._held.items()}
        return {"parents": [p.get_state() for p in self._parents], "tokens": list(self._tokens),
                "bad_run": list(self._bad_run), "pending_skipped": self._pending_skipped,
                "filled": self._filled, "held": held, bad_records.STATE_KEY: [list(e) for e in self._examples]}

    def set_state(self, state: dict[str, Any]) -> None:
        for parent, parent_state in zip(self._parents, state["parents"]):
            parent.set_state(parent_state)
        self._tokens = [int(t) for t in state["tokens"]]
        self._bad_run = [int(b) for b in state["bad_run"]]
        self._pending_skipped = int(state["pending_skipped"])
        self._filled = int(state.get("filled", 0))
        examples = state.get(bad_records.STATE_KEY) or [[] for _ in self._parents]  # none in older states
        self._examples = [[str(e) for e in source] for source in examples]
        held = state.get("held")
        self._held = None if held is None else {k: np.asarray(v, _DTYPES.get(k, np.int32)) for k, v in held.items()}

    def __str__(self) -> str:
        return "TokenMixDatasetIterator"
