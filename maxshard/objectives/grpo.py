"""`objective: grpo`: group relative policy optimisation on completions sampled from the model itself.

Each prompt is answered `grpo_group_size` times by the current parameters (`generation/rollouts.py`), each answer
rewarded, and its advantage is its reward against its group's: A = (r - mean) / (std + 1e-4), std unbiased (TRL's
`scale_rewards: group`). A batch row holds one completion after its prompt (segment 1); per completion token t:

    ratio_t  = exp(log p_t - old log p_t)                    old: the policy that sampled it (the rollout)
    pg_t     = -min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps) A)
    kl_t     = exp(ref_t - log p_t) - (ref_t - log p_t) - 1  k3, an estimate of KL(policy || reference) >= 0
    loss     = the per-token losses pg_t + beta kl_t made one by `grpo_loss_type`, as TRL's `loss_type` of the name:
        grpo     mean over completions of (sum_t / the completion's tokens)    (maxshard's default; TRL's `grpo`)
        dapo     sum over all completion tokens / their number                 (TRL 1.16's default)
        dr_grpo  sum over all completion tokens / (completions x grpo_max_new_tokens)   (no length bias)

All three are one global sum over one global count (loss_sum / weight_sum), so no layout and no gradient
accumulation changes them. TRL's `bnpo` divides by the tokens of one device's batch, a layout's quantity: over the
whole batch it is `dapo`, so it is not a name of its own here.

With one update per rollout the ratio is 1 and pg is -A per token; with `grpo_updates_per_rollout` > 1 the later
updates see the ratio move and clip. `grpo_kl_beta` 0 keeps no reference. A completion is found from its segment in
its row, as preference pairs are, so its sums never depend on another row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from maxshard.objectives import kinds
from maxshard.objectives.segments import segment_sums

__all__ = ["GRPO"]

Batch = dict[str, jax.Array]


def _per_sequence(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """[batch, length] -> sums per completion (segment) [batch, length]."""
    return segment_sums(values, segment_ids, values.shape[1])


@dataclasses.dataclass(frozen=True)
class GRPO:
    """The GRPO loss on a batch of rollouts (module docstring)."""

    epsilon: float
    kl_beta: float
    loss_type: str = "grpo"  # kinds.GRPO_LOSS_TYPES
    max_new_tokens: int = 1  # dr_grpo's constant length
    kind: kinds.Kind = kinds.kind("grpo")

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        return {}

    def sums(self, logps: jax.Array, batch: Batch, totals: dict[str, jax.Array],
             reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        mask = batch["loss_weights"].astype(jnp.float32)
        advantages, old = batch["advantages"], batch["old_logps"]
        ratio = jnp.exp(logps - old)
        clipped = jnp.clip(ratio, 1.0 - self.epsilon, 1.0 + self.epsilon)
        token_loss = -jnp.minimum(ratio * advantages, clipped * advantages)
        kl = jnp.zeros_like(logps)
        if reference is not None:
            kl = jnp.exp(reference - logps) - (reference - logps) - 1.0
            token_loss = token_loss + self.kl_beta * kl
        tokens = _per_sequence(mask, batch["segment_ids"])  # [batch, sequences]
        counted = (tokens > 0).astype(jnp.float32)
        sequences = jnp.sum(counted)
        if self.loss_type == "grpo":
            per_sequence = _per_sequence(token_loss * mask, batch["segment_ids"]) / jnp.maximum(tokens, 1.0)
            loss_sum, weight_sum = jnp.sum(per_sequence * counted), sequences
        elif self.loss_type == "dapo":
            loss_sum, weight_sum = jnp.sum(token_loss * mask), jnp.sum(mask)
        elif self.loss_type == "dr_grpo":
            loss_sum, weight_sum = jnp.sum(token_loss * mask) / self.max_new_tokens, sequences
        else:
            raise ValueError(f"grpo_loss_type={self.loss_type}: one of {', '.join(kinds.GRPO_LOSS_TYPES)}")
        low, high = ratio < 1.0 - self.epsilon, ratio > 1.0 + self.epsilon
        was_clipped = (low & (advantages < 0)) | (high & (advantages > 0))  # where the clip stops the gradient
        return loss_sum, {
            "loss_sum": loss_sum,
            "weight_sum": weight_sum,
            "sequences": sequences,
            "tokens": jnp.sum(mask),
            "kl": jnp.sum(kl * mask),
            "clipped": jnp.sum(was_clipped * mask),
        }

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        tokens = jnp.maximum(sums["tokens"], 1.0)
        return {"kl": sums["kl"] / tokens, "clip_fraction": sums["clipped"] / tokens,
                "completion_length": sums["tokens"] / jnp.maximum(sums["sequences"], 1.0)}
