"""config.json's per-layer shapes (Gemma 4): the full-attention layers may have a head width and key/value heads of
their own, which become `global_head_dim` and `global_num_kv_heads`, values that are their key projection
(`attention_k_eq_v`: `global_values_from_keys`), and the KV-shared layers an MLP twice as wide
(`use_double_wide_mlp`: `kv_shared_mlp_dim`) (spec/blocks.py `layer_config`).

transformers' Gemma4TextConfig gives the full-attention layers `global_head_dim` (512 when the file has no such
field) and, with `attention_k_eq_v`, `num_global_key_value_heads`, unless the file carries `per_layer_config`,
which then says each layer's overrides by index and wins; transformers writes that field on save. maxshard's
layers take one shape for the sliding layers and one for the full ones, so overrides are accepted where every full
layer has the same ones and no sliding layer has any; anything else is refused with the field that says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from maxshard.convert.hf_local_global import GLOBAL
from maxshard.errors import ConfigError

__all__ = ["GLOBAL_HEAD_DIM_DEFAULT", "model_keys", "export_fields"]

GLOBAL_HEAD_DIM_DEFAULT = 512  # Gemma4TextConfig's global_head_dim when config.json has neither field
_SHAPES = {"head_dim": "global_head_dim", "num_key_value_heads": "global_num_kv_heads"}


def model_keys(hf: Mapping[str, Any], types: Sequence[str]) -> dict[str, Any]:
    """global_head_dim and global_num_kv_heads where the full layers (`types`: each layer's type) have another head
    shape than head_dim / num_key_value_heads; a ConfigError naming the field a shape maxshard cannot take."""
    head_dim, kv_heads = hf["head_dim"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    overrides = hf.get("per_layer_config")
    if overrides is None:
        shape = {"head_dim": hf.get("global_head_dim", GLOBAL_HEAD_DIM_DEFAULT)}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            shape["num_key_value_heads"] = hf["num_global_key_value_heads"]
    else:
        shape = _full_layers_shape(overrides, types)
    base = {"head_dim": head_dim, "num_key_value_heads": kv_heads}
    keys = {_SHAPES[field]: value for field, value in shape.items() if value != base[field]}
    if hf.get("use_double_wide_mlp") and hf.get("num_kv_shared_layers"):  # transformers widens only shared layers
        keys["kv_shared_mlp_dim"] = 2 * hf["intermediate_size"]
    if hf.get("attention_k_eq_v"):  # the full layers' values are their key projection (no v_proj)
        keys["global_values_from_keys"] = True
    return keys


def _full_layers_shape(overrides: Any, types: Sequence[str]) -> dict[str, Any]:
    """The one set of overrides every full layer has in per_layer_config ({} for none)."""
    if not isinstance(overrides, Mapping):
        raise _refuse("per_layer_config", overrides, "needs a mapping of layer index to overrides")
    shapes = set()
    for i, kind in enumerate(types):
        fields = overrides.get(str(i), overrides.get(i, {}))
        unknown = sorted(set(fields) - set(_SHAPES))
        if unknown:
            raise _refuse(f"per_layer_config.{i}", unknown, f"maxshard converts {' and '.join(_SHAPES)} overrides")
        if kind != GLOBAL and fields:
            raise _refuse(f"per_layer_config.{i}", fields, f"maxshard's {kind} layers share the model's head shape")
        if kind == GLOBAL:
            shapes.add(json.dumps(fields, sort_keys=True))
    extra = sorted(set(map(str, overrides)) - {str(i) for i in range(len(types))})
    if extra:
        raise _refuse("per_layer_config", extra, f"layer indices past num_hidden_layers={len(types)}")
    if len(shapes) > 1:
        raise ConfigError(f"config.json: per_layer_config gives the {GLOBAL} layers {len(shapes)} head shapes "
                          f"({' and '.join(sorted(shapes))}): maxshard's {GLOBAL} layers share one")
    return json.loads(shapes.pop()) if shapes else {}


def export_fields(keys: Mapping[str, Any], types: Sequence[str]) -> dict[str, Any]:
    """per_layer_config as transformers writes it: the full layers' (`types`) own head shape where the model has
    one, else {} (without the field transformers would give the full layers GLOBAL_HEAD_DIM_DEFAULT); and
    use_double_wide_mlp, the one KV-shared MLP width Gemma 4's config.json can say besides mlp_dim."""
    shape = {field: keys[key] for field, key in _SHAPES.items() if keys.get(key)}
    wide = keys.get("kv_shared_mlp_dim", 0)
    if wide not in (0, 2 * keys["mlp_dim"]):
        raise ConfigError(f"kv_shared_mlp_dim={wide}: Gemma 4's config.json can give the KV-shared layers mlp_dim or "
                          f"twice it ({2 * keys['mlp_dim']}, use_double_wide_mlp), nothing else")
    return {"per_layer_config": {str(i): dict(shape) for i, kind in enumerate(types) if kind == GLOBAL and shape},
            "use_double_wide_mlp": bool(wide), "attention_k_eq_v": bool(keys.get("global_values_from_keys"))}


def _refuse(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={json.dumps(value)} is not supported: {why}")
