"""config.json's MoE block beside the MLP (Gemma 4's `enable_moe_block`): `moe_beside_mlp` and the routed experts'
shape, in a family whose layers are dense without it (`Family.moe_block_field`).

With the switch on, transformers' Gemma4TextDecoderLayer keeps its dense MLP (`intermediate_size`) and runs
`num_experts` experts of `moe_intermediate_size` beside it in every layer, `top_k_experts` a token, chosen by a
softmax and renormalised, with no shared expert and no capacity (maxshard: dropless). The router's own norm, its
scale and the per-expert scale of the weights come with the switch (layers/moe.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from maxshard.errors import ConfigError
from maxshard.spec.model_config import ModelConfig

__all__ = ["FIELDS", "model_keys", "wants", "export_fields"]

_MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
# config.json's fields of the block's shape: {field: model key}
FIELDS = {"num_experts": "num_experts", "top_k_experts": "num_experts_per_tok", "moe_intermediate_size": "moe_mlp_dim"}
# How transformers routes in the block, as maxshard's keys: what a model must have to be written with the switch on
_ROUTING = {"moe_router": "softmax", "moe_renormalize_top_k": True, "num_shared_experts": 0, "moe_layer_interval": 1,
            "first_k_dense_replace": 0, "moe_router_bias": False, "moe_routed_scaling_factor": 1.0, "moe_n_group": 1,
            "moe_weights_on_input": False, "moe_bias": False}


def model_keys(hf: Mapping[str, Any], switch: str) -> dict[str, Any]:
    """The keys of the block where config.json's `switch` is on ({} where it is off); a ConfigError naming the
    field of a shape maxshard cannot take."""
    if not hf.get(switch):
        return {}
    experts, k, width = (hf.get(field) for field in FIELDS)
    if not isinstance(experts, int) or experts < 2:
        raise _refuse("num_experts", experts, f"{switch}=true needs >= 2 experts")
    if not isinstance(k, int) or not 1 <= k <= experts:
        raise _refuse("top_k_experts", k, f"needs 1..{experts}")
    if not isinstance(width, int) or width < 1:
        raise _refuse("moe_intermediate_size", width, "needs a positive integer")
    return {"moe_beside_mlp": True, "num_experts": experts, "num_experts_per_tok": k, "moe_mlp_dim": width,
            "capacity_factor": -1.0, **{key: value for key, value in _ROUTING.items() if key != "moe_bias"}}


def wants(keys: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (the model's value, the value the block needs)} for a model written with the switch on."""
    return {key: (keys.get(key, defaults[key]), value) for key, value in _ROUTING.items()}


def export_fields(keys: Mapping[str, Any], switch: str) -> dict[str, Any]:
    """The switch and, where it is on, the block's shape, read off the keys' network (its expert width included)."""
    model = ModelConfig(**{k: v for k, v in keys.items() if k in _MODEL_FIELDS})
    if not model.moe_beside_mlp:
        return {switch: False}
    return {switch: True, "num_experts": model.num_experts, "top_k_experts": model.num_experts_per_tok,
            "moe_intermediate_size": model.expert_dim}


def _refuse(field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"config.json: {field}={json.dumps(value)} is not supported: {why}")
