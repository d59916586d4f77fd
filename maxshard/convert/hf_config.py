"""Hugging Face `config.json` <-> maxshard model keys, refusing whatever maxshard's model cannot compute.

A converted model must compute exactly what it computed in transformers, so every field that would change the
function and that maxshard has no key for (biases, a sliding window, another RoPE scaling, another activation,
quantisation) is one ConfigError naming the field, never dropped. Both spellings of the RoPE settings are read:
top-level `rope_theta` + `rope_scaling` (transformers 4.x, what most published checkpoints carry) and
`rope_parameters` (transformers 5.x, `rope_theta` inside). Exports use the 4.x spelling, which both versions read,
but for a family whose local layers no 4.x field reaches (OLMo 3: rope_parameters per layer type).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from maxshard.convert import hf_layer_dims, hf_local_global, hf_moe_block, hf_positions, names
from maxshard.convert.families import Family, by_architecture, by_model_type, rows
from maxshard.errors import ConfigError
from maxshard.spec import mixer_kinds
from maxshard.spec.model_config import ModelConfig

__all__ = ["MAX_TARGET_LENGTH", "read", "family", "model_keys", "rope_keys", "to_hf", "default_max_position",
           "family_of_keys", "LAYER_OPTIONS"]

MAX_TARGET_LENGTH = 2048  # the training length config.yml gets when the model allows more (a key to override)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_LLAMA3 = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
           "high_freq_factor": "rope_high_freq_factor",
           "original_max_position_embeddings": "rope_original_max_position"}
_YARN = {"factor": ("rope_scaling_factor", None), "original_max_position_embeddings": ("rope_original_max_position", None),
         "beta_fast": ("yarn_beta_fast", 32.0), "beta_slow": ("yarn_beta_slow", 1.0), "mscale": ("yarn_mscale", 1.0),
         "mscale_all_dim": ("yarn_mscale_all_dim", 0.0)}
_REPLACED = ("rope_parameters", "rope_scaling", "rope_theta", "torch_dtype", "dtype", "transformers_version",
             "quantization_config")  # exports are plain tensors, whatever the source was
# Model keys that change the function and that only some families' config.json can express (families.py `keys` and
# `carries`): a model with any other value than the default cannot be written as a family that has neither.
LAYER_OPTIONS = ("sliding_window", "attention_pattern", "rope_local_max_timescale", "attn_logit_softcapping",
                 "final_logit_softcapping", "query_pre_attn_scalar", "attention_sinks", "attention_bias", "qkv_bias",
                 "norm_unit_offset", "post_norms", "mlp_activation", "embed_scale", "moe_bias",
                 "attention_output_gate", "partial_rotary_factor", "shared_expert_gate", "layer_types",
                 "pre_norms", "qk_norm_all_heads", "attention_chunk_size", "rope_layers", "nope_temperature_scale",
                 "qk_l2_norm", "moe_weights_on_input", "rope_proportion", "value_norm", "kv_shared_layers",
                 "per_layer_input_dim", "per_layer_vocab_size", "layer_scalar", "global_head_dim",
                 "global_num_kv_heads", "kv_shared_mlp_dim", "global_values_from_keys", "moe_beside_mlp")
# The hybrids' (Qwen3-Next, Qwen3.5) layer_types without the field: transformers' rule, every n-th layer full
# attention (config.json's full_attention_interval, default 4), the others linear attention, in config.json's words
HYBRID_INTERVAL = ("full_attention_interval", 4)
HF_LINEAR, HF_FULL = "linear_attention", "full_attention"


def read(directory: str) -> dict[str, Any]:
    """The parsed config.json of a Hugging Face model directory."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{directory} has no config.json (expected a Hugging Face model directory)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def family(hf: Mapping[str, Any]) -> Family:
    """The family row of the one class a config.json's `architectures` names (its `model_type` when that list is
    missing); a ConfigError naming the field when maxshard has no such row."""
    names, supported = hf.get("architectures") or [], ", ".join(f.architecture for f in rows())
    if not names:
        found = by_model_type(hf.get("model_type"))
        if found is None:
            raise ConfigError(f"config.json: model_type={hf.get('model_type')!r} is not supported "
                              f"(maxshard converts {supported})")
        return found
    found = by_architecture(_causal(names[0])) if len(names) == 1 else None
    if found is None:
        raise ConfigError(f"config.json: architectures={names} is not supported (maxshard converts {supported})")
    return found


