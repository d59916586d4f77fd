"""Documents on disk -> random-access sequences of documents, split into train/eval.

A corpus of text files is a sequence of paths that reads one file (one document) per `__getitem__`; only paths cross
into grain's worker processes, never text. The train/eval split hashes each document's name (its path relative to
the corpus root, or its record number in ArrayRecord shards), so it does not depend on listing order, machine or
process count, and adding a document never moves another one across the split.

Errors are found before the first batch where that is cheap: a missing path, a pattern matching nothing, a file whose
first 4 KiB are not UTF-8 text. A file that turns bad later in its body fails when it is read, still as a ConfigError
naming the file. An empty file is no document: a `BadRecord`, skipped and counted.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import hashlib
import os
import sysconfig
from collections.abc import Sequence

import numpy as np

from maxshard.errors import ConfigError

__all__ = [
    "BadRecord",
    "as_text",
    "Corpus",
    "ReadOptions",
    "TextDocuments",
    "open_source",
    "check_source",
    "default_corpus",
    "text_corpus",
    "name_keys",
    "index_keys",
    "row_keys",
    "split_indices",
]

_HEAD_BYTES = 4096
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclasses.dataclass(frozen=True)
class BadRecord:
    """A record that is not a usable document (missing field, not a string, invalid UTF-8, empty).

    Readers of JSONL, Parquet and Hugging Face data return it instead of raising: one bad line in a billion must not
    stop a run. The pipeline drops it and counts it (`data/skipped_records`).
    """

    reason: str  # short and fixed ("missing field", "not a string", ...), so it can be counted by kind
    where: str  # file and record number, for the log


def as_text(value: object, where: str) -> str | BadRecord:
    """A record's field value -> its text, or a BadRecord saying why not; one rule for Parquet and HF sources.

    Bytes are accepted when they are UTF-8 (binary columns often hold text); None means the field is absent.
    """
    if value is None:
        return BadRecord("missing field", where)
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return BadRecord("invalid UTF-8", where)
    if not isinstance(value, str):
        return BadRecord("not a string", where)
    return value if value else BadRecord("empty text", where)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Random-access documents and one uint64 split key per document.

    A document is text, int32 token ids, or a `BadRecord`. `blocks` (int64 [documents], nondecreasing) groups
    documents that are cheap to read together (a Parquet row group): shuffling then keeps each block's documents
    near each other in the stream so a reader decodes a block once, not once per document. None: every document is
    cheap to read alone.
    """

    documents: Sequence[str | np.ndarray | BadRecord]
    keys: np.ndarray  # uint64 [documents]
    where: str  # "dataset_path=..." for messages
    blocks: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.documents)


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """What a reader's `open_source` may read (maxshard/dataset_types.py: each row's `keys` say which): the config
    keys of the same names (`data_cache_dir` is where JSONL is decompressed) and the run's tokenizer fingerprint,
    which ArrayRecord shards of token ids must have been written with."""

    tokenizer_id: str
    text_field: str
    messages_field: str
    hf_split: str
    data_cache_dir: str
    hf_streaming: str

    def field(self, chat: bool) -> str:
        """The field or column that holds a record: `messages_field` for conversations, else `text_field`."""
        return self.messages_field if chat else self.text_field


@dataclasses.dataclass(frozen=True)
class TextDocuments(Sequence):
    """Text files as a sequence of documents; reading happens on access (in a grain worker, when there are any)."""

    paths: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> str | BadRecord:  # type: ignore[override]
        text = read_text(self.paths[index])
        return text if text else BadRecord("empty text", self.paths[index])


def read_text(path: str) -> str:
    """The whole file as text; NUL bytes or invalid UTF-8 mean it is not a text document."""
    return _decode(_read_bytes(path), path, final=True)


def _read_bytes(path: str, size: int = -1) -> bytes:
    """The file's first `size` bytes (-1: all); one that cannot be read (removed since it was listed, no permission)
    is a ConfigError naming it, as a file that is not text is."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as e:
        raise ConfigError(f"dataset_path: cannot read {path} ({type(e).__name__}: {e.strerror or e})") from None


def _decode(data: bytes, path: str, final: bool) -> str:
    if b"\0" in data:
        raise ConfigError(f"dataset_path: {path} is not a text file (it contains NUL bytes)")
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError as e:
        raise ConfigError(f"dataset_path: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def _check_head(path: str) -> None:
    _decode(_read_bytes(path, _HEAD_BYTES), path, final=False)


# --------------------------------------------------------------------------------------------- listing


def open_source(path: str, key: str, chat: bool, options: ReadOptions) -> Corpus:
    """`dataset_type: text` (maxshard/dataset_types.py): every file of `path` is a document, or with no path the
    stdlib's sources, so a run needs no data to start. Its messages always name dataset_path (not `key`)."""
    return text_corpus(path) if path else default_corpus()


