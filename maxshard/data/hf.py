"""Hugging Face datasets (`dataset_type: hf`, or `hf:NAME` in a mixture), through the `datasets` library.

`dataset_path` is one of these (`source_kind` tells which, before anything is loaded):

    saved      a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (`load_from_disk`)
    files      local data files by extension (`*.jsonl`, `*.parquet`, `*.csv`, `*.txt`: `load_dataset(<builder>,
               data_files=...)`)
    directory  another existing directory (`load_dataset(DIR)`: `datasets` infers the builder from its files)
    hub        a hub name, `owner/name` or `name`: no local path of that name exists (needs the machine online)

`hf_split` picks the split. `hf_streaming` chooses how it is read (`read_as_stream`):

- map-style (this module): an Arrow table that `datasets` memory-maps from its cache. Rows are read from disk on
  access, never held in memory whole, and random access is cheap, so these sources shuffle, split, shard and resume
  exactly like the others. Rows are read through the Arrow column (about 1 us a row) rather than `dataset[i]` (about
  100 us: it formats a whole row as a dict). The `Dataset` object pickles as a reference to its cache files, so
  grain workers reopen it.
- streamed (`hf_stream`): `load_dataset(..., streaming=True)`, a `datasets.IterableDataset` read shard by shard as
  training goes. `auto` (the default) streams hub names only: map-style would first download the whole dataset
  into the Arrow cache (often more than the local disk holds, and hours before the first step), while local data is
  already on disk and map-style keeps its global shuffle. `always` streams local data too, `never` nothing.

`datasets` is an optional dependency (`pip install "maxshard[hf]"`); it is imported only for this source type.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from maxshard.data import files
from maxshard.data.chat import as_conversation
from maxshard.data.sources import BadRecord, Corpus, ReadOptions, as_text, row_keys
from maxshard.errors import ConfigError

if TYPE_CHECKING:
    from maxshard.data.hf_stream import HfStream

__all__ = ["HfDocuments", "hf_corpus", "open_source", "check_source", "check_fields", "load", "load_streamed",
           "source_kind", "read_as_stream", "check_text_field", "STREAMING_MODES"]

_BUILDERS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".jsonl.zst": "json", ".parquet": "parquet",
             ".csv": "csv", ".txt": "text"}
# A hub repository id: `name` or `owner/name`, letters, digits, '.', '_' and '-', not starting with '.' or '-'.
_HUB_NAME = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")
STREAMING_MODES = ("auto", "always", "never")


class HfDocuments(Sequence):
    """The `text_field` column of a map-style `datasets.Dataset`; the Arrow column is looked up once per process."""

    def __init__(self, dataset: Any, text_field: str, name: str, chat: bool = False,
                 whole: Callable[[dict, str], Any] | None = None) -> None:
        """`chat`: the column holds conversations (`messages_field`), not text; `whole`: a record is what
        `whole(row, where)` makes of the row's every column (select them first), e.g. a preference pair."""
        self.dataset, self.text_field, self.name, self.chat, self.whole = dataset, text_field, name, chat, whole
        self._column: Any = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        if self.whole is not None:
            return self.whole(self._row(int(index)), f"{self.name} row {index}")
        if self._column is None:
            self._column = self.dataset.data.column(self.text_field)
        value = self._column[int(index)]
        if self.chat:
            return as_conversation(value.as_py() if value.is_valid else None, f"{self.name} row {index}")
        return as_text(value.as_py() if value.is_valid else None, f"{self.name} row {index}")

    def _row(self, index: int) -> dict[str, Any]:
        """Every column of row `index` (Python values; None where a value is null)."""
        if self._column is None:
            self._column = {c: self.dataset.data.column(c) for c in self.dataset.column_names}
        return {c: column[index].as_py() if column[index].is_valid else None for c, column in self._column.items()}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_column": None}


