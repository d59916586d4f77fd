"""Chat records -> token pairs whose loss counts only the assistant turns (`dataset_type: chat`).

A record holds `messages_field` (default `messages`): a list of {"role": ..., "content": ...}. The conversation is
rendered with the chat template (`chat_template`; see `chat_template.py` for how it is rendered and how the
assistant spans are found), tokenized, and each token weighs 1 in the loss when it overlaps an assistant span
(transformers' `return_assistant_tokens_mask` counts a token that holds a span's first or last character, and all
between), else 0. The pair is the rendered tokens shifted by one, as for text (`packing.document_pair`), with
`WEIGHT` the weight of each target.

The rendered text is the whole document: the template writes BOS (and end-of-turn tokens) itself, so the pipeline
adds no BOS or EOS around it. With a Hugging Face tokenizer the special tokens are the template's text
(`<|im_start|>`), which `tokenizer.json` maps to their ids as transformers does (`add_special_tokens=False`). Byte-level
and SentencePiece tokenizers have no text for BOS and EOS: the template sees `bos_token` = `<|bos|>` and `eos_token`
= `<|eos|>`, and those strings become the BOS and EOS ids when the text is encoded.

Skipped and counted, never a crash (`BadRecord`): a record that is no conversation (a missing field, not a list of
role/content objects), one the template refuses (`raise_exception`) or cannot render, one without an assistant
turn, and one longer than `max_target_length` (it would be cut, the reply losing its prompt).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from maxshard.data.chat_template import DEFAULT_TEMPLATE, ChatTemplate, TemplateError
from maxshard.data.sources import BadRecord
from maxshard.dataset_types import CHAT_PREFIX
from maxshard.errors import ConfigError

__all__ = ["WEIGHT", "Conversation", "as_conversation", "ChatEncoder", "load_template", "encode_conversation",
           "encode_rendered", "run_template", "describe"]

WEIGHT = "_weight"  # per-target loss weight of a pair (float32); text documents weigh 1 everywhere
_SPECIAL_TEXT = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}  # byte-level / SentencePiece stand-ins


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One chat record: its messages (plain dicts, as the template expects them)."""

    messages: tuple[dict[str, Any], ...]


def as_conversation(value: Any, where: str) -> Conversation | BadRecord:
    """A record's messages field (a list, or its JSON text) -> a Conversation, or a BadRecord saying why not."""
    if value is None:
        return BadRecord("missing field", where)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return BadRecord("invalid JSON", where)
    if not isinstance(value, (list, tuple)) or not value:
        return BadRecord("not a list of messages", where)
    for message in value:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
            return BadRecord("not a list of messages", where)
    return Conversation(tuple(dict(m) for m in value))


def _read_template(path: str, key: str) -> str:
    """A template file's text; ConfigError (one line naming `key`) when it cannot be read as UTF-8."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: cannot read it ({type(e).__name__}: {e})") from None


def _template_source(tokenizer_path: str, setting: str) -> tuple[str, str, dict[str, Any]]:
    """(source, name, tokenizer_config) of the template that `chat_template` selects (see configs/base.yml)."""
    config: dict[str, Any] = {}
    directory = os.path.dirname(tokenizer_path) if tokenizer_path.endswith(".json") else ""
    if directory and os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        try:
            with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"tokenizer_path={tokenizer_path}: cannot read its tokenizer_config.json: {e}") from None
    if setting == "default":
        return DEFAULT_TEMPLATE, "default", config
    if setting:
        if not os.path.isfile(setting):
            raise ConfigError(f"chat_template={setting}: no such file (auto, default, or a .jinja file)")
        return _read_template(setting, f"chat_template={setting}"), setting, config
    jinja = os.path.join(directory, "chat_template.jinja") if directory else ""
    if jinja and os.path.isfile(jinja):
        return _read_template(jinja, f"chat_template: {jinja}"), jinja, config
    named = config.get("chat_template")
    if isinstance(named, list):  # [{"name": "default", "template": ...}, ...]
        named = next((t.get("template") for t in named if t.get("name") == "default"), None)
    if isinstance(named, str) and named:
        return named, os.path.join(directory, "tokenizer_config.json"), config
    return DEFAULT_TEMPLATE, "default", config


def _special_tokens(config: dict[str, Any], hf: bool) -> dict[str, str]:
    """The special tokens a template sees, as text: tokenizer_config.json's (HF), else the stand-ins."""
    if not hf:
        return dict(_SPECIAL_TEXT)
    tokens = {}
    for key, value in config.items():
        if key.endswith("_token") and value is not None:
            tokens[key] = value.get("content") if isinstance(value, dict) else value
    return {k: v for k, v in tokens.items() if isinstance(v, str)}


def load_template(tokenizer_path: str, setting: str = "") -> ChatTemplate:
    """The run's template: `chat_template` (`""`: the tokenizer's own, else the default)."""
    source, name, config = _template_source(tokenizer_path, setting)
    return ChatTemplate(source, name, _special_tokens(config, tokenizer_path.endswith(".json")))


