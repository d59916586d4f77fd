"""config.json's per-layer head shapes (Gemma 4): maxshard's attention layers share one head_dim and one number of
key/value heads, so a checkpoint whose full-attention layers have others is refused with the field that says so.

transformers' Gemma4TextConfig gives the full-attention layers `global_head_dim` (512 when the file has no such
field) and `num_global_key_value_heads` (with `attention_k_eq_v`), unless the file carries `per_layer_config`, which
then says each layer's overrides by index and wins; transformers writes that field on save.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from maxshard.errors import ConfigError

__all__ = ["GLOBAL_HEAD_DIM_DEFAULT", "check", "export_fields"]

GLOBAL_HEAD_DIM_DEFAULT = 512  # Gemma4TextConfig's global_head_dim when config.json has neither field


def check(hf: Mapping[str, Any]) -> None:
    """A ConfigError naming the field whose per-layer head shape differs from head_dim / num_key_value_heads."""
    head_dim, kv_heads = hf["head_dim"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    overrides = hf.get("per_layer_config")
    if overrides is None:
        wanted = {"global_head_dim": (hf.get("global_head_dim", GLOBAL_HEAD_DIM_DEFAULT), head_dim)}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            wanted["num_global_key_value_heads"] = (hf["num_global_key_value_heads"], kv_heads)
        for field, (value, need) in wanted.items():
            if value != need:
                raise _refuse(field, value, f"maxshard's layers share one shape (needs {need}, as the others)")
        return
    if not isinstance(overrides, Mapping):
        raise _refuse("per_layer_config", overrides, "needs a mapping of layer index to overrides")
    for layer, fields in overrides.items():
        for field, need in (("head_dim", head_dim), ("num_key_value_heads", kv_heads)):
            if field in fields and fields[field] != need:
                raise _refuse(f"per_layer_config.{layer}.{field}", fields[field],
                              f"maxshard's layers share one shape ({field} {need})")
        unknown = sorted(set(fields) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise _refuse(f"per_layer_config.{layer}", unknown, "maxshard converts head_dim and "
                          "num_key_value_heads overrides equal to the model's")


def export_fields() -> dict[str, Any]:
    """What to_hf writes so that transformers gives every layer the one shape: no overrides (without the field it
    would give the full layers GLOBAL_HEAD_DIM_DEFAULT)."""
    return {"per_layer_config": {}}


def _refuse(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={json.dumps(value)} is not supported: {why}")
