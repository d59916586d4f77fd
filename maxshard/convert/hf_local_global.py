"""config.json <-> model keys of local/global families (Gemma 2 and 3, OLMo 3): layer types, the window, RoPE per layer type.

transformers describes each layer by `layer_types[i]` ("sliding_attention" or "full_attention", the former seeing
the last `sliding_window` tokens, its own included: the same window as maxshard's `sliding_window`); maxshard by a
repeating `attention_pattern` (layer i is pattern[i % length], spec/blocks.py). Import takes the shortest period
that reproduces every layer's type, so the model computes exactly the listed layers (Gemma 3 27B: 62 layers, a
period of 6); export writes the list back out in full. Gemma 3 gives its global layers `rope_theta` and their
scaling, its local ones `rope_local_base_freq` unscaled: maxshard's `rope_local_max_timescale`; OLMo 3 gives them
rope_parameters.sliding_attention (written in that spelling, which transformers 5 reads for both layer types).

hf_config.py calls these for families with `local_global` / `rope_per_layer_type` (families.py); every value
maxshard cannot compute is a ConfigError naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from maxshard.convert.families import Family
from maxshard.errors import ConfigError

__all__ = ["LOCAL", "GLOBAL", "check", "types_of", "pattern_keys", "shortest_period", "layer_types", "rope_keys",
           "export_fields"]

LOCAL, GLOBAL = "sliding_attention", "full_attention"
_KINDS = {LOCAL: "local", GLOBAL: "global"}


def _refuse(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={json.dumps(value)} is not supported: {why}")


def check(hf: Mapping[str, Any], fam: Family) -> None:
    """Fields of these families that change the function in ways maxshard cannot compute."""
    mode = hf.get("use_bidirectional_attention")
    if mode and mode != fam.bidirectional_images:
        raise _refuse("use_bidirectional_attention", hf["use_bidirectional_attention"],
                      "maxshard's decoder attends causally")
    for field in fam.refuse_set:
        if hf.get(field) is not None:
            raise _refuse(field, hf[field], f"transformers' {fam.architecture} does not apply it, so maxshard "
                          "does not guess whether the checkpoint needs it")


def types_of(hf: Mapping[str, Any], fam: Family) -> list[str]:
    """layer_types, or transformers' rule without it: layer i is local unless (i + 1) % period == 0; in a family
    whose last layer is always global (Gemma 4: transformers forces it, whatever the file says), so."""
    types = _listed_types(hf, fam)
    return [*types[:-1], GLOBAL] if fam.last_layer_global and types else types


def _listed_types(hf: Mapping[str, Any], fam: Family) -> list[str]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        period = hf.get(fam.pattern_period_field) if fam.pattern_period_field else None
        period = period or fam.pattern_period
        if not isinstance(period, int) or period < 1:
            raise _refuse(fam.pattern_period_field or "layer_types", period, "needs a positive integer period")
        return [LOCAL if (i + 1) % period else GLOBAL for i in range(n)]
    unknown = sorted(set(types) - set(_KINDS))
    if unknown:
        raise _refuse("layer_types", unknown, f"maxshard's layers are {LOCAL} or {GLOBAL}")
    if len(types) != n:
        raise _refuse("layer_types", f"{len(types)} entries", f"num_hidden_layers is {n}")
    return list(types)


def shortest_period(kinds: list[str]) -> int:
    """The shortest p with kinds[i] == kinds[i % p] for every layer (len(kinds) at worst)."""
    return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def pattern_keys(hf: Mapping[str, Any], fam: Family) -> dict[str, Any]:
    """attention_pattern and sliding_window of the layer types and window config.json describes."""
    kinds = [_KINDS[t] for t in types_of(hf, fam)]
    pattern = kinds[: shortest_period(kinds)]
    if "local" not in pattern:
        return {"attention_pattern": pattern, "sliding_window": 0}
    window = hf.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise _refuse("sliding_window", window, f"the {LOCAL} layers need a window of at least one token")
    return {"attention_pattern": pattern, "sliding_window": window}


def layer_types(keys: Mapping[str, Any]) -> list[str]:
    """Every layer's type, from attention_pattern (the inverse of `pattern_keys`)."""
    pattern = list(keys.get("attention_pattern", ["global"]))
    if not keys.get("sliding_window"):
        pattern = ["global"] * len(pattern)
    return [LOCAL if pattern[i % len(pattern)] == "local" else GLOBAL for i in range(keys["num_layers"])]


