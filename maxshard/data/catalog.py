"""Which sources a config names, and which reader opens each: `dataset_type`/`dataset_path` or `dataset_mixture`.

`dataset_mixture` is a list of [source, weight] pairs (the config loader checks its form and weights):

    dataset_mixture: [[web/*.parquet, 0.7], [code/*.jsonl.zst, 0.2], [hf:/data/wiki_saved, 0.1]]

Each source is a path, directory or glob whose type follows from its extension (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`,
`.parquet`, `.arecord`, `.txt`; a directory: the one type of the files in it), or `hf:NAME` for a Hugging Face
dataset (streamed or not by `hf_streaming`, as for `dataset_type: hf`: the mixture takes one document at a time
from each source and saves each source's own position, so a stream mixes as exactly as a file). Weights are positive
shares of tokens (normalized). A source prefixed `chat:` (`chat:sft/*.jsonl`, `chat:hf:owner/name`) holds
conversations in `messages_field` (`data/chat.py`), like `dataset_type: chat`, and mixes with text sources.
`source_specs` tells each source's reader from its
name (before any document is read, so before anything compiles); `open_corpus` does the I/O at `make_input`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import TYPE_CHECKING

from maxshard.config import Config

from maxshard.errors import ConfigError
from maxshard.data import files, jsonl, parquet
from maxshard.data.sources import Corpus

if TYPE_CHECKING:
    from maxshard.data.hf_stream import HfStream

__all__ = ["SourceSpec", "kind_of", "source_specs", "open_corpus", "MIXTURE_KINDS"]

_EXTENSIONS = {**{s: "jsonl" for s in jsonl.SUFFIXES}, **{s: "parquet" for s in parquet.SUFFIXES},
               ".arecord": "array_record", ".txt": "text"}
MIXTURE_KINDS = "a path or glob ending in " + ", ".join(_EXTENSIONS) + ", a directory of such files, or hf:NAME"
_LABEL_CHARS = 48


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One source of documents: its reader, its path, its share of tokens, and names for messages and metrics."""

    kind: str  # text, array_record, jsonl, parquet or hf
    path: str
    weight: float
    key: str  # the config key that named it: "dataset_path" or "dataset_mixture[i]"
    label: str  # metrics: data/tokens/<label>
    chat: bool = False  # records are conversations (`data/chat.py`), read by `kind`'s reader


def _kind_of_source(source: str, i: int) -> str:
    """The reader of mixture source `i`: from its extension, `hf:`, or the one type of files in a directory."""
    kind = kind_of(source)
    if kind is not None:
        return kind
    if not files.is_remote(source) and os.path.isdir(source):
        return _directory_kind(source, i)
    raise ConfigError(f"dataset_mixture[{i}]: cannot tell the type of {source!r}; use {MIXTURE_KINDS}")


def kind_of(source: str) -> str | None:
    """The reader a mixture source's name implies (None: no known extension)."""
    if source.startswith("hf:"):
        return "hf"
    for suffix, kind in sorted(_EXTENSIONS.items(), key=lambda item: -len(item[0])):
        if source.endswith(suffix):
            return kind
    return None


def source_specs(cfg: Config) -> list[SourceSpec]:
    """The sources of `cfg`: its mixture, or the single `dataset_type` + `dataset_path`."""
    if not cfg.dataset_mixture:
        label = _label(cfg.dataset_path) or ("stdlib" if cfg.dataset_type == "text" else cfg.dataset_type)
        if cfg.dataset_type == "chat":
            return [SourceSpec(_chat_reader(cfg.dataset_path), cfg.dataset_path, 1.0, "dataset_path", label, True)]
        return [SourceSpec(cfg.dataset_type, cfg.dataset_path, 1.0, "dataset_path", label)]
    if cfg.dataset_path:
        raise ConfigError("dataset_path and dataset_mixture are both set; set only one (a mixture lists its paths)")
    specs = []
    for i, (source, weight) in enumerate(cfg.dataset_mixture):
        chat = source.startswith("chat:")
        source = source[5:] if chat else source
        kind = _kind_of_source(source, i)
        path = source[3:] if kind == "hf" else source
        if chat and kind not in ("jsonl", "hf"):
            raise ConfigError(f"dataset_mixture[{i}]: chat sources are JSONL files or hf:NAME, got {source!r}")
        specs.append(SourceSpec(kind, path, weight, f"dataset_mixture[{i}]", f"{i}_{_label(path)}", chat))
    return specs


