"""Which sources a config names, and which reader opens each: `dataset_type`/`dataset_path` or `dataset_mixture`.

`dataset_mixture` is a list of [source, weight] pairs (the config loader checks its form and weights):

    dataset_mixture: [[web/*.parquet, 0.7], [code/*.jsonl.zst, 0.2], [hf:/data/wiki_saved, 0.1]]

Each source is a path, directory or glob whose type follows from its extension (`.jsonl.zst`, `.parquet`, ...: the
`suffixes` of maxshard/dataset_types.py; a directory: the one type of the files in it), or `hf:NAME` for a Hugging Face
dataset (streamed or not by `hf_streaming`, as for `dataset_type: hf`: the mixture takes one document at a time
from each source and saves each source's own position, so a stream mixes as exactly as a file). Weights are positive
shares of tokens (normalized). A source prefixed `chat:` (`chat:sft/*.jsonl`, `chat:hf:owner/name`) holds
conversations in `messages_field` (`data/chat.py`), like `dataset_type: chat`, and mixes with text sources.
`source_specs` tells each source's reader from its name (before any document is read, so before anything compiles);
`open_corpus` does the I/O at `make_input`, through the `opener` of the reader's row in maxshard/dataset_types.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from maxshard import dataset_types
from maxshard.config import Config
from maxshard.data import files
from maxshard.data.sources import Corpus, ReadOptions
from maxshard.errors import ConfigError

if TYPE_CHECKING:
    from maxshard.data.hf_stream import HfStream

__all__ = ["SourceSpec", "kind_of", "source_specs", "open_corpus", "MIXTURE_KINDS"]

_EXTENSIONS = {suffix: r.name for r in dataset_types.READERS for suffix in r.suffixes}
MIXTURE_KINDS = ("a path or glob ending in " + ", ".join(_EXTENSIONS) + ", a directory of such files, or "
                 + " or ".join(f"{prefix}NAME" for prefix in dataset_types.PREFIXES))
_LABEL_CHARS = 48


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One source of documents: its reader, its path, its share of tokens, and names for messages and metrics."""

    kind: str  # a dataset_types.py row that opens sources (`opener`)
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
    """The reader a mixture source's name implies (None: no known extension or prefix)."""
    for prefix, kind in dataset_types.PREFIXES.items():
        if source.startswith(prefix):
            return kind
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
        chat = source.startswith(dataset_types.CHAT_PREFIX)
        source = source.removeprefix(dataset_types.CHAT_PREFIX)
        kind = _kind_of_source(source, i)
        prefix = dataset_types.reader(kind).prefix
        path = source.removeprefix(f"{prefix}:") if prefix else source
        if chat and not dataset_types.reader(kind).chat:
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
    options = ReadOptions(tokenizer_id, text_field, messages_field, hf_split, cache_dir, hf_streaming)
    return _opener(spec.kind)(spec.path, spec.key, spec.chat, options)


def _opener(kind: str) -> Callable[..., Corpus | HfStream]:
    """The `open_source` function of reader `kind` (its row's `opener`), imported only now: records and hf_stream
    import grain, hf the optional `datasets`, and a run needs only its own sources' readers."""
    opener = dataset_types.reader(kind).opener if kind in dataset_types.NAMES else ""
    if not opener:
        raise ConfigError(f"dataset_type={kind!r} has no document reader")
    module, function = opener.split(":")
    return getattr(importlib.import_module(module), function)


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