def _local_base(hf: Mapping[str, Any], fam: Family) -> float:
    """The local layers' RoPE base a config.json without one in rope_parameters means (`Family.local_base_field`)."""
    return hf.get(fam.local_base_field, fam.local_base_default) if fam.local_base_field else fam.local_base_default


def rope_keys(hf: Mapping[str, Any], parse: Callable[[Mapping[str, Any]], dict[str, Any]],
              fam: Family) -> dict[str, Any]:
    """Gemma 3's and OLMo 3's RoPE: the global layers' settings through `parse` (hf_config.rope_keys: base and
    scaling), the local layers' base as rope_local_max_timescale; a local layer with scaling of its own is
    refused."""
    params = hf.get("rope_parameters")
    if params is not None:
        unknown = sorted(set(params) - {GLOBAL, LOCAL})
        if unknown:
            raise _refuse("rope_parameters", unknown, f"RoPE settings are per {GLOBAL} and {LOCAL}")
        full = dict(params.get(GLOBAL) or {})
        full.setdefault("rope_theta", hf.get("rope_theta", 1e6))
        local = dict(params.get(LOCAL) or {})
        local_theta = local.get("rope_theta", _local_base(hf, fam))
        kind = local.get("rope_type", local.get("type", "default"))
        if kind != "default":
            raise _refuse(f"rope_parameters.{LOCAL}.rope_type", kind,
                          "maxshard's local layers use plain RoPE with their base")
        keys = parse({"rope_parameters": full})
    else:  # transformers 4.x: rope_theta + rope_scaling (global layers), rope_local_base_freq (local)
        keys = parse({"rope_theta": hf.get("rope_theta", 1e6), "rope_scaling": hf.get("rope_scaling")})
        local_theta = _local_base(hf, fam)
    return {**keys, "rope_local_max_timescale": float(local_theta)}


def export_fields(keys: Mapping[str, Any], fam: Family, out: Mapping[str, Any]) -> dict[str, Any]:
    """config.json fields of a local/global family: layer_types in full (and sliding_window_pattern where the
    template has it), the window, the activation, soft-caps as null when 0, Gemma 3's local RoPE base."""
    types = layer_types(keys)
    fields: dict[str, Any] = {"layer_types": types, "sliding_window": keys.get("sliding_window") or
                              out.get("sliding_window"), fam.activation_field: fam.activation}
    if "hidden_act" in out:  # published Gemma 2 configs repeat the activation under this name; transformers reads
        fields["hidden_act"] = fam.activation  # hidden_activation
    if fam.pattern_period_field and fam.pattern_period_field in out:
        fields[fam.pattern_period_field] = len(keys.get("attention_pattern", ["global"]))
    for field in fam.null_when_zero:
        if not keys.get(fam.fields[field]):
            fields[field] = None
    if "query_pre_attn_scalar" in fam.fields:  # Gemma's (GPT-OSS has none)
        scalar = keys.get("query_pre_attn_scalar") or keys["head_dim"]  # 0: head_dim ** -0.5, as maxshard computes
        fields["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
    if fam.rope_per_layer_type:
        local = keys.get("rope_local_max_timescale") or 0.0
        if not local:
            if keys.get("rope_scaling_type", "none") != "none":
                raise ConfigError(f"rope_local_max_timescale=0 with rope_scaling_type={keys['rope_scaling_type']} "
                                  f"cannot be written as {fam.architecture} (its local layers' RoPE is unscaled)")
            local = keys["rope_max_timescale"]
        if fam.local_base_field:
            fields[fam.local_base_field] = local
        else:  # no 4.x field reaches the local layers: both layer types in rope_parameters (hf_config.to_hf)
            fields["rope_parameters"] = {LOCAL: {"rope_type": "default", "rope_theta": local}}
    return fields
