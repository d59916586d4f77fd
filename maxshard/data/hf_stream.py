"""A Hugging Face dataset read as a stream (`datasets.IterableDataset`): hub names, or any hf source with
`hf_streaming: always` (see `maxshard.data.hf` for which sources stream).

A stream has no length and no random access, so the rules the random-access sources follow through document
indices are kept here through the stream itself, with the `datasets` library doing the reading:

- Train/eval split: a document is in eval when a hash of its text, read as a fraction of 2**64, is below
  `eval_fraction` (`InSplit`, applied with `IterableDataset.filter` before sharding). A stream has no row number
  that is independent of how it is sharded; the text is, so a document stays on its side whatever the process
  count, shard order or epoch, and exact duplicates never straddle the split. Bad records (no text to hash) go to
  train, where they are counted. The price: the eval iterator reads about 1 / eval_fraction documents of the stream
  for each eval document it keeps (from the hub: over the network, at every evaluation).
- Processes: the training pipeline reads the whole stream in every process (`documents(..., 0, 1)`: one global
  stream whose position any process count resumes, see `pipeline`). A split by node is still available:
  `datasets.distributed.split_dataset_by_node(ds, rank, world_size)`. When the number of shards (files)
  divides by `world_size` each process reads whole shards, else every process reads the stream and keeps every
  `world_size`-th document; either way the shares are disjoint and complete. grain worker processes
  (`grain_worker_count`) split once more (`StreamDocuments.set_slice`): `datasets` makes worker w of W in process
  p node p * W + w of P * W, so every process must run the same worker count (it does: one config).
- Order: eval reads the stream in its order, the same every epoch. Train reads epoch e after `set_epoch(e)`
  (`datasets` reorders the shards of each epoch after the first), and the pipeline shuffles documents in windows of
  `SHUFFLE_WINDOW` with grain's `WindowShuffleIterDataset`, seeded by `data_shuffle_seed`. `IterableDataset.shuffle`
  is not used: its buffer is not part of `state_dict()` (its docs say a resumed run refills the buffer with other
  data), while grain's window shuffle saves where its window started and reads the window again on restore.
- Resume: the iterator state is the epoch and `IterableDataset.state_dict()` (JSON), restored with
  `load_state_dict()` on a fresh copy of the dataset: the batches after a restore are those of an uninterrupted run.
  Restoring re-reads the current shard up to the saved record (and the shuffle window), nothing more.
- Bad records: the same rule as the other HF sources (`sources.as_text`); the mixture counts them. (A line that is
  not JSON at all is not a record to `datasets`: it fails the file, a one-line ConfigError.) A stream cannot
  tell in advance that it holds no usable document, so an epoch (of this process's share) that ends without one is
  a ConfigError here: an empty split, a process without documents or a wrong `text_field` never loop forever.
- Records, not text (`dataset_type: preference` and `prompts`): the source's reader gives `whole`, which turns a
  row into its record (or BadRecord), and the pipeline may give `encode`, which turns the record into what the
  stream yields (a preference pair's example, a prompt's ids), so "usable" above means usable after encoding: a
  stream whose pairs are all too long stops as one whose texts are all empty does. The split hashes the JSON of the
  record's key fields (text or messages).

`datasets` is imported only when a stream is opened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import Any

import grain

from maxshard.data import hf
from maxshard.data.sources import BadRecord, as_text
from maxshard.errors import ConfigError

__all__ = ["HfStream", "InSplit", "StreamDocuments", "open_stream", "window_shuffled", "SHUFFLE_WINDOW"]

# Documents per shuffle window of a streamed train split: what the window holds in memory (text), and what a
# restore reads again. Hub datasets are usually written in random order already; the window mixes neighbours.
SHUFFLE_WINDOW = 1024


@dataclasses.dataclass(frozen=True)
class HfStream:
    """One streamed source, opened (its files listed, nothing read) but not yet split or sharded."""

    dataset: Any  # datasets.IterableDataset: the whole `hf_split`
    text_field: str | tuple[str, ...]  # the text, or a record's key fields (what the split hashes)
    where: str  # "dataset_path=..." for messages
    whole: Callable[[dict[str, Any], str], Any] | None = None  # row -> record or BadRecord; None: the text field

    def documents(self, split: str, eval_fraction: float, process_index: int, process_count: int,
                  encode: Callable[[Any, str], Any] | None = None) -> StreamDocuments:
        """This process's documents of `split` ("train" or "eval"), repeated forever (train reordered each epoch);
        `encode` (record, where) -> item or BadRecord, applied to each record (module docstring)."""
        in_split = self.dataset
        if eval_fraction > 0 or split == "eval":
            in_split = in_split.filter(InSplit(self.text_field, eval_fraction, split == "eval"))
        where = f"{self.where} ({split} split, process {process_index} of {process_count})"
        reader = _Reader(self.text_field, self.whole, encode)
        return StreamDocuments(in_split, reader, where, ((process_index, process_count),),
                               reorder_epochs=split == "train")


def window_shuffled(documents: Any, seed: int | None, window: int | None = None) -> Any:
    """A stream's items in stream order (`seed` None: eval), or shuffled in windows of `window` (default
    SHUFFLE_WINDOW, read at the call) (train). grain's
    window shuffle seeds window w with seed + w as a uint32: halving the seed leaves 2**31 windows before that could
    overflow (2e12 items at 1024 a window)."""
    if seed is None:
        return documents
    from grain.experimental import WindowShuffleIterDataset

    return WindowShuffleIterDataset(documents, window_size=window or SHUFFLE_WINDOW, seed=seed >> 1)


def open_stream(path: str, split: str, text_field: str | tuple[str, ...], key: str = "dataset_path",
                whole: Callable[[dict[str, Any], str], Any] | None = None) -> HfStream:
    """`path`'s `split` as a stream; a `text_field` (for records: none of their key fields) that is not among its
    known columns is a ConfigError now."""
    dataset = hf.load_streamed(path, split, key)
    fields = (text_field,) if isinstance(text_field, str) else text_field
    columns = dataset.column_names
    if columns is not None and not set(fields) & set(columns):
        hf.check_text_field(columns, fields[0] if len(fields) == 1 else " or ".join(fields), f"{key}={path}",
                            "text_field" if whole is None else "record field")
    return HfStream(dataset, text_field, f"{key}={path}", whole)


@dataclasses.dataclass(frozen=True)
class _Reader:
    """A row of the stream -> what it yields: its text (or BadRecord), or `encode(whole(row))` (picklable)."""

    text_field: str | tuple[str, ...]
    whole: Callable[[dict[str, Any], str], Any] | None
    encode: Callable[[Any, str], Any] | None

    def __call__(self, example: dict[str, Any], where: str) -> Any:
        if self.whole is None:
            record = as_text(example.get(self.text_field), where)
        else:
            record = self.whole(example, where)
        if self.encode is None or isinstance(record, BadRecord):
            return record
        return self.encode(record, where)


@dataclasses.dataclass(frozen=True)
class InSplit:
    """The `filter` of one split: True for the documents of eval (`want_eval`) or of train (picklable for workers)."""

    text_field: str | tuple[str, ...]  # a tuple: a record's key fields, hashed as the JSON of their values
    eval_fraction: float
    want_eval: bool

    def __call__(self, example: dict[str, Any]) -> bool:
        if isinstance(self.text_field, str):
            text = example.get(self.text_field)
        else:
            values = [example.get(f) for f in self.text_field]
            text = None if all(v is None for v in values) else json.dumps(values, sort_keys=True, ensure_ascii=False)
        if isinstance(text, str):
            text = text.encode("utf-8", "surrogatepass")
        if not isinstance(text, bytes) or not text:  # a bad record: train counts it
            return not self.want_eval
        key = int.from_bytes(hashlib.sha256(text).digest()[:8], "little")
        return (key / 2.0**64 < self.eval_fraction) == self.want_eval


class StreamDocuments(grain.IterDataset):
    """An endless stream of this process's documents (text or BadRecord) of one split; the source of a stream."""

    def __init__(self, dataset: Any, reader: _Reader, where: str, splits: tuple[tuple[int, int], ...],
                 reorder_epochs: bool):
        """`splits`: (rank, world_size) applied in turn with `split_dataset_by_node` (process, then grain worker)."""
        super().__init__()
        self._dataset, self._reader, self._where = dataset, reader, where
        self._splits, self._reorder_epochs = splits, reorder_epochs

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """grain's worker processes: worker `sl.start` of `sl.step` reads its share of this process's documents."""
        if sequential_slice:
            raise ValueError("a streamed Hugging Face dataset cannot be sliced sequentially")
        self._splits = (*self._splits, (sl.start or 0, sl.step or 1))
        self._where = f"{self._where} (grain worker {sl.start or 0} of {sl.step or 1})"

    def __iter__(self) -> grain.DatasetIterator:
        return _StreamIterator(self._dataset, self._reader, self._where, self._splits, self._reorder_epochs)

    def __str__(self) -> str:
        return f"StreamDocuments({self._where})"


