"""JSON Lines documents: one JSON object per line, the text in `text_field`; plain, `.gz` or `.zst`; local or remote.

Random access comes from an index of where each line starts: one int64 per line, found by one sequential numpy pass
over the bytes (a 10 M-line corpus costs 80 MB of index). A plain local file is then read where it lies, one
`os.pread` per document, so documents can be shuffled freely.

Compressed and remote files cannot be read at an offset cheaply: gzip and zstd streams can only be decoded from their
start. They are therefore decompressed (or copied) once, streaming, into `cache_dir` and read from there like plain
files. Why not keep them in memory: a corpus is often larger than RAM, while local disk is cheap; why not decode from
the start for each document: that is quadratic. The cache entry is named by a hash of the source's path, size and
modification time, written under a temporary name and renamed, so concurrent processes and later runs reuse it safely.
A compressed file must decode to its end: a `.gz` cut short fails in `gzip`, a `.zst` whose last frame is
incomplete fails here (zstandard's stream reader would stop there silently), so a truncated download is a
ConfigError naming the file, never a smaller corpus.

`check_source` (the preflight, `data/preflight.py`) reads only the first bytes of each file: the gzip or zstd header
(checked by the libraries themselves) and the first lines, which must hold the field the reader needs.

Every line is a record (its line number, counted from 0, names it in the split hash and in messages). A line that is
blank, not JSON, not an object, lacks `text_field`, holds a non-string or an empty string there, or is not UTF-8 is a
`BadRecord`: skipped and counted, never a crash.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any

import numpy as np

from maxshard import dataset_types
from maxshard.data import files
from maxshard.data.chat import as_conversation
from maxshard.data.sources import BadRecord, Corpus, ReadOptions, row_keys
from maxshard.errors import ConfigError

__all__ = ["SUFFIXES", "JsonlDocuments", "jsonl_corpus", "open_source", "check_source", "check_files", "parse_record",
           "line_bounds"]

SUFFIXES = dataset_types.reader("jsonl").suffixes  # .jsonl and .ndjson, plain, .gz or .zst
_CHUNK_BYTES = 16 << 20  # read/scan granularity: bounded memory whatever the file size
_SAMPLE_LINES_PER_FILE = 8  # lines per file looked at before the first batch, to catch a wrong text_field
_SAMPLE_LINES = 256
_HEAD_READ = 64 << 10  # bytes read at a time from a file's start by the preflight
_HEAD_LIMIT = 1 << 20  # at most this much of each file's start, however long its first lines
_ZSTD_READ = 1 << 20  # compressed bytes decoded at a time: text expands some 5x, so chunks stay small
_CACHE_VERSION = "frames-checked"  # in cache entries' names: copies made before truncation was checked are not reused


def parse_record(line: bytes, text_field: str, where: str, chat: bool = False,
                 whole: Callable[[dict, str], Any] | None = None) -> Any:
    """One line -> its text (chat: its conversation, `chat.as_conversation`; `whole`: what `whole(object, where)`
    makes of the whole object, e.g. a preference pair), or a BadRecord saying why not."""
    line = line.rstrip(b"\r\n")
    if not line.strip():
        return BadRecord("empty line", where)
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        return BadRecord("invalid UTF-8", where)
    except ValueError:
        return BadRecord("invalid JSON", where)
    if not isinstance(record, dict):
        return BadRecord("not an object", where)
    if whole is not None:
        return whole(record, where)
    if text_field not in record:
        return BadRecord("missing field", where)
    text = record[text_field]
    if chat:
        return as_conversation(text, where)
    if not isinstance(text, str):
        return BadRecord("not a string", where)
    return text if text else BadRecord("empty text", where)


def line_bounds(path: str) -> np.ndarray:
    """int64 [lines + 1]: byte offset where each line starts, then the file size (a final newline adds no line)."""
    starts = [np.zeros(1, np.int64)]
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            newlines = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10)
            starts.append(newlines.astype(np.int64) + (offset + 1))
            offset += len(chunk)
    bounds = np.concatenate([*starts, np.array([offset], np.int64)])
    if len(bounds) >= 2 and bounds[-2] == offset:  # the last "line" would start at the end: no such line
        bounds = bounds[:-1]
    return bounds


class JsonlDocuments(Sequence):
    """Plain local JSONL files as one sequence of records; file descriptors open lazily (again in each worker)."""

    def __init__(self, paths: Sequence[str], names: Sequence[str], bounds: Sequence[np.ndarray], text_field: str,
                 chat: bool = False, whole: Callable[[dict, str], Any] | None = None):
        """`chat`: records are conversations in `text_field` (`messages_field`), not text; `whole`: records are
        made from the whole object (`parse_record`), `text_field` only checked to be there."""
        self.paths, self.names, self.text_field, self.chat = tuple(paths), tuple(names), text_field, chat
        self.whole = whole
        self._bounds = list(bounds)
        self._ends = np.cumsum([len(b) - 1 for b in bounds]).astype(np.int64)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        return parse_record(self.raw(index), self.text_field, self.where(index), self.chat, self.whole)

    def raw(self, index: int) -> bytes:
        """The bytes of line `index` (with its newline)."""
        file, line = self._locate(index)
        start, end = int(self._bounds[file][line]), int(self._bounds[file][line + 1])
        return os.pread(self._fd(file), end - start, start)

    def where(self, index: int) -> str:
        file, line = self._locate(index)
        return f"{self.names[file]}:{line + 1}"

    def sample(self, per_file: int, total: int) -> list[int]:
        """Indices of the first `per_file` lines of each file, at most `total` in all."""
        chosen: list[int] = []
        first = 0
        for end in self._ends.tolist():
            chosen += range(first, min(first + per_file, end))
            first = end
            if len(chosen) >= total:
                break
        return chosen[:total]

    def _locate(self, index: int) -> tuple[int, int]:
        file = int(np.searchsorted(self._ends, index, side="right"))
        return file, index - (int(self._ends[file - 1]) if file else 0)

    def _fd(self, file: int) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(self.paths[file], os.O_RDONLY)
            return self._fds[file]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fds"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


def open_source(path: str, key: str, chat: bool, options: ReadOptions) -> Corpus:
    """`dataset_type: jsonl` (maxshard/dataset_types.py): the text of each line's `text_field`, or with `chat` the
    conversation in its `messages_field`."""
    return jsonl_corpus(path, options.field(chat), options.data_cache_dir, key, chat=chat)


def jsonl_corpus(dataset_path: str, text_field: str | tuple[str, ...], cache_dir: str, key: str = "dataset_path",
                 chat: bool = False, whole: Callable[[dict, str], Any] | None = None) -> Corpus:
    """Every JSONL file `dataset_path` names (a file, a directory's `*.jsonl[.gz|.zst]`, a glob), sorted; `chat`:
    the records are conversations in the field `text_field` (`messages_field`); `whole`: each record is made from
    its whole object (`parse_record`; preference pairs), which must have `text_field` (a tuple: one of them)."""
    sources = files.list_files(dataset_path, SUFFIXES, key)
    local = [_plain_local_copy(p, cache_dir, key) for p in sources]
    names = [files.relative_name(p, dataset_path) for p in sources]
    bounds = [line_bounds(p) for p in local]
    field = text_field if isinstance(text_field, str) else text_field[0]  # a tuple only with `whole` (unread)
    documents = JsonlDocuments(local, names, bounds, field, chat, whole)
    if len(documents) == 0:
        raise ConfigError(f"{key}={dataset_path}: the files hold no lines (empty corpus)")
    name = "messages_field" if chat else "text_field" if whole is None else "record field"
    _check_text_field(documents, text_field, f"{key}={dataset_path}", name)
    keys = np.concatenate([row_keys(n, len(b) - 1) for n, b in zip(names, bounds)])
    return Corpus(documents, keys, f"{key}={dataset_path}")


def _check_text_field(documents: JsonlDocuments, text_field: str | tuple[str, ...], where: str,
                      name: str = "text_field") -> None:
    """ConfigError when the first lines of the files hold JSON objects but none has `text_field` (a wrong name; a
    tuple: none has any of them), or when none of them is a JSON object at all (`_check_fields`)."""
    lines = (documents.raw(index) for index in documents.sample(_SAMPLE_LINES_PER_FILE, _SAMPLE_LINES))
    _check_fields(lines, text_field, where, name)


def _check_fields(lines: Iterable[bytes], text_field: str | tuple[str, ...], where: str, name: str) -> None:
    """ConfigError unless some line is a JSON object with `text_field` (a tuple: one of them).

    Lines that are not JSON objects are bad records, skipped and counted later; only when every line looked at is
    one is the source refused here (not JSON Lines, another encoding, a compressed file without its suffix), and
    so is a source whose objects all lack the field (a wrong name).
    """
    wanted = (text_field,) if isinstance(text_field, str) else text_field
    fields: set[str] = set()
    bad = ""  # why the first line that is no JSON object is not (blank lines say nothing)
    for line in lines:
        record = parse_record(line, "", "", whole=lambda obj, _: obj)
        if isinstance(record, BadRecord):
            bad = bad or ("" if record.reason == "empty line" else record.reason)
            continue
        if any(field in record for field in wanted):
            return
        fields.update(record)
    if fields:
        shown = ", ".join(sorted(fields)[:12])
        raise ConfigError(f"{name}={' or '.join(wanted)}: no record of {where} has that field "
                          f"(fields of its first records: {shown})")
    if bad:
        raise ConfigError(f"{where}: none of its first lines is a JSON object (the first: {bad}); is it JSON Lines, "
                          "in UTF-8, compressed as its name says?")


def check_source(path: str, key: str, chat: bool, options: ReadOptions) -> None:
    """What `open_source` would refuse, from the start of each file only (`check_files`)."""
    check_files(path, options.field(chat), key, "messages_field" if chat else "text_field")


def check_files(dataset_path: str, text_field: str | tuple[str, ...], key: str = "dataset_path",
                name: str = "text_field") -> None:
    """ConfigError (one line naming `key`, or `name` for the field, and the file) for what `jsonl_corpus` would
    refuse, found from the first bytes of each file (`_head`): no file; a file that is not gzip or zstd although
    its name says so; no line at all; first lines that are not JSON objects or lack `text_field`. A file cut short
    further on is only found when it is decompressed (`_plain_local_copy`), which needs the whole file."""
    paths = files.list_files(dataset_path, SUFFIXES, key)
    lines: list[bytes] = []
    empty = True
    for path in paths:
        head, has_bytes = _head(path, key)
        empty = empty and not has_bytes
        lines += head[: max(_SAMPLE_LINES - len(lines), 0)]
    where = f"{key}={dataset_path}"
    if empty:
        raise ConfigError(f"{where}: the files hold no lines (empty corpus)")
    _check_fields(lines, text_field, where, name)


def _head(path: str, key: str) -> tuple[list[bytes], bool]:
    """(the first whole lines of a file, decompressed, up to `_SAMPLE_LINES_PER_FILE`; whether it holds any byte),
    read a little at a time and at most `_HEAD_LIMIT` bytes: a line cut there is left out, not taken for a bad one."""
    data, ended = b"", True
    try:
        with files.open_binary(path) as raw:
            for chunk in _decoded_chunks(raw, _compression(path), _HEAD_READ):
                data += chunk
                if data.count(b"\n") >= _SAMPLE_LINES_PER_FILE or len(data) >= _HEAD_LIMIT:
                    ended = False
                    break
    except Exception as e:  # noqa: BLE001 - OSError, EOFError, gzip.BadGzipFile, zstandard.ZstdError: a bad file
        raise ConfigError(f"{key}: cannot read {path} ({type(e).__name__}: {e})") from None
    lines = data.split(b"\n")
    whole = lines if ended else lines[:-1]  # the piece after the last newline is whole only at the file's end
    return whole[:_SAMPLE_LINES_PER_FILE], bool(data)


# --------------------------------------------------------------------------------------------- compressed, remote


def _plain_local_copy(path: str, cache_dir: str, key: str) -> str:
    """`path` itself when it is a plain local file, else its decompressed local copy in `cache_dir`."""
    compression = _compression(path)
    if not compression and not files.is_remote(path):
        return path
    target = os.path.join(_cache_root(cache_dir), f"{_fingerprint(path)}-{_plain_name(path)}")
    if os.path.isfile(target):
        return target
    tmp = f"{target}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with files.open_binary(path) as raw, open(tmp, "wb") as out:
            for chunk in _decoded_chunks(raw, compression, _CHUNK_BYTES):
                out.write(chunk)
        os.replace(tmp, target)
    except Exception as e:  # noqa: BLE001 - OSError, EOFError, gzip.BadGzipFile, zstandard.ZstdError: a bad file
        _remove(tmp)
        raise ConfigError(f"{key}: cannot read {path} ({type(e).__name__}: {e})") from None
    return target


def _compression(path: str) -> str:
    return ".gz" if path.endswith(".gz") else ".zst" if path.endswith(".zst") else ""


def _decoded_chunks(raw: IO[bytes], compression: str, size: int) -> Iterator[bytes]:
    """The decompressed bytes of `raw`, about `size` at a time; an input that ends before its compressed stream
    does raises (EOFError), so a truncated file is never read as a shorter one."""
    if compression == ".zst":
        yield from _zstd_chunks(raw, min(size, _ZSTD_READ))
        return
    stream = gzip.GzipFile(fileobj=raw) if compression == ".gz" else raw  # gzip checks its end and CRC itself
    while chunk := stream.read(size):
        yield chunk


def _zstd_chunks(raw: IO[bytes], size: int) -> Iterator[bytes]:
    """The frames of a zstd stream, decoded one after another (a file may hold several), reading `size`
    compressed bytes at a time (what each decodes to is one chunk); EOFError when the input ends inside a frame.
    zstandard's one-frame decompressor says where its frame ends (`eof`), while its stream reader returns what it
    decoded so far when the input stops."""
    import zstandard  # deferred: only .zst files need it

    decompressor = zstandard.ZstdDecompressor()
    frame = None
    while data := raw.read(size):
        while data:
            if frame is None:
                frame = decompressor.decompressobj()
            if out := frame.decompress(data):
                yield out
            data, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
    if frame is not None:
        raise EOFError("the file ends inside a zstd frame (truncated)")


def _cache_root(cache_dir: str) -> str:
    import tempfile

    root = cache_dir or os.path.join(tempfile.gettempdir(), "maxshard-data-cache")
    os.makedirs(root, exist_ok=True)
    return root


def _fingerprint(path: str) -> str:
    """Path, size and modification time: a changed source gets a new cache entry."""
    if files.is_remote(path):
        from etils import epath

        stat = epath.Path(path).stat()
        size, mtime = stat.length, stat.mtime
    else:
        stat = os.stat(path)
        size, mtime = stat.st_size, stat.st_mtime_ns
    where = path if files.is_remote(path) else os.path.abspath(path)
    return hashlib.sha256(f"{where}|{size}|{mtime}|{_CACHE_VERSION}".encode()).hexdigest()[:16]


def _plain_name(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    compression = _compression(name)
    return name[: -len(compression)] if compression else name


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
