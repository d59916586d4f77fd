"""The grain pipeline: documents -> tokens -> packed rows -> global batches -> global jax.Arrays.

    per source: split (indices)  ->  MapDataset: shuffle(seed) . repeat()  .  read + tokenize
        ->  IterDataset: mix sources by token weight, drop bad records (`mixture`)  .  pack (or pad; pairs whole)
        .  batch(global rows)  ->  prefetch (thread, or `grain_worker_count` processes)
        ->  GlobalBatchIterator: each process's rows of the global batch -> jax.Arrays, token and skip counters,
            the records read and skipped per source and the bound on bad ones (`record_counts`)

One global stream, whatever the layout (elastic restarts). Every process builds the same stream of packed rows from
all documents of the split, cuts it into global batches of `global_batch_size` rows, and hands JAX only the rows its
own devices hold (`jax.make_array_from_callback`). Row r of global batch b is the same row on 1 process or 64, on 8
devices or 2, so the iterator state is one global position (grain's counters over the global stream) that any
process count and any batch sharding can resume, with no document repeated or skipped, and the order of rows in a
batch (and so the loss) never depends on the layout. Worked example, global batch 4, rows r0 r1 r2 ... of the stream:

    batch 0 = r0 r1 r2 r3      2 processes x 2 devices (batch over 4 devices): process 0 keeps r0 r1, process 1 r2 r3
    batch 1 = r4 r5 r6 r7      stop after batch 1: the state is "8 rows of the global stream taken"
    batch 2 = r8 r9 r10 r11    resumed on 1 process x 2 devices: it builds batch 2 and keeps all four rows

The price is that every process reads and tokenizes the whole global batch's documents: P processes do P times the
input work of a per-process split (a line at startup says so; `benchmarks/data_processes.py`
measures it). A token store (`store.py`, `dataset_type: store`) has each process read only its own rows. A mixture
is part of the stream (its interleave state is in grain's), and so is a streamed Hugging Face dataset, which every
process reads whole (`hf_stream`).

A single source is a mixture of one. Sources whose documents are read a block at a time (Parquet row groups) are
shuffled block-wise (`shuffle.BlockShuffleMapDataset`) instead of globally. A streamed Hugging Face dataset has no
indices: it enters as an IterDataset of its documents, which grain's `WindowShuffleIterDataset` shuffles in windows
(its state is the stream's position, see `hf_stream`).

Shuffling and repeating happen on document indices in a MapDataset, where grain derives each epoch's order from
the seed and the epoch number, so the stream is a pure function of the config and an iterator state is small:
grain's own position counters, not buffered data.

With worker processes each worker packs its own slice of the document stream, so the batches differ from the
in-process ones (still deterministic): a state saved with one `grain_worker_count` cannot be restored into another,
and `set_state` says so. So is a state from another split, length or corpus. The global batch is not part of the
state: grain's position counts rows, so a run that changes its global batch (`elastic_allow_batch_change`) goes on
from the next row.

Edge cases, by design: a split with no documents is a ConfigError (never an endless wait for rows). With
`packing: false`, documents shorter than `max_target_length` are padded (loss weight 0), however short they all are:
that is what unpacked rows mean, not an error. An empty file is still a document (BOS -> EOS).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import grain
import jax
import numpy as np
from absl import flags
from grain.experimental import ThreadPrefetchIterDataset
from jax.sharding import NamedSharding

from maxshard.config import Config
from maxshard.data import bad_records, catalog, chat, hf_stream, packing, preference, sources
from maxshard.data.record_counts import RecordCounts
from maxshard.data.mixture import RECORDS, SKIPPED, SOURCE, TokenMixIterDataset
from maxshard.data.shuffle import BlockShuffleMapDataset
from maxshard.data.sources import BadRecord
from maxshard.data.tokenizer import Tokenizer, make_tokenizer
from maxshard.objectives import kinds as objective_kinds
from maxshard.errors import ConfigError

__all__ = ["PipelineOptions", "SourceStream", "StreamedSource", "local_batches", "mixed_batches", "GlobalBatchIterator",
           "make_grain_input"]
_STATE_FORMAT = 3  # 3: one global stream for every process (2: per-process streams, resumable only from 1 process)

_READ_THREADS = 2  # documents read and tokenized in parallel inside one process (the machine may have 2 cores)
_READ_BUFFER = 32  # documents read ahead of packing


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """Everything that shapes the global batch stream (all but `batch` and `prefetch` must match for a state to be
    restored: grain's position counts rows)."""

    length: int
    batch: int  # rows of a global batch
    packing: bool = True
    shuffle_seed: int | None = 0  # None: documents in corpus order (eval)
    worker_count: int = 0
    prefetch: int = 2
    pairs: bool = False  # preference pairs, each whole in one row (`packing.pack_pairs`)


@dataclasses.dataclass(frozen=True)
class SourceStream:
    """One source of the global stream: its documents, the indices of those in the split, its weight."""

    documents: Sequence[str | np.ndarray | BadRecord]
    indices: np.ndarray  # int64: the documents of the split
    weight: float = 1.0
    name: str = "documents"  # for messages
    blocks: np.ndarray | None = None  # block of each of `indices` (None: shuffle globally)
    encoder: chat.ChatEncoder | preference.PreferenceEncoder | None = None  # conversations / preference records


@dataclasses.dataclass(frozen=True)
class StreamedSource:
    """One streamed source of the global stream: an endless IterDataset of its documents, its weight."""

    documents: grain.IterDataset  # text or BadRecord: the whole split (`hf_stream`)
    weight: float = 1.0
    name: str = "documents"  # for messages
    shuffle_window: int = hf_stream.SHUFFLE_WINDOW  # documents per train shuffle window


def _document_pair(document: str | np.ndarray | chat.Conversation | preference.Preference | BadRecord,
                   tokenizer: Tokenizer, where: str, encoder: Any = None) -> dict[str, np.ndarray] | BadRecord:
    """A document -> {inputs, targets} (a conversation: and its chat.WEIGHT; a preference record: its pair
    example), or its BadRecord."""
    if isinstance(document, (BadRecord, dict)):  # a dict: a pair example a stream encoded already (`hf_stream`)
        return document
    if isinstance(document, (chat.Conversation, preference.Preference)):
        assert encoder is not None, "a chat or preference source without its encoder"
        return encoder(document, where)
    if isinstance(document, np.ndarray):
        tokens = document
    else:
        try:
            tokens = tokenizer.encode_array(document)
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON) is no UTF-8 text
            return BadRecord("invalid UTF-8", where)
    return packing.document_pair(tokens, tokenizer.start_id, tokenizer.eos_id)