def source_kind(path: str, key: str = "dataset_path") -> str:
    """"saved", "files", "directory" or "hub" (see the module doc); a missing local path that cannot be a hub name
    is a ConfigError, so a typo in a path is not sent to the hub as a dataset name."""
    if os.path.isdir(path):
        return "saved" if _saved_to_disk(path) else "directory"
    if _builder(path) is not None:
        return "files"
    if os.path.exists(path):
        raise ConfigError(f"{key}={path}: a Hugging Face source is a directory, a hub name or data files ending in "
                          f"{', '.join(_BUILDERS)}")
    if files.is_remote(path):
        raise ConfigError(f"{key}={path}: a remote Hugging Face source must name its data files, ending in "
                          f"{', '.join(_BUILDERS)}")
    if files.has_magic(path) or not _HUB_NAME.fullmatch(path):
        raise ConfigError(f"{key}={path}: no such file or directory, and not a hub name (owner/name)")
    return "hub"


def read_as_stream(path: str, mode: str, key: str = "dataset_path") -> bool:
    """Whether `hf_streaming=mode` reads `path` as a stream: `auto` streams hub names only."""
    if mode not in STREAMING_MODES:
        raise ConfigError(f"hf_streaming must be one of {', '.join(STREAMING_MODES)}, got {mode!r}")
    return mode == "always" or (mode == "auto" and source_kind(path, key) == "hub")


def load(path: str, split: str, key: str = "dataset_path") -> Any:
    """The map-style `datasets.Dataset` of `path` and `split`; every failure is a ConfigError naming `key`."""
    datasets = _datasets(path, key)
    kind = source_kind(path, key)
    with _loading(path, key):
        if kind == "saved":
            loaded = datasets.load_from_disk(path)
        else:
            loaded = _load_dataset(datasets, path, kind, split, streaming=False)
    loaded = _split_of(datasets, loaded, split, path, key)
    if getattr(loaded, "_indices", None) is not None:  # a select/shuffle view: make rows contiguous once
        loaded = loaded.flatten_indices()
    return loaded


def load_streamed(path: str, split: str, key: str = "dataset_path") -> Any:
    """The `datasets.IterableDataset` of `path` and `split`: nothing is downloaded or read beyond file listings yet.

    A `save_to_disk` directory becomes a stream through `Dataset.to_iterable_dataset()` (its Arrow files are local).
    """
    datasets = _datasets(path, key)
    kind = source_kind(path, key)
    with _loading(path, key):
        if kind == "saved":
            return _split_of(datasets, datasets.load_from_disk(path), split, path, key).to_iterable_dataset()
        return _load_dataset(datasets, path, kind, split, streaming=True)


def check_text_field(columns: Sequence[str] | None, text_field: str | tuple[str, ...], where: str,
                     name: str = "text_field") -> None:
    """ConfigError when the dataset's columns are known and `text_field` is not one of them (a wrong name; a
    tuple: none of them is)."""
    wanted = (text_field,) if isinstance(text_field, str) else text_field
    if columns is not None and not any(field in columns for field in wanted):
        raise ConfigError(f"{name}={' or '.join(wanted)}: {where} has no such column "
                          f"(columns: {', '.join(columns[:12])})")


def open_source(path: str, key: str, chat: bool, options: ReadOptions) -> Corpus | HfStream:
    """`dataset_type: hf` (maxshard/dataset_types.py): map-style, or a stream (`hf_stream`) when `hf_streaming` says
    so (`read_as_stream`); conversations (`chat`) only map-style."""
    if chat:
        return _chat_corpus(path, key, options)
    if read_as_stream(path, options.hf_streaming, key):
        from maxshard.data import hf_stream  # deferred: imports grain

        return hf_stream.open_stream(path, options.hf_split, options.text_field, key)
    return hf_corpus(path, options.hf_split, options.text_field, key)


def _chat_corpus(path: str, key: str, options: ReadOptions) -> Corpus:
    """Conversations in `messages_field`, map-style: streaming them is refused rather than done silently otherwise."""
    _refuse_streamed_chat(path, key, options.hf_streaming)
    return hf_corpus(path, options.hf_split, options.messages_field, key, chat=True)


