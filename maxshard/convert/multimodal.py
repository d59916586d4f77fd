"""Multimodal checkpoints whose language model is a family maxshard converts: the text model alone.

Qwen3.5 (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`) is published the same way, its
language model under `model.language_model.*` beside the vision tower's `model.visual.*`; Llama 4
(`Llama4ForConditionalGeneration`) under `language_model.*` beside `vision_model.*` and `multi_modal_projector.*`;
Gemma 4 (`Gemma4ForConditionalGeneration`) under `model.language_model.*` beside its vision and audio towers.

Google publishes Gemma 3 4B, 12B and 27B as `Gemma3ForConditionalGeneration`: config.json nests the language
model's fields in `text_config` (sparse, transformers' Gemma3TextConfig defaults filling the rest) beside a vision
tower's, and the safetensors hold the language model under `language_model.model.*` (transformers 5 also reads
`model.language_model.*`) beside `vision_tower.*` and `multi_modal_projector.*`. maxshard trains decoder-only text
models, so `from_hf` converts the language model as its text family (Gemma3ForCausalLM) and leaves the vision
tensors out, saying so; the `hf/` template it keeps is the text config, so `to_hf` writes the text model back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from maxshard.errors import ConfigError

__all__ = ["Wrapper", "WRAPPERS", "text_model", "text_tensors"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """A multimodal architecture: the text family it holds, where its text tensors live, what is left out."""

    architecture: str
    text_architecture: str
    renames: tuple[tuple[str, str], ...]  # (wrapper prefix, text model prefix), first match wins
    left_out: tuple[str, ...]  # prefixes of the tensors that are not the language model's


WRAPPERS = (
    Wrapper("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM",
            renames=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("model.language_model.", "model."), ("lm_head.", "lm_head.")),
            left_out=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                      "model.multi_modal_projector.")),
    # Llama 4 (Scout, Maverick) as Meta publishes it: the language model under language_model.*, the vision model
    # and its projector beside it
    Wrapper("Llama4ForConditionalGeneration", "Llama4ForCausalLM",
            renames=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
            left_out=("vision_model.", "multi_modal_projector.")),
    # Gemma 4 as Google publishes it: the language model under model.language_model.*, the vision and audio towers
    # and their embedders beside it (the head tied to the embedding)
    Wrapper("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM",
            renames=(("model.language_model.", "model."), ("lm_head.", "lm_head.")),
            left_out=("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")),
    # Qwen3.5 (dense and MoE) as Qwen publishes it: the language model under model.language_model.*, the vision
    # tower under model.visual.*; the multi-token prediction head (mtp.*) passes to the text family, which leaves
    # it out as transformers does
    *(Wrapper(f"{name}ForConditionalGeneration", f"{name}ForCausalLM",
              renames=(("model.language_model.", "model."), ("lm_head.", "lm_head."), ("mtp.", "mtp.")),
              left_out=("model.visual.",)) for name in ("Qwen3_5", "Qwen3_5Moe")),
)


def text_model(hf: Mapping[str, Any]) -> tuple[Mapping[str, Any], Wrapper | None]:
    """(the config.json of the text model to convert, the wrapper around it): a text model's own config.json and
    None, or a wrapper's language model (`_text_config`) and the wrapper."""
    names = hf.get("architectures") or []
    wrapper = next((w for w in WRAPPERS if names == [w.architecture]), None)
    return (hf, None) if wrapper is None else (_text_config(hf, wrapper), wrapper)


def _text_config(hf: Mapping[str, Any], wrapper: Wrapper) -> dict[str, Any]:
    """The language model's config.json: `text_config` naming the text architecture. A field the wrapper holds at
    its top level only (tie_word_embeddings) carries over, as transformers ties the wrapper's head by it."""
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(f"config.json: architectures=[{wrapper.architecture!r}] without a text_config object")
    out = {k: v for k, v in text.items() if k != "_name_or_path"}
    if "tie_word_embeddings" in hf:
        out.setdefault("tie_word_embeddings", hf["tie_word_embeddings"])
    return {**out, "architectures": [wrapper.text_architecture]}


def text_tensors(tensors: Mapping[str, T], wrapper: Wrapper, source: str) -> tuple[dict[str, T], int]:
    """The language model's tensors under the text model's names, and how many tensors were left out (vision tower,
    projector). A tensor under no known prefix is an error naming it, never dropped silently."""
    out, left_out = {}, 0
    for name, info in tensors.items():
        if name.startswith(wrapper.left_out):
            left_out += 1
            continue
        prefix = next((p for p in wrapper.renames if name.startswith(p[0])), None)
        if prefix is None:
            raise ConfigError(f"{source}: tensor {name} belongs to no part of {wrapper.architecture} that maxshard "
                              f"knows (language model: {', '.join(p for p, _ in wrapper.renames)})")
        out[prefix[1] + name[len(prefix[0]):]] = info
    return out, left_out