@dataclasses.dataclass(frozen=True)
class _LoadPair:
    """Document index -> {inputs, targets} of that document, or its BadRecord (picklable: runs in grain workers)."""

    documents: Sequence[str | np.ndarray | BadRecord]
    tokenizer: Tokenizer
    encoder: chat.ChatEncoder | preference.PreferenceEncoder | None = None  # chat and preference sources

    def __call__(self, index: int) -> dict[str, np.ndarray] | BadRecord:
        return _document_pair(self.documents[int(index)], self.tokenizer, self._where(int(index)), self.encoder)

    def _where(self, index: int) -> str:
        """Where document `index` is, for a record found bad after reading (a template refused it, too long): the
        reader's own words where it has them (JSONL: file and line), else its index."""
        where = getattr(self.documents, "where", None)
        return where(index) if callable(where) else f"document {index}"


@dataclasses.dataclass(frozen=True)
class _TokenizePair:
    """A streamed document -> {inputs, targets}, or its BadRecord (picklable: runs in grain workers)."""

    tokenizer: Tokenizer

    def __call__(self, document: str | BadRecord) -> dict[str, np.ndarray] | BadRecord:
        return _document_pair(document, self.tokenizer, "a streamed document")


def local_batches(
    documents: Sequence[str | np.ndarray], indices: np.ndarray, tokenizer: Tokenizer, opts: PipelineOptions
) -> grain.IterDataset:
    """An endless IterDataset of global batches of one source: {field: [batch, length]} arrays."""
    return mixed_batches([SourceStream(documents, np.asarray(indices, np.int64))], tokenizer, opts)


