"""The optimizer: warmup + cosine schedule, global-norm clipping, AdamW without decay on gains and biases."""

from __future__ import annotations

from typing import Any

import jax
import optax

from maxshard.config import Config
from maxshard.model.layers.moe import EXPERT_SCALE
from maxshard.parallel.sharding import path_name

__all__ = ["learning_rate_schedule", "decay_mask", "make_optimizer"]

# Gains (norm scales, Gemma 4's per-expert scale of the router weights: decay would pull a multiplier to 0) and biases
_NO_DECAY = ("scale", EXPERT_SCALE, "bias")


def learning_rate_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup from 0 to `learning_rate`, then cosine decay to `cosine_final_fraction` of it."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.schedule_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.cosine_final_fraction,
    )


def decay_mask(params: Any) -> Any:
    """True for parameters that get weight decay: every kernel and embedding, not gains or biases."""

    def decays(path: tuple, _: Any) -> bool:
        return not any(part in _NO_DECAY for part in path_name(path).split("/"))

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate_schedule(cfg),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    return adamw
