"""Tokenizers. The default is byte-level: 256 byte values plus PAD, BOS and EOS, so no file is ever needed.

`tokenizer_path` names a SentencePiece model instead (`tools/train_tokenizer.py` trains a small one). Both kinds have
the same surface: `vocab_size`, `pad_id`/`bos_id`/`eos_id`, `encode`/`decode` on lists and `encode_array` for the
input pipeline, which wants int32 arrays without a Python list per token. Both pickle, so grain worker processes get
their own copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any, Protocol

import numpy as np

from maxshard.config import Config, ConfigError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "load_sentencepiece",
    "make_tokenizer",
    "model_vocab_size",
    "resolve_vocab",
]


class Tokenizer(Protocol):
    """What the input pipeline needs from a tokenizer."""

    pad_id: int
    bos_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def fingerprint(self) -> str: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Token = byte value + 3; ids 0, 1, 2 are PAD, BOS, EOS."""

    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    offset: int = 3

    @property
    def vocab_size(self) -> int:
        return 256 + self.offset

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as int32 [tokens], without a Python int per byte (the pipeline's hot path)."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.offset

    def fingerprint(self) -> str:
        """Names the id mapping, so data tokenized earlier can be checked against this tokenizer."""
        return f"byte+{self.offset}"

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.offset for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model. PAD falls back to 0 when the model has none: padded positions carry no loss."""

    def __init__(self, processor: Any, path: str) -> None:
        self.path = path
        self._sp = processor
        self.pad_id = processor.pad_id() if processor.pad_id() >= 0 else 0
        self.bos_id = processor.bos_id()
        self.eos_id = processor.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise ConfigError(f"tokenizer_path={path}: the SentencePiece model has no BOS/EOS id; "
                              "train it with bos_id and eos_id set (tools/train_tokenizer.py does)")

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def fingerprint(self) -> str:
        return "sentencepiece:" + hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()[:16]

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def load_sentencepiece(path: str) -> SentencePieceTokenizer:
    """Loads a `.model` file; every failure is a ConfigError naming `tokenizer_path` and the file."""
    try:
        import sentencepiece as spm  # optional: pip install "maxshard[tokenizer]"
    except ImportError:
        raise ConfigError(f"tokenizer_path={path} needs the sentencepiece package: "
                          'pip install "maxshard[tokenizer]"') from None
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer_path={path}: no such file")
    processor = spm.SentencePieceProcessor()
    try:
        with open(path, "rb") as f:
            processor.LoadFromSerializedProto(f.read())
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"tokenizer_path={path} is not a SentencePiece model: {e}") from None
    return SentencePieceTokenizer(processor, path)


def make_tokenizer(cfg: Config) -> ByteTokenizer | SentencePieceTokenizer:
    """The tokenizer the config asks for: SentencePiece when `tokenizer_path` is set, else bytes."""
    return load_sentencepiece(cfg.tokenizer_path) if cfg.tokenizer_path else ByteTokenizer()


def model_vocab_size(tokenizer_vocab: int, multiple: int) -> int:
    """The tokenizer's vocabulary rounded up to `multiple`, so the vocab dimension shards evenly."""
    return -(-tokenizer_vocab // multiple) * multiple


def resolve_vocab(cfg: Config) -> Config:
    """Config with `vocab_size` set from the tokenizer (0) or checked against it (explicit)."""
    needed = make_tokenizer(cfg).vocab_size
    if cfg.vocab_size == 0:
        return dataclasses.replace(cfg, vocab_size=model_vocab_size(needed, cfg.vocab_size_multiple))
    if cfg.vocab_size < needed:
        raise ConfigError(f"vocab_size={cfg.vocab_size} is smaller than the tokenizer's {needed} tokens")
    return cfg
