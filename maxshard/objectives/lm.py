"""`objective: lm`: next-token cross-entropy, weighted by `loss_weights` (padding, prompts of chat turns weigh 0)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from maxshard.objectives import kinds

__all__ = ["LanguageModel"]


@dataclasses.dataclass(frozen=True)
class LanguageModel:
    """loss_sum = sum of -log p(target) x weight, weight_sum = sum of weights: the step's division gives the
    token-weighted mean cross-entropy."""

    kind: kinds.Kind = kinds.kind("lm")
    temperature: ClassVar[float] = 1.0

    def totals(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {}

    def sums(self, logps: jax.Array, batch: dict[str, jax.Array], totals: dict[str, jax.Array],
             reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        weights = batch["loss_weights"].astype(jnp.float32)
        loss_sum, weight_sum = jnp.sum(-logps * weights), jnp.sum(weights)
        return loss_sum, {"loss_sum": loss_sum, "weight_sum": weight_sum, "tokens": weight_sum}

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {}