def _has_chat(cfg: Any) -> bool:
    """Whether the run may read conversations (preference records and prompts may be conversations too)."""
    named = cfg.dataset_type in ("chat", "preference", "prompts")
    return named or any(str(s).startswith(CHAT_PREFIX) for s, _ in cfg.dataset_mixture)


def run_template(cfg: Any) -> ChatTemplate | None:
    """The template of a run that reads chat sources (None: it reads none)."""
    return load_template(cfg.tokenizer_path, cfg.chat_template) if _has_chat(cfg) else None


def describe(cfg: Any) -> dict[str, str] | None:
    """The startup summary's record of the template: where it came from and a digest of its text."""
    template = run_template(cfg)
    return None if template is None else {"name": template.name, "sha256": template.digest}


@dataclasses.dataclass(frozen=True)
class ChatEncoder:
    """Conversation -> pair with WEIGHT (picklable: runs in grain workers)."""

    template: ChatTemplate
    tokenizer: Any
    max_length: int  # max_target_length: longer conversations are skipped

    def __call__(self, conversation: Conversation, where: str) -> dict[str, np.ndarray] | BadRecord:
        try:
            tokens, weights = encode_conversation(conversation, self.template, self.tokenizer)
        except TemplateError as e:  # the reason stays fixed (counted by kind); the template's words go to `where`
            return BadRecord("template refused it", f"{where} ({str(e)[:80]})")
        except UnicodeEncodeError:
            return BadRecord("invalid UTF-8", where)
        if not weights[1:].any():
            return BadRecord("no assistant turn", where)
        if len(tokens) - 1 > self.max_length:
            return BadRecord("longer than max_target_length", where)
        return {"inputs": tokens[:-1], "targets": tokens[1:], WEIGHT: weights[1:].astype(np.float32)}


def encode_conversation(conversation: Conversation, template: ChatTemplate, tokenizer: Any
                        ) -> tuple[np.ndarray, np.ndarray]:
    """int32 [tokens] of the rendered conversation and int8 [tokens]: 1 where a token is in an assistant span."""
    text, spans = template.render_with_spans([dict(m) for m in conversation.messages])
    offsets_of = getattr(tokenizer, "encode_offsets", None)
    if offsets_of is not None:
        ids, offsets = offsets_of(text)
        return np.asarray(ids, np.int32), _overlap(offsets, spans)
    return _encode_pieces(text, spans, tokenizer)


def encode_rendered(text: str, tokenizer: Any) -> np.ndarray:
    """int32 ids of text a template rendered, tokenized as `encode_conversation` tokenizes a conversation (the
    template wrote the special tokens: no BOS is added; byte-level stand-ins become BOS/EOS ids)."""
    if getattr(tokenizer, "encode_offsets", None) is not None:
        return np.asarray(tokenizer.encode_offsets(text)[0], np.int32)
    return _encode_pieces(text, [], tokenizer)[0]


def _overlap(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters [start, end) overlap a span."""
    bounds = np.asarray(offsets, np.int64).reshape(-1, 2)
    starts, ends = bounds[:, 0], np.maximum(bounds[:, 1], bounds[:, 0] + 1)
    mask = np.zeros(len(bounds), bool)
    for s, e in spans:
        mask |= (starts < e) & (s < ends)
    return mask.astype(np.int8)


def _encode_pieces(text: str, spans: list[tuple[int, int]], tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level / SentencePiece: the text encoded piece by piece (cut at span edges and at the <|bos|>/<|eos|>
    stand-ins, which become the BOS/EOS ids), each piece's tokens weighted as the piece."""
    cuts = sorted({0, len(text), *(p for s in spans for p in s)})
    ids: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    for start, end in zip(cuts, cuts[1:]):
        inside = any(s <= start and end <= e for s, e in spans)
        for piece in _split_specials(text[start:end], tokenizer):
            piece_ids = piece if isinstance(piece, np.ndarray) else tokenizer.encode_array(piece)
            ids.append(piece_ids.astype(np.int32))
            weights.append(np.full(len(piece_ids), int(inside), np.int8))
    if not ids:
        return np.zeros(0, np.int32), np.zeros(0, np.int8)
    return np.concatenate(ids), np.concatenate(weights)


def _split_specials(text: str, tokenizer: Any) -> list[str | np.ndarray]:
    """Text -> pieces of text and single-id arrays for the BOS/EOS stand-ins."""
    ids = {_SPECIAL_TEXT["bos_token"]: tokenizer.bos_id, _SPECIAL_TEXT["eos_token"]: tokenizer.eos_id}
    pieces: list[str | np.ndarray] = []
    rest = text
    while rest:
        found = [(rest.find(s), s) for s in ids if rest.find(s) >= 0]
        if not found:
            pieces.append(rest)
            break
        at, special = min(found)
        if at:
            pieces.append(rest[:at])
        pieces.append(np.asarray([ids[special]], np.int32))
        rest = rest[at + len(special):]
    return pieces