def _chat_reader(path: str) -> str:
    """`dataset_type: chat` reads JSONL files itself and anything else through `datasets` (hf)."""
    return "jsonl" if kind_of(path) == "jsonl" else "hf"


def open_corpus(spec: SourceSpec, tokenizer_id: str, text_field: str = "text", hf_split: str = "train",
                cache_dir: str = "", hf_streaming: str = "auto", messages_field: str = "messages"
                ) -> Corpus | HfStream:
    """The documents of one source (listing files and reading indexes and footers; no document is read yet).

    `text_field`, `hf_split`, `cache_dir`, `hf_streaming`, `messages_field`: the config keys of the same names
    (`data_cache_dir`); a chat source reads `messages_field` instead of `text_field`.
    A Hugging Face source that `hf_streaming` streams is an `hf_stream.HfStream`, not a Corpus: it has no indices.
    """
    from maxshard.data import records, sources  # deferred: records imports grain

    if spec.chat:
        return _chat_corpus(spec, messages_field, hf_split, cache_dir, hf_streaming)
    if spec.kind == "jsonl":
        return jsonl.jsonl_corpus(spec.path, text_field, cache_dir, spec.key)
    if spec.kind == "parquet":
        return parquet.parquet_corpus(spec.path, text_field, spec.key)
    if spec.kind == "hf":
        from maxshard.data import hf  # deferred: `datasets` is optional

        if hf.read_as_stream(spec.path, hf_streaming, spec.key):
            from maxshard.data import hf_stream  # deferred: imports grain

            return hf_stream.open_stream(spec.path, hf_split, text_field, spec.key)
        return hf.hf_corpus(spec.path, hf_split, text_field, spec.key)
    if spec.kind == "array_record":
        return records.array_record_corpus(spec.path, tokenizer_id)
    if spec.kind == "text":
        return sources.text_corpus(spec.path) if spec.path else sources.default_corpus()
    raise ConfigError(f"dataset_type={spec.kind!r} has no document reader")


def _chat_corpus(spec: SourceSpec, messages_field: str, hf_split: str, cache_dir: str, hf_streaming: str) -> Corpus:
    """A source of conversations: JSONL, or a map-style Hugging Face dataset (chat sources are not streamed)."""
    if spec.kind == "jsonl":
        return jsonl.jsonl_corpus(spec.path, messages_field, cache_dir, spec.key, chat=True)
    from maxshard.data import hf  # deferred: `datasets` is optional

    if hf_streaming == "always" or (hf_streaming == "auto" and hf.source_kind(spec.path, spec.key) == "hub"):
        raise ConfigError(f"{spec.key}={spec.path}: chat data is read map-style (downloaded first), not streamed; "
                          "set hf_streaming=never")
    return hf.hf_corpus(spec.path, hf_split, messages_field, spec.key, chat=True)


def _directory_kind(path: str, i: int) -> str:
    kinds = {kind_of(name) for _, _, names in os.walk(path) for name in names if not name.startswith(".")}
    kinds.discard(None)
    if len(kinds) != 1:
        found = ", ".join(sorted(k for k in kinds if k)) or "no file of a known type"
        raise ConfigError(f"dataset_mixture[{i}]: the directory {path} must hold one type of file, found {found}; "
                          f"use {MIXTURE_KINDS}")
    return kinds.pop()


def _label(path: str) -> str:
    """A metric-name-safe short name: the path's last characters, runs of other characters as '_'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", path).strip("_")
    return cleaned[-_LABEL_CHARS:]
