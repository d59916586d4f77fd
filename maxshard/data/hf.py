"""Hugging Face datasets (`dataset_type: hf`, or `hf:NAME` in a mixture), through the `datasets` library.

`dataset_path` is a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (read with
`load_from_disk`), local data files (`*.jsonl`, `*.parquet`, `*.csv`, `*.txt`: `load_dataset(<builder>,
data_files=...)`), or a hub name (`load_dataset(NAME)`, when the machine is online). `hf_split` picks the split.

All three end as an Arrow table that `datasets` memory-maps from its cache: rows are read from disk on access, never
held in memory whole, and random access is cheap, so these sources shuffle, split, shard and resume exactly like the
others. Rows are read through the Arrow column (about 1 us a row) rather than `dataset[i]` (about 100 us: it formats
a whole row as a dict). The `Dataset` object pickles as a reference to its cache files, so grain workers reopen it.

`datasets` is an optional dependency (`pip install "maxshard[hf]"`); it is imported only for this source type.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from maxshard.config import ConfigError
from maxshard.data.sources import BadRecord, Corpus, row_keys

__all__ = ["HfDocuments", "hf_corpus", "load"]

_BUILDERS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".jsonl.zst": "json", ".parquet": "parquet",
             ".csv": "csv", ".txt": "text"}


class HfDocuments(Sequence):
    """The `text_field` column of a map-style `datasets.Dataset`; the Arrow column is looked up once per process."""

    def __init__(self, dataset: Any, text_field: str, name: str) -> None:
        self.dataset, self.text_field, self.name = dataset, text_field, name
        self._column: Any = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> str | BadRecord:  # type: ignore[override]
        if self._column is None:
            self._column = self.dataset.data.column(self.text_field)
        value = self._column[int(index)]
        where = f"{self.name} row {index}"
        if not value.is_valid:
            return BadRecord("missing field", where)
        text = value.as_py()
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                return BadRecord("invalid UTF-8", where)
        if not isinstance(text, str):
            return BadRecord("not a string", where)
        return text if text else BadRecord("empty text", where)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_column": None}


def load(path: str, split: str, key: str = "dataset_path") -> Any:
    """The map-style `datasets.Dataset` of `path` and `split`; every failure is a ConfigError naming `key`."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f'{key}={path}: dataset_type=hf needs the datasets package: pip install "maxshard[hf]"') \
            from None
    try:
        if os.path.isdir(path) and _saved_to_disk(path):
            loaded = datasets.load_from_disk(path)
        else:
            builder = next((b for s, b in _BUILDERS.items() if path.endswith(s)), None)
            loaded = (datasets.load_dataset(builder, data_files=path, split=split) if builder
                      else datasets.load_dataset(path, split=split))
    except Exception as e:  # noqa: BLE001 - FileNotFoundError, DatasetNotFoundError, connection errors, ...
        raise ConfigError(f"{key}={path}: cannot load it as a Hugging Face dataset ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"hf_split={split}: {key}={path} has the splits {', '.join(loaded)}")
        loaded = loaded[split]
    if getattr(loaded, "_indices", None) is not None:  # a select/shuffle view: make rows contiguous once
        loaded = loaded.flatten_indices()
    return loaded


def hf_corpus(path: str, split: str, text_field: str, key: str = "dataset_path") -> Corpus:
    """One Hugging Face dataset split as a corpus; split keys hash the dataset's path and the row number."""
    dataset = load(path, split, key)
    if text_field not in dataset.column_names:
        raise ConfigError(f"text_field={text_field}: {key}={path} has no such column "
                          f"(columns: {', '.join(dataset.column_names[:12])})")
    if len(dataset) == 0:
        raise ConfigError(f"{key}={path}: the {split} split has no rows (empty corpus)")
    name = os.path.basename(path.rstrip("/")) or path
    keys: np.ndarray = row_keys(f"{name}:{split}", len(dataset))
    return Corpus(HfDocuments(dataset.select_columns([text_field]), text_field, name), keys, f"{key}={path}")


def _saved_to_disk(path: str) -> bool:
    """A `save_to_disk` directory: a Dataset has state.json, a DatasetDict has dataset_dict.json."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))
