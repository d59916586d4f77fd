"""A token store: documents tokenized once, read back as packed rows by global row number (`dataset_type: store`).

Why: the document pipeline (`pipeline.py`) has every process read and tokenize the whole global batch and keep its
own rows, so P processes do P times the input work. Here packing is a pure function of (store, seed, global row
index): any process computes row g from a few chunk reads without reading any other row, so each process reads
only the rows its devices hold, and the data position is still one global row number (elastic resume on any process
count stays exact).

On disk (written by `tools/prepare_data.py --store`, in parallel across processes and files; `ShardWriter`):

    DIR/data-00003-of-00008.arecord         ArrayRecord: records of CHUNK int32 ids (the shard's token stream)
    DIR/data-00003-of-00008.lengths.npy     int64 [documents]: each document's length in that stream
    DIR/data-00003-of-00008.json            the shard's facts (tokenizer, chunk, documents, tokens); written last,
                                            so a shard without it is incomplete

A shard's stream is its documents one after another, each already as the model reads it: BOS (where the tokenizer
has one) + ids + EOS, so document d's pair is full_d[:-1] -> full_d[1:] (`packing.document_pair`). ArrayRecord
because grain reads it natively and at random (`grain.sources.ArrayRecordDataSource`); fixed-size chunks, not one
record per document, so reading part of a long document reads at most two chunks more than that part.

Rows. The split's documents (a hash of their store index, as for `array_record`) in store order make one stream of
pairs; sequence j is its positions [j L, (j + 1) L) (the tail shorter than L is left out). A document cut by a
sequence's end continues as a new segment of the next sequence (positions from 0), as `packing.pack` cuts. Global
row g is sequence order[g], where order is grain's `MapDataset.range(S).shuffle(seed).repeat()`: a new permutation of
the S sequences each epoch, computed per index (grain's index_shuffle), never materialised. Worked example, L = 4,
documents A = a1 a2 (pair < a1 a2 -> a1 a2 >) and B = b1 b2 b3 b4, BOS <:

    pair stream  inputs   <  a1 a2 <  | b1 b2 b3 b4        sequence 0: segments 1 1 1 2, positions 0 1 2 0
                 targets  a1 a2 >  b1 | b2 b3 b4 >         sequence 1: segments 1 1 1 1, positions 0 1 2 3

The rows of an epoch are always the same cuts (only their order changes, as in Levanter's cache), and store order
is corpus order (shard s of S holds documents [s N / S, (s + 1) N / S)): documents are not reshuffled into new
neighbours each epoch as the document pipeline does, which keeps a row's reads to one or two runs of chunks. Memory: ~40 bytes per document of the
store in each process (lengths, starts, split keys and ends), none per token.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import weakref
from typing import Any

import grain
import jax
import numpy as np
from grain.experimental import ThreadPrefetchIterDataset
from jax.sharding import NamedSharding

from maxshard.config import Config
from maxshard.data import catalog, packing, pipeline, sources
from maxshard.data.tokenizer import Tokenizer, make_tokenizer
from maxshard.errors import ConfigError

__all__ = ["FORMAT", "CHUNK_TOKENS", "ShardWriter", "shard_name", "TokenStore", "open_store", "StoreRows",
           "StoreBatchIterator", "make_store_input"]

FORMAT = 1  # of the shard files and the iterator state
CHUNK_TOKENS = 1024  # ids per record (4 KiB): a row of L ids reads about L + 2 x 1024 (prepare_data --chunk_tokens)
_READ_THREADS = 2  # rows read in parallel inside one process


def shard_name(shard: int, shards: int) -> str:
    """The file stem of shard `shard` of `shards` (its .arecord, .lengths.npy and .json share it)."""
    return f"data-{shard:05d}-of-{shards:05d}"


class ShardWriter:
    """Writes one shard: documents appended as BOS + ids + EOS into fixed chunks; `close` writes its index last."""

    def __init__(self, path_stem: str, tokenizer: Tokenizer, tokenizer_name: str, chunk: int = CHUNK_TOKENS) -> None:
        from array_record.python import array_record_module  # deferred: only writers and readers need it

        self.stem, self.chunk = path_stem, chunk
        self._start = [] if tokenizer.start_id is None else [tokenizer.start_id]
        self._eos = tokenizer.eos_id
        self._meta = {"format": FORMAT, "tokenizer": tokenizer_name, "tokenizer_id": tokenizer.fingerprint(),
                      "chunk_tokens": chunk}
        for suffix in (".json", ".lengths.npy"):  # a rewritten shard is incomplete until it is closed
            if os.path.exists(path_stem + suffix):
                os.remove(path_stem + suffix)
        self._writer = array_record_module.ArrayRecordWriter(path_stem + ".arecord", "group_size:1")
        self._pending = np.zeros(0, np.int32)
        self.lengths: list[int] = []
        self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        full = np.concatenate([self._start, np.asarray(ids, np.int32), [self._eos]]).astype("<i4")
        self.lengths.append(len(full))
        self.tokens += len(full)
        self._pending = np.concatenate([self._pending, full])
        while len(self._pending) >= self.chunk:
            self._writer.write(self._pending[: self.chunk].tobytes())
            self._pending = self._pending[self.chunk:]

    def close(self) -> dict[str, Any]:
        if len(self._pending):
            self._writer.write(self._pending.tobytes())
        self._writer.close()
        np.save(self.stem + ".lengths.npy", np.asarray(self.lengths, np.int64))
        meta = {**self._meta, "documents": len(self.lengths), "tokens": self.tokens}
        with open(self.stem + ".json.tmp", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        os.replace(self.stem + ".json.tmp", self.stem + ".json")
        return meta


# --------------------------------------------------------------------------------------------- reading


class TokenStore:
    """The shards of a store directory: document lengths and starts, and token ranges read by chunk."""

    def __init__(self, directory: str, tokenizer_id: str) -> None:
        arecords = sorted(glob.glob(os.path.join(directory, "data-*-of-*.arecord")))
        if not os.path.isdir(directory) or not arecords:
            raise ConfigError(f"dataset_path={directory}: no token store here (no data-*-of-*.arecord); write one "
                              "with tools/prepare_data.py --store")
        metas = []
        for path in arecords:
            stem = path.removesuffix(".arecord")
            try:
                with open(stem + ".json", encoding="utf-8") as f:
                    metas.append(json.load(f))
            except FileNotFoundError:
                raise ConfigError(f"dataset_path={directory}: {os.path.basename(stem)} is incomplete (no .json: "
                                  "tools/prepare_data.py is still writing it or stopped)") from None
        shards = {int(os.path.basename(p).split("-of-")[1].split(".")[0]) for p in arecords}
        if len(shards) != 1 or len(arecords) != shards.pop():
            raise ConfigError(f"dataset_path={directory}: {len(arecords)} shards found, their names say otherwise; "
                              "a store is written whole by one tools/prepare_data.py --store")
        if any(m.get("format") != FORMAT for m in metas):
            raise ConfigError(f"dataset_path={directory}: store format {metas[0].get('format')}, this maxshard "
                              f"reads {FORMAT}; write it again with tools/prepare_data.py --store")
        if any(m["tokenizer_id"] != tokenizer_id for m in metas):
            raise ConfigError(f"dataset_path={directory}: the store was tokenized with {metas[0]['tokenizer']!r}, "
                              "which is not this run's tokenizer (tokenizer_path); re-run tools/prepare_data.py")
        self.directory, self.chunk = directory, int(metas[0]["chunk_tokens"])
        lengths = [np.load(p.removesuffix(".arecord") + ".lengths.npy") for p in arecords]
        self.lengths = np.concatenate(lengths).astype(np.int64)  # [documents], BOS..EOS each
        self.shard = np.repeat(np.arange(len(arecords)), [len(x) for x in lengths])  # of each document
        starts = [np.cumsum(x) - x for x in lengths]
        self.starts = np.concatenate(starts).astype(np.int64)  # in its shard's stream
        chunks = [-(-int(m["tokens"]) // self.chunk) for m in metas]
        self.chunk_base = np.concatenate([[0], np.cumsum(chunks)[:-1]]).astype(np.int64)  # first record per shard
        self.fingerprint = {"tokenizer": metas[0]["tokenizer_id"], "documents": int(len(self.lengths)),
                            "tokens": int(self.lengths.sum()), "chunk": self.chunk}
        self._source = grain.sources.ArrayRecordDataSource(arecords)
        self.records_read = 0  # chunks read by this process

    def read(self, pieces: list[tuple[int, int, int]]) -> tuple[list[np.ndarray], int]:
        """(document, first, end) token ranges of documents' streams -> their ids, and how many ids were read
        (whole chunks, each read once however many pieces share it)."""
        spans = []
        for doc, first, end in pieces:
            a, b = self.starts[doc] + first, self.starts[doc] + end
            spans.append((a // self.chunk, (b - 1) // self.chunk, a, b, self.chunk_base[self.shard[doc]]))
        wanted = sorted({int(base + k) for k0, k1, _, _, base in spans for k in range(k0, k1 + 1)})
        got = {k: self._source[k] for k in wanted}  # one by one: __getitems__ starts a thread pool per call
        out = []
        for k0, k1, a, b, base in spans:
            ids = np.frombuffer(b"".join(got[int(base + k)] for k in range(k0, k1 + 1)), "<i4")
            out.append(ids[a - k0 * self.chunk: b - k0 * self.chunk].astype(np.int32))
        return out, sum(len(r) // 4 for r in got.values())


def open_store(directory: str, tokenizer_id: str) -> TokenStore:
    return TokenStore(directory, tokenizer_id)


@dataclasses.dataclass(frozen=True)
class StoreRows:
    """Sequence j of one split's pair stream -> a packed row (module doc); also how many ids it read."""

    store: TokenStore
    documents: np.ndarray  # int64: store indices of the split's documents, in store order
    ends: np.ndarray  # int64: end of each of them in the split's pair stream (cumsum of lengths - 1)
    length: int

    @classmethod
    def of_split(cls, store: TokenStore, split: str, eval_fraction: float, length: int) -> "StoreRows":
        documents = sources.split_indices(sources.index_keys(len(store.lengths)), split, eval_fraction)
        ends = np.cumsum(store.lengths[documents] - 1)
        if len(documents) == 0 or ends[-1] < length:
            tokens = int(ends[-1]) if len(ends) else 0
            raise ConfigError(f"dataset_path={store.directory}: the {split} split holds {tokens} tokens, fewer than "
                              f"one row (max_target_length={length}; eval_fraction={eval_fraction})")
        return cls(store, documents, ends, length)

    @property
    def sequences(self) -> int:
        return int(self.ends[-1] // self.length)

    def __call__(self, sequence: int) -> dict[str, np.ndarray]:
        lo, hi = sequence * self.length, (sequence + 1) * self.length
        k = int(np.searchsorted(self.ends, lo, side="right"))
        pieces, pos = [], lo
        while pos < hi:
            start = int(self.ends[k - 1]) if k else 0
            first, end = pos - start, min(int(self.ends[k]), hi) - start
            pieces.append((int(self.documents[k]), first, end + 1))  # + 1: the last target
            pos, k = start + end, k + 1
        full, read = self.store.read(pieces)
        row = {"inputs": np.concatenate([f[:-1] for f in full]), "targets": np.concatenate([f[1:] for f in full]),
               "segment_ids": np.concatenate([np.full(len(f) - 1, i + 1, np.int32) for i, f in enumerate(full)]),
               "positions": np.concatenate([np.arange(len(f) - 1, dtype=np.int32) for f in full]),
               "loss_weights": np.ones(self.length, np.float32)}
        return {**row, "_read": np.int64(read)}


@dataclasses.dataclass(frozen=True)
class _LocalRow:
    """Local row k of this process -> global row number: the k // per_batch-th batch from `start`, at this process's
    k % per_batch-th row of it."""

    start: int
    batch: int
    mine: np.ndarray  # int64: the batch rows this process's devices hold, sorted

    def __call__(self, k: int) -> int:
        return self.start + (k // len(self.mine)) * self.batch + int(self.mine[k % len(self.mine)])


@dataclasses.dataclass(frozen=True)
class _GlobalRow:
    """Global row number -> its packed row. Holds no iterator, so grain's threads never keep one alive (a dropped
    iterator is closed by its finalizer, as eval iterators are)."""

    order: grain.MapDataset  # global row -> sequence
    rows: StoreRows

    def __call__(self, g: int) -> dict[str, np.ndarray]:
        return self.rows(self.order[g])


class StoreBatchIterator:
    """Global batches of store rows as jax.Arrays, each process reading only its devices' rows.

    The state is the next global row number (and the identity of the stream), the same in every process. `stats()`
    are the run's (every row of a store is full: batch x length tokens a step, no bad records left at run time);
    `local_reads()` are this process's: rows it built, their tokens, and the ids it read from the store.
    """

    def __init__(self, rows: StoreRows, seed: int | None, sharding: NamedSharding, batch: int, prefetch: int,
                 identity: dict[str, Any], label: str) -> None:
        self._rows, self._sharding, self._batch, self._prefetch = rows, sharding, batch, prefetch
        self._identity = {**identity, "format": f"store-{FORMAT}"}
        self._label = label
        shape = (batch, rows.length)
        mine = set()
        for index in sharding.addressable_devices_indices_map(shape).values():
            mine.update(range(*index[0].indices(batch)))
        self._mine = np.array(sorted(mine), np.int64)
        self._place = {int(g): i for i, g in enumerate(self._mine)}
        order = grain.MapDataset.range(rows.sequences)
        self._order = order if seed is None else order.shuffle(seed=seed)
        self._order = self._order.repeat(None)  # global row g -> sequence; each epoch its own permutation
        self._row = 0  # next global row
        self._local = {"rows": 0, "tokens": 0, "store_tokens": 0}
        self._held: list[Any] = []
        self._finalizer = weakref.finalize(self, _close, self._held)
        self._restart()

    def _restart(self) -> None:
        _close(self._held)
        to_global = _LocalRow(self._row, self._batch, self._mine)
        # local row k (endless) -> global row -> its packed row
        local = grain.MapDataset.range(2**62).map(to_global).map(_GlobalRow(self._order, self._rows))
        batches = local.to_iter_dataset(grain.ReadOptions(num_threads=_READ_THREADS,
                                                          prefetch_buffer_size=2 * len(self._mine)))
        batches = batches.batch(len(self._mine))
        if self._prefetch > 0:
            batches = ThreadPrefetchIterDataset(batches, prefetch_buffer_size=self._prefetch)
        self._held.append(iter(batches))

    def __iter__(self) -> "StoreBatchIterator":
        return self

    def __next__(self) -> dict[str, jax.Array]:
        local = next(self._held[0])  # {field: [rows of this process, length]}
        self._row += self._batch
        self._local["rows"] += len(self._mine)
        self._local["tokens"] += local["inputs"].size
        self._local["store_tokens"] += int(local["_read"].sum())
        shape = (self._batch, self._rows.length)

        def part(field: str):
            def fetch(index: tuple[slice, ...]) -> np.ndarray:
                rows = [self._place[g] for g in range(*index[0].indices(self._batch))]
                return np.array(local[field][rows][:, index[1]])
            return fetch

        return {k: jax.make_array_from_callback(shape, self._sharding, part(k)) for k in packing.FIELDS}

    def stats(self) -> dict[str, int]:
        return {f"data/tokens/{self._label}": self._row * self._rows.length, "data/skipped_records": 0}

    def local_reads(self) -> dict[str, int]:
        """This process's reads so far: rows it built, their tokens, and ids read from the store (whole chunks)."""
        return dict(self._local)

    def get_state(self) -> dict[str, Any]:
        return {"identity": dict(self._identity), "row": self._row}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("identity", {})
        changed = sorted(k for k in set(saved) | set(self._identity) if saved.get(k) != self._identity.get(k))
        if changed:
            diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {self._identity.get(k)!r}" for k in changed)
            raise ConfigError(f"the data iterator state was saved by a different input pipeline ({diffs})")
        self._row = int(state["row"])
        self._restart()

    def close(self) -> None:
        self._finalizer()


def _close(held: list[Any]) -> None:
    while held:
        close = getattr(held.pop(), "close", None)
        if close is not None:
            close()


def make_store_input(cfg: Config, sharding: NamedSharding, split: str, batch_size: int) -> StoreBatchIterator:
    """The iterator of `maxshard.data.make_input` for `dataset_type: store` (rows read by threads of this process:
    `grain_worker_count` does not apply, `grain_prefetch` batches are read ahead)."""
    pipeline.check_keys(cfg, split)
    tokenizer = make_tokenizer(cfg)
    store = open_store(cfg.dataset_path, tokenizer.fingerprint())
    rows = StoreRows.of_split(store, split, cfg.eval_fraction, cfg.max_target_length)
    seed = cfg.data_shuffle_seed if split == "train" else None
    identity = {"store": store.fingerprint, "split": split, "eval_fraction": cfg.eval_fraction,
                "length": cfg.max_target_length, "shuffle_seed": seed}
    label = catalog.source_specs(cfg)[0].label
    return StoreBatchIterator(rows, seed, sharding, batch_size, cfg.grain_prefetch, identity, label)
