"""Llama 4's per-layer positions in config.json <-> maxshard's keys.

A Llama 4 text config says for each layer whether it rotates its queries and keys (`no_rope_layers`: 1 RoPE, 0
NoPE; without it every `no_rope_layer_interval`-th layer is NoPE) and how it attends (`layer_types`:
chunked_attention, within chunks of `attention_chunk_size`, or full_attention; without it the RoPE layers are
chunked when a chunk size is set), whether its NoPE layers scale their queries (`attn_temperature_tuning` with
`attn_scale` and `floor_scale`) and whether its RoPE layers L2-normalise q and k (`use_qk_norm`). These are
maxshard's `rope_layers`, `layer_types` (the same spellings), `attention_chunk_size`, `nope_temperature_scale` /
`nope_temperature_floor` and `qk_l2_norm`, transformers' rules applied where a field is absent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from maxshard.errors import ConfigError
from maxshard.spec import mixer_kinds

__all__ = ["check", "model_keys", "export_fields", "CHUNKED", "FULL"]

CHUNKED, FULL = "chunked_attention", "full_attention"


def _refuse(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={json.dumps(value)} is not supported: {why}")


def _rope_flags(hf: Mapping[str, Any]) -> list[int]:
    """One 0 or 1 a layer: config.json's no_rope_layers (its first num_hidden_layers), or transformers' rule."""
    n = hf["num_hidden_layers"]
    flags = hf.get("no_rope_layers")
    if not flags:
        interval = hf.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise _refuse("no_rope_layer_interval", interval, "needs a positive integer")
        return [int((i + 1) % interval != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) < n or any(f not in (0, 1) for f in flags[:n]):
        raise _refuse("no_rope_layers", flags, f"needs a 0 or 1 for each of the {n} layers")
    return [int(f) for f in flags[:n]]


def _layer_types(hf: Mapping[str, Any], flags: list[int]) -> list[str]:
    """config.json's layer_types, or transformers' rule: the RoPE layers chunked when a chunk size is set."""
    types = hf.get("layer_types")
    if types is None:
        chunked = hf.get("attention_chunk_size") is not None
        types = [CHUNKED if flag and chunked else FULL for flag in flags]
    if not isinstance(types, list) or len(types) != len(flags) or set(types) - {CHUNKED, FULL}:
        raise _refuse("layer_types", types, f"needs {CHUNKED} or {FULL} for each of the {len(flags)} layers")
    return list(types)


def _moe_layers(hf: Mapping[str, Any]) -> None:
    """An explicit moe_layers list must be what interleave_moe_layer_step gives (the last of every step)."""
    step, n = hf.get("interleave_moe_layer_step", 1), hf["num_hidden_layers"]
    listed = hf.get("moe_layers")
    if listed is not None and list(listed) != list(range(step - 1, n, step)):
        raise _refuse("moe_layers", listed, f"maxshard routes the last of every interleave_moe_layer_step={step} "
                      "layers")


def model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The position keys of a Llama 4 config.json (transformers' defaults already merged in)."""
    _moe_layers(hf)
    flags = _rope_flags(hf)
    types = _layer_types(hf, flags)
    chunk = hf.get("attention_chunk_size")
    chunked = CHUNKED in types
    if chunked and (not isinstance(chunk, int) or chunk < 1):
        raise _refuse("attention_chunk_size", chunk, f"the {CHUNKED} layers need a positive chunk size")
    nope = 0 in flags
    scale = float(hf.get("attn_scale", 0.1)) if hf.get("attn_temperature_tuning") and nope else 0.0
    return {"layer_types": types, "attention_chunk_size": chunk if chunked else 0,
            "rope_layers": flags if nope else [], "nope_temperature_scale": scale,
            "nope_temperature_floor": int(hf.get("floor_scale", 8192)), "qk_l2_norm": bool(hf.get("use_qk_norm"))}


def check(hf: Mapping[str, Any]) -> None:
    """Refuses a config.json whose positions maxshard cannot compute (one line naming the field)."""
    model_keys(hf)


def export_fields(keys: Mapping[str, Any], out: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's position fields for the model keys: every layer's type (its local layers chunked), RoPE flag,
    the chunk size (null without chunked layers), the temperature and the q/k norm switch."""
    n = keys["num_layers"]
    types = []
    for i, entry in enumerate(keys.get("layer_types") or ["gqa"] * n):
        row, local = mixer_kinds.resolve(entry)
        if not row.attention or mixer_kinds.latent(row.name):
            raise ConfigError(f"layer_types[{i}]={entry!r} cannot be written as Llama 4 (every layer is grouped-query "
                              "attention)")
        types.append(CHUNKED if local else FULL)
    scale = keys.get("nope_temperature_scale") or 0.0
    return {"layer_types": types, "no_rope_layers": list(keys.get("rope_layers") or [1] * n),
            "attention_chunk_size": keys.get("attention_chunk_size") or None,
            "attn_temperature_tuning": scale > 0, "attn_scale": scale or out.get("attn_scale", 0.1),
            "floor_scale": keys.get("nope_temperature_floor", 8192), "use_qk_norm": bool(keys.get("qk_l2_norm"))}