def mixed_batches(streams: Sequence[SourceStream | StreamedSource], tokenizer: Tokenizer,
                  opts: PipelineOptions) -> grain.IterDataset:
    """An endless IterDataset of batches of several sources mixed by token weight; rows also carry SOURCE, SKIPPED
    and RECORDS (`mixture`).

    The mixture asks one source at a time for its next document and keeps each source's iterator state, so a
    stream mixes like any other source (it checks its own epochs for usable documents: epoch size None)."""
    parents = [_source_pairs(s, tokenizer, _source_seed(opts.shuffle_seed, i)) for i, s in enumerate(streams)]
    epoch_sizes = [len(s.indices) if isinstance(s, SourceStream) else None for s in streams]
    pairs = TokenMixIterDataset(parents, [s.weight for s in streams], epoch_sizes,
                                [s.name for s in streams], token_cap=None if opts.packing else opts.length,
                                row_length=opts.length if opts.packing and not opts.pairs else None)
    extra = (SOURCE, SKIPPED, RECORDS, chat.WEIGHT)
    if opts.pairs:
        rows = packing.pack_pairs(pairs, opts.length, opts.packing, extra)
    elif opts.packing:
        rows = packing.pack(pairs, opts.length, extra)
    else:
        rows = pairs.map(functools.partial(packing.pad_to_length, length=opts.length, pad_id=tokenizer.pad_id,
                                           extra=extra))
    batches = rows.batch(opts.batch, drop_remainder=True)
    if opts.worker_count > 0:
        _absl_flags_parsed()
        options = grain.MultiprocessingOptions(num_workers=opts.worker_count,
                                               per_worker_buffer_size=max(opts.prefetch, 1))
        return batches.mp_prefetch(options)
    if opts.prefetch > 0:
        return ThreadPrefetchIterDataset(batches, prefetch_buffer_size=opts.prefetch)
    return batches


def _source_pairs(stream: SourceStream | StreamedSource, tokenizer: Tokenizer, seed: int | None) -> grain.IterDataset:
    """One source's endless stream of document pairs (or BadRecords), read ahead by a few threads."""
    if isinstance(stream, StreamedSource):
        return _streamed_pairs(stream, tokenizer, seed)
    if seed is None:
        ds = grain.MapDataset.source(stream.indices)
    elif stream.blocks is None:
        ds = grain.MapDataset.source(stream.indices).shuffle(seed=seed)
    else:
        ds = BlockShuffleMapDataset(stream.indices, stream.blocks, seed)
    ds = ds.repeat(None).map(_LoadPair(stream.documents, tokenizer, stream.encoder))
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=_READ_THREADS, prefetch_buffer_size=_READ_BUFFER))


def _streamed_pairs(stream: StreamedSource, tokenizer: Tokenizer, seed: int | None) -> grain.IterDataset:
    """A stream's document pairs: in stream order (eval), or shuffled in windows (train, `hf_stream.window_shuffled`)."""
    documents = hf_stream.window_shuffled(stream.documents, seed, stream.shuffle_window)
    return documents.map(_TokenizePair(tokenizer))


def _source_seed(seed: int | None, source: int) -> int | None:
    """Each source its own shuffle seed; source 0 keeps `data_shuffle_seed` itself."""
    return None if seed is None else (seed + source * 0x9E3779B1) % 2**32


