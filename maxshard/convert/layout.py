"""maxshard's parameter tree for given model keys, each leaf paired with its row of the name table.

The shapes come from `model.abstract_params` (jax.eval_shape of the real init), so the converter writes exactly the
tree that `Transformer` builds and `load_parameters` checks, and a change to the model cannot drift from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from maxshard import model
from maxshard.config import ConfigError
from maxshard.convert import names
from maxshard.model_config import ModelConfig

__all__ = ["MODEL_KEYS", "model_config", "Param", "params_of"]

MODEL_KEYS = ("vocab_size", "emb_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
              "max_target_length", "logits_via_embedding", "norm_epsilon", "rope_max_timescale", "rope_scaling_type",
              "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position")
_STACK = ("decoder", "layers")


def model_config(keys: Mapping[str, Any]) -> ModelConfig:
    """The network of these model keys (scanned layers, no pipeline, every other field at its default): all the
    converter needs to know the parameter tree, with no run, mesh or devices."""
    if keys.get("num_experts", 1) != 1:
        raise ConfigError(f"num_experts={keys['num_experts']}: Llama and Mistral are dense; MoE models do not convert")
    return ModelConfig(**{k: keys[k] for k in MODEL_KEYS if k in keys}, scan_layers=True)


@dataclasses.dataclass(frozen=True)
class Param:
    """One maxshard parameter: its path, shape (stacked [layers, ...] when `stacked`) and the table row."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    entry: names.Entry
    stacked: bool

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The shape of one layer's slice (the whole shape for a global parameter)."""
        return self.shape[1:] if self.stacked else self.shape


def _key(entry: Any) -> str:
    return str(getattr(entry, "key", entry))


def params_of(cfg: ModelConfig) -> list[Param]:
    """Every parameter of the model in tree order; a leaf the table does not know is a bug, so it raises."""
    by_path = {e.path: e for e in (*names.GLOBAL, names.HEAD)}
    per_layer = {e.path: e for e in names.PER_LAYER}
    leaves, _ = jax.tree_util.tree_flatten_with_path(nn.unbox(model.abstract_params(cfg)))
    out = []
    for key_path, leaf in leaves:
        path = tuple(_key(k) for k in key_path)
        stacked = path[:2] == _STACK
        entry = per_layer.get(path[2:]) if stacked else by_path.get(path)
        if entry is None:
            raise RuntimeError(f"maxshard.convert has no Hugging Face name for parameter {'/'.join(path)}")
        out.append(Param(path, tuple(leaf.shape), entry, stacked))
    return out