# A reward model's class: the family's causal LM with a score head (`score_head`) for one label in place of lm_head.
SCORING, CAUSAL = "ForSequenceClassification", "ForCausalLM"


def _causal(architecture: str) -> str:
    """The family's causal-LM class of a reward model's class name (the name itself otherwise)."""
    return architecture.removesuffix(SCORING) + CAUSAL if architecture.endswith(SCORING) else architecture


def _score_head(hf: Mapping[str, Any]) -> bool:
    """Whether config.json is a reward model's (a family's ForSequenceClassification with one label)."""
    names = hf.get("architectures") or []
    if not (len(names) == 1 and names[0].endswith(SCORING)):
        return False
    labels = len(hf.get("id2label") or {"0": "LABEL_0"})
    if labels != 1:
        raise _refuse("id2label", hf.get("id2label"), f"maxshard converts {names[0]} as a reward model, one label "
                      f"(num_labels 1), not {labels}")
    return True


def _refuse(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={json.dumps(value)} is not supported: {why}")


def _check_window(hf: Mapping[str, Any], fam: Family) -> None:
    """A sliding window shorter than the context changes attention; maxshard attends over the whole context."""
    if fam.window_switch is not None and not hf.get(fam.window_switch):
        return  # Qwen3 carries a sliding_window that applies only with use_sliding_window
    window, max_position = hf.get("sliding_window"), hf.get("max_position_embeddings")
    if window is not None and (max_position is None or window < max_position):
        raise _refuse("sliding_window", window, f"maxshard attends over the whole context "
                      f"(max_position_embeddings={max_position}); only null or >= max_position_embeddings converts")


def _check_representable(hf: Mapping[str, Any], fam: Family) -> None:
    """Fields that change the function in ways maxshard's decoder cannot reproduce."""
    for field in ("mlp_bias",) if fam.biases or fam.qkv_bias else ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise _refuse(field, hf[field], "maxshard's projections have no biases")
    act = hf.get(fam.activation_field, fam.activation)
    if act != fam.activation:
        raise _refuse(fam.activation_field, act, f"maxshard converts {fam.architecture}'s MLP with {fam.activation}")
    if fam.local_global:
        hf_local_global.check(hf, fam)
    elif fam.linear_attention:
        _check_window(hf, fam)
        hybrid_layer_types(hf)
    elif fam.per_layer_positions:
        hf_positions.check(hf)
    else:
        _check_window(hf, fam)
        kinds = sorted(set(hf.get("layer_types") or ["full_attention"]) - {"full_attention"})
        if kinds:
            raise _refuse("layer_types", kinds, "maxshard attends over the whole context in every layer")
    for field, value in fam.must_equal.items():
        if field in hf and hf[field] != value:
            raise _refuse(field, hf[field], f"maxshard converts {fam.architecture} only with {field}={value}")
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if hf.get("quantization_config") and method not in fam.quantized_experts:
        raise _refuse("quantization_config", hf["quantization_config"].get("quant_method", "?"),
                      "quantized checkpoints cannot be converted")
    for field in _REQUIRED:
        if field == "intermediate_size" and fam.is_moe:
            field = fam.expert_width_field  # the MLP width an MoE family's layers use (Qwen3.5-MoE has no other)
        if not isinstance(hf.get(field), int):
            raise ConfigError(f"config.json has no integer {field}")


def hybrid_layer_types(hf: Mapping[str, Any]) -> list[str]:
    """A hybrid's (Qwen3-Next, Qwen3.5) layer_types, the `layer_types` key as they are: config.json's list, or
    transformers' rule (HYBRID_INTERVAL); each entry a global mixer maxshard converts (spec/mixer_kinds.py
    spellings, convert/names.py MIXERS), one a layer."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        field, default = HYBRID_INTERVAL
        interval = hf.get(field, default)
        if not isinstance(interval, int) or interval < 1:
            raise _refuse(field, interval, "needs a positive integer")
        types = [HF_LINEAR if (i + 1) % interval else HF_FULL for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise _refuse("layer_types", types, f"needs one entry a layer (num_hidden_layers is {n})")
    for entry in types:
        try:
            row, local = mixer_kinds.resolve(entry)
        except (KeyError, TypeError):
            row, local = None, False
        if row is None or local or row.name not in names.MIXERS:
            raise _refuse("layer_types", entry, "maxshard converts global layers of "
                          f"{', '.join(s for k in names.MIXERS for s in mixer_kinds.kind(k).hf)}")
    return list(types)


def partial_rotary(hf: Mapping[str, Any], fam: Family) -> float:
    """The share of each head RoPE turns: rope_parameters' partial_rotary_factor (transformers 5.x), the top-level
    field (4.x), the family's count of rotated features over head_dim (MiniMax-M2's rotary_dim), else the family's
    default (Qwen3-Next's 0.25; 1 for the others)."""
    params = hf.get("rope_parameters") or {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if value is None and fam.rotary_dim_field and hf.get(fam.rotary_dim_field) is not None:
        value = hf[fam.rotary_dim_field] / (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    value = 1.0 if value is None else value
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _refuse("partial_rotary_factor", value, "needs a number in (0, 1]")
    if value != 1 and "partial_rotary_factor" not in fam.carries:
        raise _refuse("partial_rotary_factor", value, f"maxshard converts {fam.architecture} with RoPE on whole "
                      "heads")
    return float(value)


def rope_keys(hf: Mapping[str, Any], linear: bool = False) -> dict[str, Any]:
    """rope_max_timescale and the rope_scaling_* keys from either spelling of the RoPE settings (`linear`: the
    families whose linear scaling converts, Gemma's)."""
    if hf.get("rope_parameters") is not None:
        params, where = dict(hf["rope_parameters"]), "rope_parameters"
        if any(isinstance(v, Mapping) for v in params.values()):
            raise _refuse(where, sorted(params), "per-layer-type RoPE settings belong to other architectures")
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        params, where = dict(hf.get("rope_scaling") or {}), "rope_scaling"
        theta = hf.get("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    keys: dict[str, Any] = {"rope_max_timescale": float(theta), "rope_scaling_type": "none"}
    if kind == "default":
        return keys
    if kind == "yarn":
        return {**keys, **_yarn_keys(params, where)}
    if kind == "linear" and linear:
        if "factor" not in params:
            raise ConfigError(f"config.json: {where} has rope_type linear but no factor")
        return {**keys, "rope_scaling_type": "linear", "rope_scaling_factor": float(params["factor"])}
    if kind == "proportional":  # Gemma 4's global layers: pairs over the whole head, the first share turning
        factor = float(params.get("factor", 1.0))
        share = params.get("partial_rotary_factor", 1.0)
        if not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise _refuse(f"{where}.partial_rotary_factor", share, "needs a number in (0, 1]")
        scaled = {"rope_scaling_type": "linear", "rope_scaling_factor": factor} if factor != 1 else {}
        return {**keys, **scaled, "rope_proportion": float(share)}
    if kind != "llama3":
        raise _refuse(f"{where}.rope_type", kind, "maxshard implements default, llama3, yarn and proportional RoPE")
    for field, key in _LLAMA3.items():
        if field not in params:
            raise ConfigError(f"config.json: {where} has rope_type llama3 but no {field}")
        keys[key] = int(params[field]) if key == "rope_original_max_position" else float(params[field])
    keys["rope_scaling_type"] = "llama3"
    return keys


def _yarn_keys(params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """YaRN's constants, transformers' defaults where a field is absent; its variants maxshard lacks refused."""
    if params.get("attention_factor") is not None:
        raise _refuse(f"{where}.attention_factor", params["attention_factor"], "maxshard derives it from mscale")
    keys: dict[str, Any] = {"rope_scaling_type": "yarn"}
    if params.get("truncate", True) is not True:
        keys["yarn_truncate"] = False  # GPT-OSS
    for field, (key, default) in _YARN.items():
        if field not in params and default is None:
            raise ConfigError(f"config.json: {where} has rope_type yarn but no {field}")
        value = params.get(field, default)
        keys[key] = int(value) if key == "rope_original_max_position" else float(value)
    return keys


def _family_fields(hf: Mapping[str, Any], fam: Family) -> dict[str, Any]:
    """The family's own fields (`Family.fields`: DeepSeek's latent widths, groups, dense first layers) and the
    model keys it fixes."""
    out = dict(fam.keys)
    for field, key in fam.fields.items():
        value = hf.get(field)
        out[key] = 0 if value is None else value
    return out


def _moe_keys(hf: Mapping[str, Any], fam: Family) -> dict[str, Any]:
    """Routed experts in every layer, dropless (capacity_factor -1), so the model computes what transformers does."""
    field = next((f for f in fam.experts_fields if f in hf), fam.experts_fields[0])
    experts, k = hf.get(field), hf.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts < 2:
        raise ConfigError(f"config.json: {field}={json.dumps(experts)} is not supported: an MoE model needs >= 2 "
                          "experts")
    if not isinstance(k, int) or not 1 <= k <= experts:
        raise ConfigError(f"config.json: num_experts_per_tok={json.dumps(k)} is not supported: needs 1..{experts}")
    renormalize = (fam.renormalize_default if fam.renormalize_field is None
                   else bool(hf.get(fam.renormalize_field, fam.renormalize_default)))
    return {"num_experts": experts, "num_experts_per_tok": k, "capacity_factor": -1.0, "moe_layer_interval": 1,
            "num_shared_experts": _shared_experts(hf, fam), "moe_renormalize_top_k": renormalize}


def _shared_experts(hf: Mapping[str, Any], fam: Family) -> int:
    """Shared experts of a family that gives their whole width (`shared_width_field`): that width over an expert's;
    0 for one that has none (DeepSeek's count comes with its `fields`)."""
    if fam.shared_width_field is None:
        return 0
    width, expert = hf.get(fam.shared_width_field, 0) or 0, hf[fam.expert_width_field]
    if not isinstance(width, int) or width < 0 or width % expert:
        raise _refuse(fam.shared_width_field, width, f"maxshard's shared experts are whole experts of "
                      f"{fam.expert_width_field}={expert}")
    return width // expert


def model_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The maxshard model keys of a config.json of a supported family (ConfigError naming the field otherwise)."""
    fam = family(hf)
    hf = {**fam.defaults, **hf}  # a field the file omits means transformers' default for the family
    _check_representable(hf, fam)
    if fam.is_moe and not isinstance(hf.get(fam.expert_width_field), int):
        raise ConfigError(f"config.json has no integer {fam.expert_width_field}")
    heads = hf["num_attention_heads"]
    max_position = hf.get("max_position_embeddings") or MAX_TARGET_LENGTH
    return {
        "vocab_size": hf["vocab_size"],
        "emb_dim": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "mlp_dim": hf[fam.expert_width_field] if fam.is_moe else hf["intermediate_size"],
        "max_target_length": min(max_position, MAX_TARGET_LENGTH),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),  # Llama/Mistral default: untied
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "qk_norm": fam.qk_norm or bool(fam.qk_norm_field and hf.get(fam.qk_norm_field)),
        **(hf_local_global.rope_keys(hf, lambda h: rope_keys(h, linear=True), fam) if fam.rope_per_layer_type
           else rope_keys(hf, linear=fam.local_global)),
        **(_moe_keys(hf, fam) if fam.is_moe else {}),
        **_family_fields(hf, fam),
        **(hf_local_global.pattern_keys(hf, fam) if fam.local_global else {}),
        **({"layer_types": hybrid_layer_types(hf)} if fam.linear_attention else {}),
        **(hf_positions.model_keys(hf) if fam.per_layer_positions else {}),
        **(hf_layer_dims.model_keys(hf, hf_local_global.types_of(hf, fam)) if fam.per_layer_dims else {}),
        **(hf_moe_block.model_keys(hf, fam.moe_block_field) if fam.moe_block_field else {}),
        **({"partial_rotary_factor": rot} if (rot := partial_rotary(hf, fam)) != 1 else {}),
        **({"score_head": True} if _score_head(hf) else {}),
    }


def _rope_scaling(keys: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = keys.get("rope_scaling_type", "none")
    share = keys.get("rope_proportion", 1.0)
    if share != 1:  # proportional RoPE, with its factor where positions are scaled linearly
        factor = {"factor": keys["rope_scaling_factor"]} if kind == "linear" else {}
        return {"rope_type": "proportional", "partial_rotary_factor": share, **factor}
    if kind == "none":
        return None
    if kind == "yarn":
        truncate = {} if keys.get("yarn_truncate", True) else {"truncate": False}
        return {"rope_type": "yarn", **{field: keys.get(key, default) for field, (key, default) in _YARN.items()},
                **truncate}
    if kind == "linear":
        return {"rope_type": "linear", "factor": keys["rope_scaling_factor"]}
    return {"rope_type": "llama3", **{field: keys[key] for field, key in _LLAMA3.items()}}


def default_max_position(keys: Mapping[str, Any]) -> int:
    """Without a template: the training length, or the scaled context a llama3-scaled model was built for."""
    if keys.get("rope_scaling_type", "none") == "llama3":
        return max(keys["max_target_length"], int(keys["rope_original_max_position"] * keys["rope_scaling_factor"]))
    return keys["max_target_length"]


def family_of_keys(keys: Mapping[str, Any]) -> Family:
    """The family to export as when there is no template: the first row (the plainest first) that computes these
    model keys, so a new row needs no rule here."""
    refusals = []
    for fam in rows():
        try:
            _check_family(keys, fam)
        except ConfigError as refusal:
            refusals.append(str(refusal))
            continue
        return fam
    raise ConfigError(f"no Hugging Face family computes these model keys (the first row's refusal: {refusals[0]})")


def _check_family(keys: Mapping[str, Any], fam: Family) -> None:
    """The model keys must be what the family computes; otherwise transformers would load a different function."""
    experts = keys.get("num_experts", 1)
    qk_norm = bool(keys.get("qk_norm", False))
    block = bool(fam.moe_block_field and keys.get("moe_beside_mlp"))  # Gemma 4's experts beside the MLP
    wants = {"qk_norm": (qk_norm, qk_norm if fam.qk_norm_field else fam.qk_norm),
             "num_experts > 1": (experts > 1, fam.is_moe or block)}
    wants["attention_type"] = (keys.get("attention_type", ModelConfig.attention_type), fam.attention)
    for key, value in fam.keys.items():
        wants[key] = (keys.get(key), value)
    if fam.is_moe and "moe_layer_interval" not in fam.fields.values():
        wants["moe_layer_interval"] = (keys.get("moe_layer_interval", 1), 1)
    if fam.is_moe:
        if not fam.shared_experts:
            wants["num_shared_experts"] = (keys.get("num_shared_experts", 0), 0)
        if fam.renormalize_field is None:
            wants["moe_renormalize_top_k"] = (bool(keys.get("moe_renormalize_top_k", True)), fam.renormalize_default)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    wants.update(hf_moe_block.wants(keys, defaults) if block else {})
    for key in LAYER_OPTIONS:
        if key not in fam.keys and key not in fam.carries:
            have = keys.get(key, defaults[key])
            wants[key] = (list(have) if isinstance(have, (list, tuple)) else have,
                          list(defaults[key]) if isinstance(defaults[key], tuple) else defaults[key])
    for key, (have, need) in wants.items():
        if have != need:
            raise ConfigError(f"{key}={have} cannot be written as {fam.architecture} (which has {key}={need})")
    depth, most = keys.get("mtp_depth", 0), _mtp_modules(fam)
    if depth > most:
        raise ConfigError(f"mtp_depth={depth} cannot be written as {fam.architecture} (which keeps "
                          f"{most or 'no'} multi-token prediction module{'' if most == 1 else 's'})")


def _mtp_modules(fam: Family) -> int | float:
    """How many multi-token prediction modules a family's checkpoints keep: DeepSeek's any number
    (num_nextn_predict_layers), Qwen3-Next's one (`Family.mtp_prefix`), none for the others."""
    if "num_nextn_predict_layers" in fam.fields:
        return float("inf")
    return 1 if fam.mtp_prefix else 0


def _moe_fields(keys: Mapping[str, Any], fam: Family, template: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields of config.json, in the spelling the template uses (its experts field, if it has one)."""
    field = next((f for f in fam.experts_fields if f in template), fam.experts_fields[0])
    out = {field: keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
           fam.expert_width_field: keys["mlp_dim"]}
    if fam.renormalize_field is not None:
        out[fam.renormalize_field] = bool(keys.get("moe_renormalize_top_k", True))
    if fam.shared_width_field is not None:
        out[fam.shared_width_field] = keys.get("num_shared_experts", 0) * keys["mlp_dim"]
    if fam.expert_width_field != "intermediate_size" and "intermediate_size" not in template:
        out["intermediate_size"] = keys["mlp_dim"]  # unused (every layer routes): the expert width, not a default
    return out


def to_hf(keys: Mapping[str, Any], dtype: str, template: Mapping[str, Any] | None = None,
          token_ids: Mapping[str, int] | None = None) -> dict[str, Any]:
    """config.json for maxshard model keys. Fields maxshard has no key for (max_position_embeddings, token ids,
    generation settings) come from `template` (the config.json the model was converted from) when given."""
    out = {k: v for k, v in (template or {}).items() if k not in _REPLACED}
    fam = family(out) if out.get("architectures") or out.get("model_type") else family_of_keys(keys)
    _check_family(keys, fam)
    scoring = keys.get("score_head", False)
    out.update({
        "architectures": [fam.architecture.removesuffix(CAUSAL) + SCORING if scoring else fam.architecture],
        "model_type": fam.model_type,
        "vocab_size": keys["vocab_size"],
        "hidden_size": keys["emb_dim"],
        "num_hidden_layers": keys["num_layers"],
        "num_attention_heads": keys["num_heads"],
        "num_key_value_heads": keys["num_kv_heads"],
        "head_dim": keys["head_dim"],
        fam.activation_field: fam.activation,
        "rms_norm_eps": keys["norm_epsilon"],
        "rope_theta": keys["rope_max_timescale"],
        "rope_scaling": _rope_scaling(keys),
        "tie_word_embeddings": keys["logits_via_embedding"],
        "torch_dtype": dtype,
    })
    out.setdefault("max_position_embeddings", default_max_position(keys))
    out.update(fam.export)
    if fam.is_moe:
        out.update(_moe_fields(keys, fam, out))
    else:
        out["intermediate_size"] = keys["mlp_dim"]
    for field, key in fam.fields.items():
        if field == "num_nextn_predict_layers" and not keys.get(key) and out.get(field):
            continue  # a template's MTP layers that its checkpoint did not hold (from_hf `_without_absent_mtp`)
        if key == "moe_mlp_dim":  # 0: the experts are mlp_dim wide
            out[field] = keys.get(key) or keys["mlp_dim"]
            continue
        out[field] = keys[key] if keys.get(key) or field != "q_lora_rank" else None  # DeepSeek writes null
    if fam.local_global:
        out.update(hf_local_global.export_fields(keys, fam, out))
    if "rope_parameters" in out:  # per layer type (OLMo 3): the global layers' settings beside the local ones'
        out["rope_parameters"][hf_local_global.GLOBAL] = {
            "rope_type": "default", **(_rope_scaling(keys) or {}), "rope_theta": out.pop("rope_theta")}
        del out["rope_scaling"]
    if fam.linear_attention:
        out["layer_types"] = list(keys["layer_types"])
    if fam.per_layer_positions:
        out.update(hf_positions.export_fields(keys, out))
    if fam.qk_norm_field:
        out[fam.qk_norm_field] = bool(keys.get("qk_norm", False))
    if fam.per_layer_dims:
        out.update(hf_layer_dims.export_fields(keys, hf_local_global.layer_types(keys)))
    if fam.moe_block_field:
        out.update(hf_moe_block.export_fields(keys, fam.moe_block_field))
    if "partial_rotary_factor" in fam.carries:  # 4.x spelling, beside rope_theta; transformers 5 reads it too
        out["partial_rotary_factor"] = keys.get("partial_rotary_factor", 1.0)
    if scoring:  # one label, as transformers writes num_labels
        out.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    for field, value in (token_ids or {}).items():
        out.setdefault(field, value)
    return out