def _absl_flags_parsed() -> None:
    """grain's worker processes read absl flags; a program that never called absl.app has not parsed them."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class GlobalBatchIterator:
    """Global numpy batches -> global jax.Arrays in `sharding`; get_state/set_state give JSON-able resume points.

    Each process computes the whole global batch and gives JAX the rows its devices hold, so the state is the same
    in every process and restores into any process count or batch sharding (module docstring). It also counts, for
    the rows delivered, per source, the tokens taken (`labels`), the records read and the bad ones skipped to fill
    them: `stats()`. The counts are the run's (every process sees every row), saved with the position, so a resumed
    run continues them. The records' counts, their bound and the first reasons are `record_counts.RecordCounts`'.
    """

    def __init__(self, batches: grain.IterDataset, sharding: NamedSharding, identity: dict[str, Any],
                 labels: Sequence[str] = ("documents",), names: Sequence[str] | None = None,
                 max_bad_fraction: float | None = None, examples_path: str | None = None) -> None:
        """`names`: each source as messages name it (default: `labels`); `max_bad_fraction`: the bound on each
        source's share of bad records (None: none); `examples_path`: where to write the first bad records (None:
        nowhere)."""
        self._held = [iter(batches)]  # the grain iterator; a list so that closing can drop it
        self._sharding = sharding
        self._identity = {**identity, "format": _STATE_FORMAT}
        self._labels = list(labels)
        self._tokens = np.zeros(len(self._labels), np.int64)  # tokens per source in delivered rows
        self._records = RecordCounts(names or labels, max_bad_fraction, examples_path)  # read and skipped
        # Close and drop grain's iterators before interpreter shutdown tears down the modules their __del__ uses.
        self._finalizer = weakref.finalize(self, _close, self._held)

    @property
    def _iter(self) -> Any:
        if not self._held:
            raise RuntimeError("the data iterator is closed")
        return self._held[0]

    def __iter__(self) -> "GlobalBatchIterator":
        return self

    def __next__(self) -> dict[str, jax.Array]:
        try:
            rows = next(self._iter)  # {field: [batch, length]}: the whole global batch
        except ConfigError as e:  # grain appends notes about its traceback filtering: keep the one-line message
            raise ConfigError(str(e).splitlines()[0]) from None
        real = rows["segment_ids"] > 0
        self._tokens += np.bincount(rows[SOURCE][real].astype(np.int64), minlength=len(self._labels))
        self._records.count(rows, self._iter.get_state)
        return {k: _global_array(np.asarray(rows[k]), self._sharding) for k in packing.FIELDS}

    def stats(self) -> dict[str, int]:
        """Metrics of the run: `data/tokens/<source>` (tokens delivered so far), `data/skipped_records` (bad records
        dropped to fill them) and `data/records_read` (records read to fill them, bad ones included)."""
        counts = {f"data/tokens/{label}": int(n) for label, n in zip(self._labels, self._tokens)}
        return {**counts, **self._records.stats()}

    def get_state(self) -> dict[str, Any]:
        """The position in the global stream: the same in every process, restorable into any process count."""
        stats = {"tokens": self._tokens.tolist(), **self._records.state()}
        return {"identity": dict(self._identity), "grain": _to_json(self._iter.get_state()), "stats": stats}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = _upgraded(state.get("identity", {}))
        changed = sorted(k for k in set(saved) | set(self._identity) if saved.get(k) != self._identity.get(k))
        if changed:
            diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {self._identity.get(k)!r}" for k in changed)
            raise ConfigError(f"the data iterator state was saved by a different input pipeline ({diffs})")
        grain_state = _from_json(state["grain"])
        self._iter.set_state(grain_state)
        stats = state["stats"]
        self._tokens = np.asarray(stats["tokens"], np.int64)
        self._records.restore(stats, grain_state)

    def close(self) -> None:
        """Stops worker processes and prefetch threads (also done on garbage collection and at exit)."""
        self._finalizer()


def _global_array(rows: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """[batch, length] rows of the global batch -> a jax.Array; only this process's devices' rows are copied.

    Copied: from workers the rows arrive in shared memory, which a CPU jax.Array would alias and keep alive."""
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: np.array(rows[index]))


def _upgraded(identity: dict[str, Any]) -> dict[str, Any]:
    """A format-2 identity written by one process describes the global stream of format 3: the same rows, batched
    by the same count; states of several processes were separate streams and stay refused."""
    if identity.get("format") != 2 or identity.get("process") != "0/1":
        return identity
    upgraded = {k: v for k, v in identity.items() if k not in ("process", "local_batch")}
    return {**upgraded, "format": _STATE_FORMAT}


def _close(held: list[Any]) -> None:
    while held:
        iterator = held.pop()
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def _to_json(x: Any) -> Any:
    """grain states hold tuples, which JSON would turn into lists that grain no longer recognizes: tag them."""
    if isinstance(x, dict):
        return {str(k): _to_json(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return {"__tuple__": [_to_json(v) for v in x]}
    if isinstance(x, list):
        return [_to_json(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def _from_json(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__tuple__"}:
            return tuple(_from_json(v) for v in x["__tuple__"])
        return {k: _from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    return x


# --------------------------------------------------------------------------------------------- from a config


def check_keys(cfg: Config, split: str) -> None:
    """The data keys every reader of documents shares, checked before anything is read (one line each)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 0 <= cfg.eval_fraction < 1:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {cfg.eval_fraction}")
    if not 0 <= cfg.data_shuffle_seed < 2**32:
        raise ConfigError(f"data_shuffle_seed must be in [0, 2**32), got {cfg.data_shuffle_seed}")
    if cfg.grain_worker_count < 0 or cfg.grain_prefetch < 0:
        raise ConfigError(f"grain_worker_count and grain_prefetch must be >= 0, got {cfg.grain_worker_count} "
                          f"and {cfg.grain_prefetch}")


