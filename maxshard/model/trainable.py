"""Which parameters train: every one, or with LoRA (`lora_rank` > 0) only the adapters.

The one place that answers it. The train step takes gradients of the trainable subset alone (the frozen base
enters the loss as a constant, so XLA computes no weight gradient for it), the optimizer holds moments for that
subset alone, checkpoints save that subset with the optimizer (the base is read again from `load_parameters_path`),
and the planner counts gradients and optimizer state for it alone.

Parameters are nested dicts (flax's params collection); a subset is the same nesting with only its leaves.
"""

from __future__ import annotations

from typing import Any

from flax import traverse_util

from maxshard.model.config import ModelConfig
from maxshard.model.layers.lora import ADAPTER_PARAMS

__all__ = ["trains_everything", "is_trainable", "split", "merge", "trainable_subset", "frozen_subset",
           "without_adapters"]


def trains_everything(model: ModelConfig) -> bool:
    return model.lora_rank == 0


def is_trainable(model: ModelConfig, name: str) -> bool:
    """True for a parameter, named by its path with "/" or "." between keys ("params/decoder/.../query/lora_a"),
    that trains."""
    return trains_everything(model) or name.replace(".", "/").split("/")[-1] in ADAPTER_PARAMS


def split(params: Any, model: ModelConfig) -> tuple[Any, Any]:
    """(trainable, frozen): two nested dicts that `merge` joins again; frozen is {} when everything trains."""
    if trains_everything(model):
        return params, {}
    flat = traverse_util.flatten_dict(params)
    trainable = {k: v for k, v in flat.items() if k[-1] in ADAPTER_PARAMS}
    frozen = {k: v for k, v in flat.items() if k[-1] not in ADAPTER_PARAMS}
    return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def merge(trainable: Any, frozen: Any) -> Any:
    """The whole parameter tree from its two parts."""
    if not frozen:
        return trainable
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(frozen), **traverse_util.flatten_dict(trainable)})


def trainable_subset(params: Any, model: ModelConfig) -> Any:
    return split(params, model)[0]


def frozen_subset(params: Any, model: ModelConfig) -> Any:
    return split(params, model)[1]


def without_adapters(params: Any) -> Any:
    """The same tree with every LoRA `lora_b` zero: the base model, as it was before the adapters trained (a fresh
    adapter's B is zero, layers/lora.py). DPO's `lora_base` reference, with no second copy of the base."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: v * 0 if k[-1] == ADAPTER_PARAMS[1] else v for k, v in flat.items()})
