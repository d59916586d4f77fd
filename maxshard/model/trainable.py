"""Which parameters train: every one, or with LoRA (`lora_rank` > 0) only the adapters; never the parameters the
train step itself moves (MoE's selection bias, `router_bias`: layers/moe.py) or the fixed ones (Gemma 4's
`layer_scalar`).

The one place that answers it. The train step takes gradients of the trainable subset alone (the frozen rest
enters the loss as a constant, so XLA computes no weight gradient for it), the optimizer holds moments for that
subset alone, and the planner counts gradients and optimizer state for it alone. Checkpoints save `saved_subset`:
every parameter, or with LoRA the adapters and the moved parameters (the base is read again from
`load_parameters_path`, and a moved bias is no longer the base's).

Parameters are nested dicts (flax's params collection); a subset is the same nesting with only its leaves.
"""

from __future__ import annotations

from typing import Any

from flax import traverse_util

from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers.lora import ADAPTER_PARAMS
from maxshard.model.layers.moe import BIAS_PARAM
from maxshard.model.layers.per_layer_inputs import LAYER_SCALAR

__all__ = ["MOVED_PARAMS", "FIXED_PARAMS", "trains_everything", "is_trainable", "split", "merge", "trainable_subset",
           "frozen_subset", "saved_subset", "without_adapters"]

# Parameters no gradient or optimizer touches: the train step moves them itself (`moe.move_bias`).
MOVED_PARAMS = (BIAS_PARAM,)
# Parameters nothing moves: constants a checkpoint carries (Gemma 4's per-layer output scalar, a buffer in
# transformers), held as they were loaded or initialised.
FIXED_PARAMS = (LAYER_SCALAR,)


def trains_everything(model: ModelConfig) -> bool:
    """No LoRA: every parameter but the moved ones trains, and checkpoints hold the whole model."""
    return model.lora_rank == 0


def _trains(model: ModelConfig, last: str) -> bool:
    return last not in MOVED_PARAMS + FIXED_PARAMS and (trains_everything(model) or last in ADAPTER_PARAMS)


def is_trainable(model: ModelConfig, name: str) -> bool:
    """True for a parameter, named by its path with "/" or "." between keys ("params/decoder/.../query/lora_a"),
    that trains."""
    return _trains(model, name.replace(".", "/").split("/")[-1])


def _partition(params: Any, keep: Any) -> tuple[Any, Any]:
    flat = traverse_util.flatten_dict(params)
    inside = {k: v for k, v in flat.items() if keep(k[-1])}
    outside = {k: v for k, v in flat.items() if not keep(k[-1])}
    return traverse_util.unflatten_dict(inside), traverse_util.unflatten_dict(outside)


def split(params: Any, model: ModelConfig) -> tuple[Any, Any]:
    """(trainable, frozen): two nested dicts that `merge` joins again; frozen is {} when everything trains."""
    if trains_everything(model) and not (model.moe_router_bias or model.layer_scalar):  # nothing frozen: as it is
        return params, {}
    return _partition(params, lambda last: _trains(model, last))


def merge(trainable: Any, frozen: Any) -> Any:
    """The whole parameter tree from its two parts (where both hold a leaf, `trainable`'s wins)."""
    if not frozen:
        return trainable
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(frozen), **traverse_util.flatten_dict(trainable)})


def trainable_subset(params: Any, model: ModelConfig) -> Any:
    return split(params, model)[0]


def frozen_subset(params: Any, model: ModelConfig) -> Any:
    """What does not train: LoRA's base (which `load_parameters_path` holds) and the moved parameters."""
    return split(params, model)[1]


def saved_subset(params: Any, model: ModelConfig) -> Any:
    """What a checkpoint holds of `params`: all of them, or with LoRA the adapters and the moved parameters."""
    if trains_everything(model):
        return params
    return _partition(params, lambda last: last in ADAPTER_PARAMS or last in MOVED_PARAMS)[0]


def without_adapters(params: Any) -> Any:
    """The same tree with every LoRA `lora_b` zero: the base model, as it was before the adapters trained (a fresh
    adapter's B is zero, layers/lora.py). DPO's `lora_base` reference, with no second copy of the base."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: v * 0 if k[-1] == ADAPTER_PARAMS[1] else v for k, v in flat.items()})