def _refuse_streamed_chat(path: str, key: str, streaming: str) -> None:
    if streaming == "always" or (streaming == "auto" and source_kind(path, key) == "hub"):
        raise ConfigError(f"{key}={path}: chat data is read map-style (downloaded first), not streamed; "
                          "set hf_streaming=never")


def check_source(path: str, key: str, chat: bool, options: ReadOptions) -> None:
    """What `open_source` would refuse that is cheap to find (the preflight, `data/preflight.py`): `check_fields`
    with the field the reader needs, and chat data that would be streamed."""
    if chat:
        _refuse_streamed_chat(path, key, options.hf_streaming)
    check_fields(path, key, options.field(chat), options.hf_split, options.hf_streaming,
                 "messages_field" if chat else "text_field")


def check_fields(path: str, key: str, fields: str | tuple[str, ...], split: str, streaming: str,
                 name: str = "text_field") -> None:
    """A local path that does not exist and cannot be a hub name, an unknown `hf_streaming` (`read_as_stream`),
    and, for a `save_to_disk` directory (memory-mapped, nothing copied), a missing split, column (`fields`, one of
    them) or an empty split: ConfigError naming the key. Data files and hub names are left to the reader: reading
    their columns means converting or downloading them."""
    read_as_stream(path, streaming, key)
    if source_kind(path, key) != "saved":
        return
    dataset = load(path, split, key)
    check_text_field(dataset.column_names, fields, f"{key}={path}", name)
    if len(dataset) == 0:
        raise ConfigError(f"{key}={path}: the {split} split has no rows (empty corpus)")


def hf_corpus(path: str, split: str, text_field: str, key: str = "dataset_path", chat: bool = False) -> Corpus:
    """One Hugging Face dataset split as a corpus; split keys hash the dataset's path and the row number.

    `chat`: the column `text_field` (`messages_field`) holds conversations."""
    dataset = load(path, split, key)
    check_text_field(dataset.column_names, text_field, f"{key}={path}", "messages_field" if chat else "text_field")
    if len(dataset) == 0:
        raise ConfigError(f"{key}={path}: the {split} split has no rows (empty corpus)")
    name = os.path.basename(path.rstrip("/")) or path
    keys: np.ndarray = row_keys(f"{name}:{split}", len(dataset))
    return Corpus(HfDocuments(dataset.select_columns([text_field]), text_field, name, chat), keys, f"{key}={path}")


def _datasets(path: str, key: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f'{key}={path}: dataset_type=hf needs the datasets package: pip install "maxshard[hf]"') \
            from None
    return datasets


def _load_dataset(datasets: Any, path: str, kind: str, split: str, streaming: bool) -> Any:
    if kind == "files":
        return datasets.load_dataset(_builder(path), data_files=path, split=split, streaming=streaming)
    return datasets.load_dataset(path, split=split, streaming=streaming)


@contextlib.contextmanager
def _loading(path: str, key: str) -> Iterator[None]:
    """Any failure of `datasets` while loading (FileNotFoundError, DatasetNotFoundError, no network, a bad split)
    -> one ConfigError line naming `key`."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{key}={path}: cannot load it as a Hugging Face dataset ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _split_of(datasets: Any, loaded: Any, split: str, path: str, key: str) -> Any:
    """`loaded[split]` of a DatasetDict (a clear error for a missing split); a single Dataset as it is."""
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"hf_split={split}: {key}={path} has the splits {', '.join(loaded)}")
        return loaded[split]
    return loaded


def _builder(path: str) -> str | None:
    """The `datasets` builder for data files with this ending (longest ending first: .jsonl.gz before .gz)."""
    return next((b for s, b in sorted(_BUILDERS.items(), key=lambda item: -len(item[0])) if path.endswith(s)), None)


def _saved_to_disk(path: str) -> bool:
    """A `save_to_disk` directory: a Dataset has state.json, a DatasetDict has dataset_dict.json."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))