class _StreamIterator(grain.DatasetIterator):
    """Reads epoch after epoch; the state is the epoch and `datasets`' own position in it."""

    def __init__(self, dataset: Any, reader: _Reader, where: str, splits: tuple[tuple[int, int], ...],
                 reorder_epochs: bool):
        super().__init__()
        self._base, self._reader, self._where = dataset, reader, where
        self._splits, self._reorder_epochs = splits, reorder_epochs
        self._epoch = self._read = self._good = 0  # epoch; records read and usable documents in it
        self._restart(None)

    def _restart(self, position: dict[str, Any] | None) -> None:
        """Starts the current epoch at `position` (None: its beginning) on a fresh copy of the dataset.

        Fresh, because `IterableDataset.load_state_dict` sticks to the object: a later pass over the same object in
        the same epoch number (every eval epoch) would start again at the restored position.
        """
        from datasets.distributed import split_dataset_by_node  # deferred: `datasets` is optional

        dataset = self._base
        for rank, world_size in self._splits:
            dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
        if self._reorder_epochs:
            dataset.set_epoch(self._epoch)
        if position is not None:
            dataset.load_state_dict(position)
        self._dataset, self._position = dataset, position
        self._examples = iter(dataset)

    def __next__(self) -> str | BadRecord:
        while True:
            try:
                example = next(self._examples)
            except StopIteration:
                self._next_epoch()
                continue
            except Exception as e:  # noqa: BLE001 - a file that is not what its name says, a lost connection, ...
                raise ConfigError(f"{self._where}: cannot read record {self._read + 1} of epoch {self._epoch} "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
            self._position = None  # from now on the dataset's own state_dict() is the position
            self._read += 1
            document = self._reader(example, f"{self._where} record {self._read} of epoch {self._epoch}")
            self._good += not isinstance(document, BadRecord)
            return document

    def _next_epoch(self) -> None:
        if self._good == 0:
            raise ConfigError(f"{self._where}: a whole epoch ({self._read} records) held no usable document; check "
                              "text_field, eval_fraction and the data")
        self._epoch, self._read, self._good = self._epoch + 1, 0, 0
        self._restart(None)

    def get_state(self) -> dict[str, Any]:
        position = self._position if self._position is not None or self._read == 0 else self._dataset.state_dict()
        return {"epoch": self._epoch, "read": self._read, "good": self._good, "position": position}

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._read, self._good = int(state["epoch"]), int(state["read"]), int(state["good"])
        self._restart(state["position"])

    def close(self) -> None:
        """Closes the `datasets` generator now, not at interpreter exit (where its cleanup finds modules gone)."""
        close = getattr(self._examples, "close", None)
        if close is not None and not self._closed:
            try:
                close()
            except ValueError:  # still running in a prefetch thread: let garbage collection close it
                pass
        super().close()

    def __str__(self) -> str:
        return f"StreamIterator({self._where})"