def split_documents(corpus: sources.Corpus, cfg: Config, split: str) -> np.ndarray:
    """int64 indices of the split's documents: what every process reads (module docstring)."""
    in_split = sources.split_indices(corpus.keys, split, cfg.eval_fraction)
    if len(in_split) == 0:
        raise ConfigError(f"{corpus.where}: the {split} split is empty ({len(corpus)} documents, "
                          f"eval_fraction={cfg.eval_fraction})")
    return in_split


def make_grain_input(cfg: Config, sharding: NamedSharding, split: str, batch_size: int) -> GlobalBatchIterator:
    """The iterator of `maxshard.data.make_input` for every real-data source and for mixtures: global batches of
    `batch_size` rows, the same stream in every process."""
    check_keys(cfg, split)
    tokenizer = make_tokenizer(cfg)
    specs = catalog.source_specs(cfg)
    template = chat.run_template(cfg)
    pairs = cfg.dataset_type == "preference"  # the config refuses it in a mixture
    unpaired = objective_kinds.kind(cfg.objective).unpaired  # KTO reads unpaired records, DPO & co. pairs
    encoder = (preference.PreferenceEncoder(tokenizer, template, cfg.max_target_length, unpaired) if pairs
               else None if template is None else chat.ChatEncoder(template, tokenizer, cfg.max_target_length))
    streams: list[SourceStream | StreamedSource] = []
    for spec in specs:
        corpus = catalog.open_corpus(spec, tokenizer.fingerprint(), cfg.text_field, cfg.hf_split, cfg.data_cache_dir,
                                     cfg.hf_streaming, cfg.messages_field)
        if not isinstance(corpus, sources.Corpus):  # a streamed Hugging Face dataset, read whole by every process
            documents = corpus.documents(split, cfg.eval_fraction, 0, 1, encoder if pairs else None)
            streams.append(StreamedSource(documents, spec.weight, corpus.where, hf_stream.SHUFFLE_WINDOW))
            continue
        indices = split_documents(corpus, cfg, split)
        blocks = None if corpus.blocks is None else corpus.blocks[indices]
        streams.append(SourceStream(corpus.documents, indices, spec.weight, corpus.where, blocks,
                                    encoder if spec.chat or pairs else None))
    opts = PipelineOptions(
        length=cfg.max_target_length,
        batch=batch_size,
        packing=cfg.packing,
        shuffle_seed=cfg.data_shuffle_seed if split == "train" else None,
        worker_count=cfg.grain_worker_count,
        prefetch=cfg.grain_prefetch,
        pairs=pairs,
    )
    identity = {"where": [s.name for s in streams], "weights": [s.weight for s in streams], "split": split,
                "documents": [int(len(s.indices)) if isinstance(s, SourceStream) else "streamed" for s in streams],
                "tokenizer": tokenizer.fingerprint(), "text_field": cfg.text_field, **dataclasses.asdict(opts)}
    if template is not None:  # another template or field makes another stream
        identity.update(chat_template=template.digest, messages_field=cfg.messages_field)
    del identity["prefetch"]  # prefetching depth does not change the stream
    del identity["batch"]  # grain's position counts rows, not batches: a changed global batch goes on from the same row
    if split == "train" and jax.process_count() > 1 and jax.process_index() == 0:
        print(f"note: each of the {jax.process_count()} processes reads and tokenizes the whole global batch "
              f"({jax.process_count()}x the input work); a token store reads only each process's rows "
              "(tools/prepare_data.py --store, dataset_type=store)", flush=True)
    examples = bad_records.examples_path(cfg.run_dir, jax.process_index() == 0) if split == "train" else None
    return GlobalBatchIterator(mixed_batches(streams, tokenizer, opts), sharding, identity, [s.label for s in specs],
                               [s.name for s in streams], cfg.max_bad_record_fraction, examples)
