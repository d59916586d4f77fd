"""Parquet documents: the `text_field` column of every row, read one row group at a time.

A document index maps to (file, row group, row). Reading a document decodes only its row group's text column
(`ParquetFile.read_row_group(i, columns=[text_field])`), and the reader keeps the last few decoded row groups, so a
shard is never held in memory whole. For that cache to hit, the pipeline shuffles Parquet documents block-wise
(`maxshard.data.shuffle`): each row group is one block of the corpus (`Corpus.blocks`).

Startup reads only the files' footers (row counts and schemas) and first bytes: a file cut short has no footer (pyarrow
checks its `PAR1` magic and decodes it), one that does not start with `PAR1` is not Parquet either; both are a
ConfigError naming the file, before the first batch. A row whose field is null, not a string (or bytes that are not
UTF-8), or empty is a `BadRecord`; so is every row of a file that lacks the column. Only when no file has the column at
all is it a ConfigError (a wrong `text_field`), before the first batch. A row group that does not decode (damaged
bytes: a page whose checksum, where the writer stored one, does not match, or that does not decompress) is a
ConfigError naming the file and row group when it is read: the file is damaged, not one record.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from maxshard import dataset_types
from maxshard.data import files
from maxshard.data.sources import BadRecord, Corpus, ReadOptions, as_text, row_keys
from maxshard.errors import ConfigError

__all__ = ["SUFFIXES", "ParquetDocuments", "open_source", "check_source", "parquet_corpus"]

SUFFIXES = dataset_types.reader("parquet").suffixes
_CACHED_ROW_GROUPS = 4  # decoded row groups kept per reader: the block being read, the next one, read-ahead threads
_TEXT_TYPES = ("string", "large_string", "string_view", "binary", "large_binary", "binary_view")
_MAGIC = b"PAR1"


class ParquetDocuments(Sequence):
    """The rows of several Parquet files as one sequence; decoded row groups are cached per process."""

    def __init__(self, paths: Sequence[str], names: Sequence[str], rows: Sequence[Sequence[int]], text_field: str,
                 key: str = "dataset_path"):
        """`rows[f][g]`: the number of rows of row group g of file f; `key`: the config key that named the files."""
        self.paths, self.names, self.text_field, self.key = tuple(paths), tuple(names), text_field, key
        self._groups = [(f, g) for f, counts in enumerate(rows) for g in range(len(counts))]  # (file, row group)
        self._ends = np.cumsum([n for counts in rows for n in counts]).astype(np.int64)
        self._cache: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def blocks(self) -> np.ndarray:
        """int64 [rows]: the row group of every row (numbered over all files)."""
        sizes = np.diff(np.concatenate([[0], self._ends]))
        return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)

    def __getitem__(self, index: int) -> str | BadRecord:  # type: ignore[override]
        group = int(np.searchsorted(self._ends, index, side="right"))
        row = index - (int(self._ends[group - 1]) if group else 0)
        column = self._row_group(group)
        file, number = self._groups[group]
        where = f"{self.names[file]} row group {number} row {row}"
        if column is None or not column[row].is_valid:
            return BadRecord("missing field", where)
        try:
            value = column[row].as_py()
        except UnicodeDecodeError:  # a string column holding bytes that are not UTF-8 (a damaged page)
            return BadRecord("invalid UTF-8", where)
        return as_text(value, where)

    def _row_group(self, group: int) -> Any:
        """The decoded text column of one row group (None: the file has no such column); LRU-cached."""
        with self._lock:
            if group in self._cache:
                self._cache.move_to_end(group)
                return self._cache[group]
            file, number = self._groups[group]
            rows = int(self._ends[group]) - (int(self._ends[group - 1]) if group else 0)
            column = _read_column(self.paths[file], number, self.text_field, self.key)
            if column is not None and len(column) != rows:  # a damaged page header or footer: rows lost or made up
                raise ConfigError(f"{self.key}: {self.paths[file]} row group {number} decodes to {len(column)} rows, "
                                  f"its footer says {rows}: the file is damaged")
            self._cache[group] = column
            while len(self._cache) > _CACHED_ROW_GROUPS:
                self._cache.popitem(last=False)
            return column

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"], state["_lock"] = collections.OrderedDict(), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()



def _open(path: str) -> Any:
    """A `pyarrow.parquet.ParquetFile` (its footer read); pages are checked against their CRC where the writer stored
    one (parquet-mr does by default, pyarrow with `write_page_checksum=True`)."""
    import pyarrow.parquet as pq  # deferred: only Parquet corpora need pyarrow

    source = files.open_binary(path) if files.is_remote(path) else path
    return pq.ParquetFile(source, page_checksum_verification=True)


def _read_column(path: str, row_group: int, text_field: str, key: str = "dataset_path") -> Any:
    """The `text_field` column of one row group (None: the file has no such column); a row group that does not
    decode is a ConfigError naming the file (module docstring)."""
    try:
        parquet_file = _open(path)
        if text_field not in parquet_file.schema_arrow.names:
            return None
        table = parquet_file.read_row_group(row_group, columns=[text_field])
        return table.column(0).combine_chunks()
    except Exception as e:  # noqa: BLE001 - pyarrow raises OSError, ArrowInvalid, ...: damaged bytes
        raise ConfigError(f"{key}: {path} row group {row_group} is unreadable, the file is damaged "
                          f"({type(e).__name__}: {_first_line(e)})") from None


def _check_magic(path: str, key: str) -> None:
    """ConfigError unless the file starts with `PAR1` (pyarrow checks only the footer's)."""
    with files.open_binary(path) as f:
        head = f.read(len(_MAGIC))
    if head != _MAGIC:
        raise ConfigError(f"{key}: {path} is not a readable Parquet file (it starts with {head!r}, not {_MAGIC!r})")


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def open_source(path: str, key: str, chat: bool, options: ReadOptions) -> Corpus:
    """`dataset_type: parquet` (maxshard/dataset_types.py): the `text_field` column (conversations are not read
    from Parquet directly: a chat source of Parquet files goes through `hf`)."""
    return parquet_corpus(path, options.text_field, key)


def check_source(path: str, key: str, chat: bool, options: ReadOptions) -> None:
    """What `open_source` would refuse (the preflight, `data/preflight.py`): it reads only the files' first bytes
    and footers, so it is `parquet_corpus` itself."""
    parquet_corpus(path, options.text_field, key)


def parquet_corpus(dataset_path: str, text_field: str, key: str = "dataset_path") -> Corpus:
    """Every Parquet file `dataset_path` names (a file, a directory's `*.parquet`, a glob), sorted; footers only."""
    paths = files.list_files(dataset_path, SUFFIXES, key)
    rows: list[list[int]] = []
    kinds: dict[str, str] = {}  # file -> type of its text_field column, for files that have one
    first_columns = ""
    for path in paths:
        try:
            parquet_file = _open(path)
            metadata, schema = parquet_file.metadata, parquet_file.schema_arrow
        except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...: not a Parquet file
            raise ConfigError(f"{key}: {path} is not a readable Parquet file ({type(e).__name__}: "
                              f"{_first_line(e)})") from None
        _check_magic(path, key)
        rows.append([metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)])
        if text_field in schema.names:
            kinds[path] = str(schema.field(text_field).type)
        first_columns = first_columns or ", ".join(schema.names[:12])
    where = f"{key}={dataset_path}"
    if not kinds:
        raise ConfigError(f"text_field={text_field}: no file of {where} has that column (columns: {first_columns})")
    if not any(kind in _TEXT_TYPES for kind in kinds.values()):
        path, kind = next(iter(kinds.items()))
        raise ConfigError(f"text_field={text_field}: the column is {kind} in {path}, not a string column")
    names = [files.relative_name(p, dataset_path) for p in paths]
    documents = ParquetDocuments(paths, names, rows, text_field, key)
    if len(documents) == 0:
        raise ConfigError(f"{where}: the files hold no rows (empty corpus)")
    keys = np.concatenate([row_keys(n, sum(r)) for n, r in zip(names, rows)])
    return Corpus(documents, keys, where, blocks=documents.blocks())
