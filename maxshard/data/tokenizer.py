"""Tokenizers. The default is byte-level: 256 byte values plus PAD, BOS and EOS, so no file is ever needed.

`tokenizer_path` names a SentencePiece model instead (`tools/train_tokenizer.py` trains a small one), or a Hugging Face
`tokenizer.json` (what Llama and Mistral checkpoints ship; `python -m maxshard.convert from_hf` points at it). All
kinds have the same surface: `vocab_size`, `pad_id`/`bos_id`/`eos_id`, `encode`/`decode` on lists and `encode_array`
for the input pipeline, which wants int32 arrays without a Python list per token. All pickle, so grain worker
processes get their own copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from typing import Any, Protocol

import numpy as np

from maxshard.config import Config, ConfigError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "load_sentencepiece",
    "load_hf_tokenizer",
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


def _optional_package(name: str, path: str) -> Any:
    """The optional package a tokenizer file needs (the `tokenizer` extra), once the file is known to exist;
    ConfigError naming `tokenizer_path` otherwise."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        raise ConfigError(f"tokenizer_path={path} needs the {name} package: "
                          'pip install "maxshard[tokenizer]"') from None
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer_path={path}: no such file")
    return module


def load_sentencepiece(path: str) -> SentencePieceTokenizer:
    """Loads a `.model` file; every failure is a ConfigError naming `tokenizer_path` and the file."""
    spm = _optional_package("sentencepiece", path)
    processor = spm.SentencePieceProcessor()
    try:
        with open(path, "rb") as f:
            processor.LoadFromSerializedProto(f.read())
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"tokenizer_path={path} is not a SentencePiece model: {e}") from None
    return SentencePieceTokenizer(processor, path)


# Special-token names to fall back on when no tokenizer_config.json says which token is BOS/EOS/PAD.
_KNOWN_SPECIALS = {
    "bos_token": ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"),
    "eos_token": ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"),
    "pad_token": ("<pad>", "<|finetune_right_pad_id|>", "<|pad|>"),
}


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` package). BOS/EOS/PAD are the tokens named by the
    `tokenizer_config.json` beside it (as transformers reads them), else well-known names; PAD falls back to 0.

    Text is encoded without the tokenizer's own template (no BOS added by it): the pipeline adds BOS and EOS around
    each document itself, as for every tokenizer. Decoding drops special tokens, like SentencePiece's.
    """

    def __init__(self, tokenizer: Any, path: str, special: dict[str, str]) -> None:
        self.path = path
        self._tok = tokenizer
        ids = {field: tokenizer.token_to_id(token) for field, token in special.items()}
        self.bos_id, self.eos_id = ids.get("bos_token"), ids.get("eos_token")
        self.pad_id = ids.get("pad_token") if ids.get("pad_token") is not None else 0
        if self.bos_id is None or self.eos_id is None:
            raise ConfigError(f"tokenizer_path={path}: no BOS/EOS token found; put a tokenizer_config.json with "
                              "bos_token and eos_token beside it")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), np.int32)

    def fingerprint(self) -> str:
        ids = f"{self.bos_id},{self.eos_id},{self.pad_id}".encode()
        return "hf-tokenizers:" + hashlib.sha256(self._tok.to_str().encode() + ids).hexdigest()[:16]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _special_tokens(path: str, tokenizer: Any) -> dict[str, str]:
    """{"bos_token": text, ...}: from tokenizer_config.json beside `path`, else the first known name present."""
    config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    named: dict[str, Any] = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                named = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"tokenizer_path={path}: cannot read {config_path}: {e}") from None
    special = {}
    for field, fallbacks in _KNOWN_SPECIALS.items():
        value = named.get(field)
        token = value.get("content") if isinstance(value, dict) else value
        if token is None:
            token = next((t for t in fallbacks if tokenizer.token_to_id(t) is not None), None)
        if token is not None:
            special[field] = token
    return special


def load_hf_tokenizer(path: str) -> HuggingFaceTokenizer:
    """Loads a `tokenizer.json`; every failure is a ConfigError naming `tokenizer_path` and the file."""
    tokenizers = _optional_package("tokenizers", path)
    try:
        tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception for any malformed file
        raise ConfigError(f"tokenizer_path={path} is not a Hugging Face tokenizer.json: "
                          f"{str(e).splitlines()[0][:160]}") from None
    return HuggingFaceTokenizer(tokenizer, path, _special_tokens(path, tokenizer))


def make_tokenizer(cfg: Config) -> ByteTokenizer | SentencePieceTokenizer | HuggingFaceTokenizer:
    """The tokenizer the config asks for: a `.json` path is a Hugging Face tokenizer, another path SentencePiece,
    none bytes."""
    if not cfg.tokenizer_path:
        return ByteTokenizer()
    if cfg.tokenizer_path.endswith(".json"):
        return load_hf_tokenizer(cfg.tokenizer_path)
    return load_sentencepiece(cfg.tokenizer_path)


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