def check_source(path: str, key: str, chat: bool, options: ReadOptions) -> None:
    """What `open_source` would refuse (the preflight, `data/preflight.py`): `text_corpus` reads only each file's
    first bytes; the stdlib corpus (no path) always loads."""
    if path:
        text_corpus(path)


def default_corpus() -> Corpus:
    """Python's own standard library `.py` files: real text on every machine, no download.

    Installed packages (site-packages) are left out, and so are the few stdlib files that are deliberately not UTF-8
    (encoding tests) and the empty ones (`__init__.py`, which would be skipped records): the default must always
    load, with nothing to skip.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = [p for p in _walk(root, suffix=".py", skip=_SKIPPED_DIRS) if _is_utf8(p)]
    if not paths:
        raise ConfigError(f'dataset_path="" (the stdlib at {root}) holds no .py files; set dataset_path')
    return _text_corpus(root, paths, f'dataset_path="" (stdlib {root})')


def text_corpus(dataset_path: str) -> Corpus:
    """Every file under a directory (dot-files and dot-directories skipped), or every file a glob matches."""
    if not _has_magic(dataset_path):
        if not os.path.exists(dataset_path):
            raise ConfigError(f"dataset_path={dataset_path}: no such file or directory")
        root = dataset_path if os.path.isdir(dataset_path) else os.path.dirname(dataset_path)
        paths = _walk(dataset_path, suffix="", skip=frozenset()) if os.path.isdir(dataset_path) else [dataset_path]
    else:
        root = _glob_root(dataset_path)
        paths = sorted(p for p in glob.glob(dataset_path, recursive=True) if os.path.isfile(p))
    if not paths:
        raise ConfigError(f"dataset_path={dataset_path} matches no files (empty corpus)")
    for path in paths:
        _check_head(path)
    return _text_corpus(root, paths, f"dataset_path={dataset_path}")


def _text_corpus(root: str, paths: list[str], where: str) -> Corpus:
    names = [os.path.relpath(p, root) if root else p for p in paths]
    return Corpus(TextDocuments(tuple(paths)), name_keys(names), where)


def _walk(root: str, suffix: str, skip: frozenset[str]) -> list[str]:
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))
        found += [os.path.join(directory, f) for f in sorted(files) if f.endswith(suffix) and not f.startswith(".")]
    return found


def _is_utf8(path: str) -> bool:
    """Whether the file is a non-empty UTF-8 text document."""
    try:
        return bool(read_text(path))
    except ConfigError:
        return False


def _has_magic(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _glob_root(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: names are taken relative to it."""
    parts = pattern.split(os.sep)
    fixed = []
    for part in parts[:-1]:
        if _has_magic(part):
            break
        fixed.append(part)
    return os.sep.join(fixed) if fixed else ""


# --------------------------------------------------------------------------------------------- split


def name_keys(names: Sequence[str]) -> np.ndarray:
    """uint64 [documents]: a stable hash of each document's name."""
    digests = [hashlib.sha256(n.encode("utf-8")).digest()[:8] for n in names]
    return np.frombuffer(b"".join(digests), dtype="<u8").copy() if digests else np.zeros(0, np.uint64)


def index_keys(count: int) -> np.ndarray:
    """uint64 [count]: splitmix64 of the record number, vectorized (shards hold millions of records)."""
    return _splitmix64(np.arange(count, dtype=np.uint64))


def row_keys(name: str, count: int) -> np.ndarray:
    """uint64 [count]: keys of the rows (lines, records) of one named file: its name's hash plus the row number.

    A row keeps its split side when other files are added or removed; only rewriting its own file moves it.
    """
    with np.errstate(over="ignore"):
        return _splitmix64(name_keys([name])[0] + np.arange(count, dtype=np.uint64))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def split_indices(keys: np.ndarray, split: str, eval_fraction: float) -> np.ndarray:
    """int64 indices of the documents in `split` ("train" or "eval").

    A document is in eval when its key, read as a fraction of 2**64, is below `eval_fraction`. If that leaves eval
    empty although eval_fraction > 0 and there are at least two documents, the lowest key goes to eval, so a small
    corpus still has something to evaluate on.
    """
    in_eval = keys.astype(np.float64) / 2.0**64 < eval_fraction
    if eval_fraction > 0 and not in_eval.any() and len(keys) >= 2:
        in_eval[np.argmin(keys)] = True
    chosen = in_eval if split == "eval" else ~in_eval
    return np.flatnonzero(chosen)
