"""ArrayRecord shards of documents: the record format and its reader.

A record is one document, either UTF-8 text or token ids. Token records start with the 8-byte tag `TOKENS_TAG`
followed by little-endian int32 ids (8 bytes keep the ids 4-byte aligned). Text can never start with the tag because
text records may not contain NUL bytes, so the two kinds can even share a shard. Token records hold a document's
tokens without BOS/EOS: the pipeline adds those for both kinds, so packing does not depend on how data was stored.

`tools/prepare_data.py` writes token records with the same tokenizer the training run must use; it leaves
`maxshard_data.json` beside the shards so a run with another tokenizer fails at once instead of training on
foreign ids.

A shard cut short or damaged in its footer does not open (a ConfigError naming it, before the first batch: opening
reads only the footer, `check_source`); a chunk whose bytes were damaged fails its Riegeli hash when it is read,
a ConfigError naming the shard and record: the file is damaged, not one record.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
from collections.abc import Sequence

import numpy as np

from maxshard.data.sources import Corpus, ReadOptions, index_keys
from maxshard.errors import ConfigError

__all__ = ["TOKENS_TAG", "METADATA_FILE", "encode_tokens", "decode_record", "RecordDocuments", "array_record_corpus",
           "open_source", "check_source", "check_metadata"]

TOKENS_TAG = b"MXSTOK\0\1"
METADATA_FILE = "maxshard_data.json"


def encode_tokens(ids: np.ndarray) -> bytes:
    """One token record: tag + int32 little-endian ids."""
    return TOKENS_TAG + np.asarray(ids, dtype="<i4").tobytes()


def decode_record(record: bytes, where: str) -> str | np.ndarray:
    """A token record -> int32 [tokens]; anything else must be UTF-8 text without NUL bytes."""
    if record.startswith(TOKENS_TAG):
        return np.frombuffer(record, dtype="<i4", offset=len(TOKENS_TAG)).astype(np.int32)
    if b"\0" in record:
        raise ConfigError(f"dataset_path: {where} is neither a token record nor text (it contains NUL bytes)")
    try:
        return record.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"dataset_path: {where} is not UTF-8 text (byte {e.start}: {e.reason})") from None


class RecordDocuments(Sequence):
    """The records of several shards as one sequence; shard readers open lazily (and again in each worker)."""

    def __init__(self, paths: Sequence[str], counts: Sequence[int]) -> None:
        import grain  # deferred: only record corpora need it here (benchmarks/README.md, "Deferred imports")

        self.paths = tuple(paths)
        self._ends = list(np.cumsum(counts))
        self._source = grain.sources.ArrayRecordDataSource([f"{p}[0:{n}]" for p, n in zip(paths, counts)])

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> str | np.ndarray:  # type: ignore[override]
        try:
            record = self._source[index]
        except RuntimeError as e:  # array_record reports a damaged chunk (its hash does not match) as RuntimeError
            raise ConfigError(f"dataset_path: {self._where(index)} is unreadable, the file is damaged "
                              f"({_first_line(e)})") from None
        return decode_record(record, self._where(index))

    def _where(self, index: int) -> str:
        shard = bisect.bisect_right(self._ends, index)
        first = self._ends[shard - 1] if shard else 0
        return f"{self.paths[shard]} record {index - first}"


def _count_records(path: str) -> int:
    from array_record.python import array_record_module  # deferred with grain, which depends on it

    reader = array_record_module.ArrayRecordReader(path)
    ok = reader.ok()
    count = reader.num_records() if ok else 0
    try:
        reader.close()  # a reader that failed to open reports why only here, as RuntimeError
    except RuntimeError as e:
        why = _first_line(e) or "it does not open: cut short, or its footer is damaged"
        raise ConfigError(f"dataset_path: {path} is not an ArrayRecord file ({why})") from None
    if not ok:
        raise ConfigError(f"dataset_path: {path} is not an ArrayRecord file")
    return count


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def open_source(path: str, key: str, chat: bool, options: ReadOptions) -> Corpus:
    """`dataset_type: array_record` (maxshard/dataset_types.py): the shards of `path`, written with the run's tokenizer
    (`options.tokenizer_id`). Its messages always name dataset_path (not `key`)."""
    return array_record_corpus(path, options.tokenizer_id)


def check_source(path: str, key: str, chat: bool, options: ReadOptions) -> None:
    """What `open_source` would refuse (the preflight, `data/preflight.py`): the shards' listing, footers and
    metadata (`_shards`), without building the reader."""
    _shards(path, options.tokenizer_id)


def array_record_corpus(dataset_path: str, tokenizer_id: str) -> Corpus:
    """Every ArrayRecord file matching `dataset_path` (a file, a glob, or a directory's `*.arecord`), sorted.

    `tokenizer_id` is the run's `tokenizer.fingerprint()`; it must match the one `tools/prepare_data.py` recorded.
    """
    paths, counts = _shards(dataset_path, tokenizer_id)
    return Corpus(RecordDocuments(paths, counts), index_keys(sum(counts)), f"dataset_path={dataset_path}")


def _shards(dataset_path: str, tokenizer_id: str) -> tuple[list[str], list[int]]:
    """The shards of `dataset_path` and their record counts (each opened, which reads its footer), checked against
    the tokenizer their `maxshard_data.json` names; ConfigError for no shard, a shard that does not open, or no
    record at all."""
    if not dataset_path:
        raise ConfigError("dataset_path is empty; dataset_type=array_record needs a glob of shards "
                          "(tools/prepare_data.py writes them)")
    pattern = os.path.join(dataset_path, "*.arecord") if os.path.isdir(dataset_path) else dataset_path
    paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not paths:
        missing = not os.path.exists(dataset_path) and not any(c in dataset_path for c in "*?[")
        what = "no such file" if missing else "matches no files (empty corpus)"
        raise ConfigError(f"dataset_path={dataset_path}: {what}")
    counts = [_count_records(p) for p in paths]
    if sum(counts) == 0:
        raise ConfigError(f"dataset_path={dataset_path}: the shards hold no records (empty corpus)")
    for meta_path in sorted({os.path.join(os.path.dirname(p), METADATA_FILE) for p in paths}):
        check_metadata(meta_path, tokenizer_id)
    return paths, counts


def check_metadata(path: str, tokenizer_id: str) -> None:
    """Errors if the `maxshard_data.json` at `path` (when there is one) names another tokenizer."""
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"dataset_path: cannot read {path}: {e}") from None
    if meta.get("tokenizer_id") != tokenizer_id:
        raise ConfigError(
            f"dataset_path: {path} says the shards were tokenized with {meta.get('tokenizer')!r}, "
            f"which is not the tokenizer this run uses (tokenizer_path); re-run tools/prepare_data.py"
        )
