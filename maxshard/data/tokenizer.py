"""Tokenizers. The default is byte-level: 256 byte values plus PAD, BOS and EOS, so no file is ever needed.

`tokenizer_path` names a SentencePiece model instead (`tools/train_tokenizer.py` trains a small one), or a Hugging Face
`tokenizer.json` (what Hugging Face checkpoints ship; `python -m maxshard.convert from_hf` points at it). All
kinds have the same surface: `vocab_size`, `pad_id`/`bos_id`/`eos_id`/`start_id`, `stop_ids`, `encode`/`decode`
on lists and `encode_array` for the input pipeline, which wants int32 arrays without a Python list per token. All
pickle, so grain worker processes get their own copy. These attributes are the one home of the special tokens:
training, generation and evaluation read them and nothing else.

Special tokens are the tokenizer's own. Byte-level and SentencePiece have fixed ids. A Hugging Face tokenizer.json
takes them as transformers does: `bos_id`, `eos_id` and `pad_id` are the tokens `special_tokens_map.json` (else
`tokenizer_config.json`) beside it names, so `bos_id` is transformers' `bos_token_id` (what lm-eval conditions an
empty context on); a token the vocabulary merely holds (`<s>` in a tokenizer whose config names no BOS) is no BOS.
Only EOS, which maxshard needs to end documents, falls back to well-known names where no file names one; PAD is 0
where none is named (padded positions carry no loss).

Where texts start is a second fact, `start_id`: the id the tokenizer puts before every text. Byte-level and
SentencePiece: BOS. A Hugging Face tokenizer.json: what its own template (post-processor) puts before a text, None
where it puts none (Qwen has no BOS at all; a tokenizer.json without a template adds none even where its config
names a BOS), so training documents start as `tokenizer(text)` starts them, and prompts are encoded exactly as
`tokenizer(prompt)` encodes them (`encode_prompt`). EOS ends every training document (the separator the model
learns to stop at). Generation stops at `stop_ids`: for a Hugging Face model the EOS ids its generation_config.json
lists (several for Qwen), as transformers' generate does, plus the tokenizer's own EOS, the one fine-tuning taught
the model to end a document with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from maxshard.config import Config
from maxshard.errors import ConfigError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "load_sentencepiece",
    "load_hf_tokenizer",
    "stop_ids",
    "make_tokenizer",
    "tokenizer_at",
    "model_vocab_size",
    "resolve_vocab",
    "MAX_STOP_IDS",
]

MAX_STOP_IDS = 8  # EOS ids one generation can stop at: the compiled decode steps hold that many


class Tokenizer(Protocol):
    """What the input pipeline and generation need from a tokenizer."""

    pad_id: int
    bos_id: int | None  # the tokenizer's BOS token (transformers' bos_token_id); None: it names none
    eos_id: int
    start_id: int | None  # the id every document and prompt starts with; None: the tokenizer adds none
    stop_ids: tuple[int, ...]  # generation stops at any of these
    never_generated: tuple[int, ...]  # ids generation never samples (PAD, BOS for byte-level and SentencePiece)

    def encode_prompt(self, text: str) -> list[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def fingerprint(self) -> str: ...

    def decode(self, ids: list[int]) -> str: ...


class _FixedSpecials:
    """Generation's rule for a tokenizer whose BOS, EOS and PAD are fixed ids (byte-level, SentencePiece): stop at
    EOS, never emit PAD or BOS."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)  # type: ignore[attr-defined]

    @property
    def never_generated(self) -> tuple[int, ...]:
        return (self.pad_id, self.bos_id)  # type: ignore[attr-defined]

    @property
    def start_id(self) -> int:
        """Every document and prompt starts with BOS."""
        return self.bos_id  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class ByteTokenizer(_FixedSpecials):
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

    def encode_prompt(self, text: str) -> list[int]:
        """BOS + the text's tokens: prompts start as training documents do."""
        return [self.bos_id, *self.encode(text)]

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as int32 [tokens], without a Python int per byte (the pipeline's hot path)."""
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + self.offset

    def fingerprint(self) -> str:
        """Names the id mapping, so data tokenized earlier can be checked against this tokenizer."""
        return f"byte+{self.offset}"

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.offset for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")


class SentencePieceTokenizer(_FixedSpecials):
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

    def encode_prompt(self, text: str) -> list[int]:
        """BOS + the text's tokens: prompts start as training documents do."""
        return [self.bos_id, *self.encode(text)]

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


_SPECIAL_FIELDS = ("bos_token", "eos_token", "pad_token")
# EOS names to fall back on when neither tokenizer_config.json nor special_tokens_map.json names an EOS.
_KNOWN_EOS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` package). BOS/EOS/PAD are the tokens named by the
    `special_tokens_map.json` (else `tokenizer_config.json`) beside it, as transformers reads them; EOS falls back
    to well-known names, PAD to 0.

    `start_id` is what the tokenizer's template adds before a text (None when it adds nothing), found by encoding a
    probe text with and without special tokens; `encode` never applies the template (the pipeline adds `start_id`
    and EOS around each document), `encode_prompt` does. tokenizer_config.json's add_bos_token/add_eos_token, where
    set, must agree with the template. Decoding drops special tokens. Nothing is masked when generating
    (transformers masks nothing either).
    """

    def __init__(self, tokenizer: Any, path: str, special: dict[str, str], flags: Mapping[str, Any]) -> None:
        self.path = path
        self._tok = tokenizer
        ids = {field: _token_id(tokenizer, path, field, token) for field, token in special.items()}
        self.eos_id = ids.get("eos_token")
        if self.eos_id is None:
            raise ConfigError(f"tokenizer_path={path}: no EOS token found; put a tokenizer_config.json with "
                              "eos_token beside it")
        self.pad_id = ids.get("pad_token") if ids.get("pad_token") is not None else 0
        self.bos_id = ids.get("bos_token")  # whether or not its template adds it (start_id says what it adds)
        before, after = self._template(path)
        if len(before) > 1:
            raise ConfigError(f"tokenizer_path={path}: its template puts {len(before)} tokens before a text; "
                              "maxshard's documents start with at most one (BOS)")
        self.start_id = before[0] if before else None
        _check_flags(path, flags, {"BOS": bool(before), "EOS": after[-1:] == [self.eos_id]})
        self.stop_ids = stop_ids(path, self.eos_id)
        self.never_generated: tuple[int, ...] = ()

    def _template(self, path: str) -> tuple[list[int], list[int]]:
        """(ids the post-processor puts before a text, ids it puts after), found as where the plain encoding of a
        probe text sits inside the templated one (the first probe the vocabulary can encode). A template that
        changes the text's own tokens is refused: BOS cannot be told from it, and the pipeline would not encode
        documents as transformers does."""
        for probe in ("a", "the", "0", " "):
            plain = self._tok.encode(probe, add_special_tokens=False).ids
            full = self._tok.encode(probe, add_special_tokens=True).ids
            if plain:
                at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
                if at is None:
                    raise ConfigError(f"tokenizer_path={path}: the template of tokenizer.json changes a text's tokens "
                                      f"({probe!r} is {plain} alone, {full} with special tokens)")
                return full[:at], full[at + len(plain) :]
        return [], []

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """As `tokenizer(text)` encodes it: the tokenizer's own template decides BOS (and anything else)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), np.int32)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's character span, no template (chat templates write their own specials)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def fingerprint(self) -> str:
        ids = f"{self.start_id},{self.eos_id},{self.pad_id}".encode()
        return "hf-tokenizers:" + hashlib.sha256(self._tok.to_str().encode() + ids).hexdigest()[:16]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included ("<s>"): lm-eval's Hugging Face backend checks whether a text
        already starts with BOS by it (maxshard/evaluation/harness.py)."""
        return self._tok.decode([int(token)], skip_special_tokens=False)


def _check_flags(path: str, flags: Mapping[str, Any], adds: Mapping[str, bool]) -> None:
    """tokenizer_config.json's add_bos_token/add_eos_token must say what the template does: transformers'
    Llama-style tokenizers rebuild the template from them, others keep tokenizer.json's, so where the two
    disagree transformers' encoding depends on the tokenizer class and version."""
    for token, added in adds.items():
        field = f"add_{token.lower()}_token"
        if flags.get(field) is not None and bool(flags[field]) != added:
            raise ConfigError(f"tokenizer_path={path}: tokenizer_config.json has {field}={json.dumps(flags[field])}"
                              f" but the template of tokenizer.json {'adds' if added else 'adds no'} {token}; "
                              "make them agree")


def _json_beside(path: str, name: str) -> dict[str, Any]:
    """A JSON file in the tokenizer's directory ({} when absent); unreadable is a ConfigError naming it."""
    other = os.path.join(os.path.dirname(path), name)
    if not os.path.isfile(other):
        return {}
    try:
        with open(other, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer_path={path}: cannot read {other}: {e}") from None


def stop_ids(path: str, eos_id: int) -> tuple[int, ...]:
    """The EOS ids transformers' generate stops at (generation_config.json's eos_token_id, an id or a list, else
    config.json's, beside the tokenizer), then `eos_id` where they lack it: every fine-tuning document ends with
    the tokenizer's EOS, so a fine-tuned model stops there even when the list names only another id (an instruct
    model's end of turn). More than MAX_STOP_IDS is a ConfigError naming the file."""
    for name in ("generation_config.json", "config.json"):
        eos = _json_beside(path, name).get("eos_token_id")
        if eos is not None:
            stops = tuple(dict.fromkeys((*(int(i) for i in (eos if isinstance(eos, list) else [eos])), eos_id)))
            if len(stops) > MAX_STOP_IDS:
                raise ConfigError(f"tokenizer_path={path}: {name} lists {len(stops)} EOS ids with the tokenizer's "
                                  f"eos_token; generation stops at up to {MAX_STOP_IDS}")
            return stops
    return (eos_id,)


def _special_tokens(files: list[Mapping[str, Any]], tokenizer: Any) -> dict[str, str]:
    """{"bos_token": text, ...}: each field from the first of `files` (special_tokens_map.json, then
    tokenizer_config.json: transformers lets the first override the second) that has it, a null there meaning
    none; an EOS no file names is the first well-known EOS name the vocabulary holds. Nothing else is guessed from
    the vocabulary."""
    special = {}
    for field in _SPECIAL_FIELDS:
        named = next((f for f in files if field in f), None)
        value = named[field] if named is not None else None
        token = value.get("content") if isinstance(value, dict) else value
        if named is None and field == "eos_token":
            token = next((t for t in _KNOWN_EOS if tokenizer.token_to_id(t) is not None), None)
        if token is not None:
            special[field] = token
    return special


def _token_id(tokenizer: Any, path: str, field: str, token: str) -> int:
    """The id of a special token a file names; ConfigError where the vocabulary lacks it."""
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ConfigError(f"tokenizer_path={path}: its config names {field} {token!r}, which tokenizer.json's "
                          "vocabulary does not hold")
    return token_id


def load_hf_tokenizer(path: str) -> HuggingFaceTokenizer:
    """Loads a `tokenizer.json`; every failure is a ConfigError naming `tokenizer_path` and the file."""
    tokenizers = _optional_package("tokenizers", path)
    try:
        tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception for any malformed file
        raise ConfigError(f"tokenizer_path={path} is not a Hugging Face tokenizer.json: "
                          f"{str(e).splitlines()[0][:160]}") from None
    named = _json_beside(path, "tokenizer_config.json")
    files = [_json_beside(path, "special_tokens_map.json"), named]
    return HuggingFaceTokenizer(tokenizer, path, _special_tokens(files, tokenizer), named)


def make_tokenizer(cfg: Config) -> ByteTokenizer | SentencePieceTokenizer | HuggingFaceTokenizer:
    """The tokenizer the config asks for (`tokenizer_path`, see `tokenizer_at`)."""
    return tokenizer_at(cfg.tokenizer_path)


def tokenizer_at(path: str) -> ByteTokenizer | SentencePieceTokenizer | HuggingFaceTokenizer:
    """A `.json` path is a Hugging Face tokenizer, another path SentencePiece, none bytes (also what
    tools/prepare_data.py tokenizes with, so its ids are the run's)."""
    if not path:
        return ByteTokenizer()
    if path.endswith(".json"):
        return load_hf_tokenizer(path)
    return load_sentencepiece(path)


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
