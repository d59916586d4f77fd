"""`objective: grpo`: group relative policy optimisation on completions sampled from the model itself, as TRL 1.16's
GRPOTrainer computes it (its defaults are maxshard's).

Each prompt is answered `grpo_group_size` times by the current parameters (`generation/rollouts.py`), each answer
rewarded, and its advantage is its reward against its group's: A = (r - mean) / (std + 1e-4), std unbiased (TRL's
`scale_rewards: group`). A batch row holds one completion after its prompt (segment 1). Every log-probability here,
the policy's, the rollout policy's (`old`) and the reference's, is of the logits divided by `grpo_temperature`, the
distribution the rollouts were sampled from (`temperature` below: the train step applies it, `Trainer._head`). Per
completion token t:

    ratio_t  = exp(log p_t - old log p_t)                     grpo_importance_sampling: token (TRL's default)
             = exp(mean over the completion of that)          sequence: one ratio per completion (GSPO)
    pg_t     = -min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps_high) A)    eps_high: grpo_epsilon_high (DAPO)
    kl_t     = exp(ref_t - log p_t) - (ref_t - log p_t) - 1   k3, an estimate of KL(policy || reference) >= 0
               x ratio_t                                      grpo_kl_estimator: bias_corrected (TRL's default
                                                              use_bias_correction_kl; its gradient flows through
                                                              the ratio too), k3: without
    loss     = the per-token losses pg_t + beta kl_t made one by `grpo_loss_type`, as TRL's `loss_type` of the name:
        dapo     sum over all completion tokens / their number                 (TRL 1.16's default)
        grpo     mean over completions of (sum_t / the completion's tokens)
        dr_grpo  sum over all completion tokens / (completions x grpo_max_new_tokens x grpo_max_turns)
                 (no length bias; a multi-turn completion is every model turn of its episode)

All three are one global sum over one global count (loss_sum / weight_sum), so no layout and no gradient
accumulation changes them. TRL's `bnpo` divides by the tokens of one device's batch, a layout's quantity: over the
whole batch it is `dapo`, so it is not a name of its own here.

With one update per rollout the ratio is 1 and pg is -A per token; with `grpo_updates_per_rollout` > 1 the later
updates see the ratio move and clip. `grpo_kl_beta` 0 keeps no reference. A completion is found from its segment in
its row, as preference pairs are, so its sums never depend on another row. The clip fraction counts tokens, or
completions with the sequence ratio, as TRL's `clip_ratio/region_mean`.
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


def _on_tokens(per_sequence: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """[batch, sequences] -> [batch, length]: each token gets its completion's value (padding: the first's, which
    its zero weight drops)."""
    return jnp.take_along_axis(per_sequence, jnp.maximum(segment_ids - 1, 0), axis=1)


@dataclasses.dataclass(frozen=True)
class GRPO:
    """The GRPO loss on a batch of rollouts (module docstring)."""

    epsilon: float
    kl_beta: float
    loss_type: str = "dapo"  # kinds.GRPO_LOSS_TYPES
    max_new_tokens: int = 1  # dr_grpo's constant length (an episode's: every turn's new tokens)
    epsilon_high: float = 0.0  # the clip's upper side; 0: epsilon
    kl_estimator: str = "bias_corrected"  # kinds.GRPO_KL_ESTIMATORS
    importance_sampling: str = "token"  # kinds.GRPO_IMPORTANCE_SAMPLING
    temperature: float = 1.0  # the logits' divisor for every log-probability the loss reads
    kind: kinds.Kind = kinds.kind("grpo")

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        return {}

    def _log_ratio(self, logps: jax.Array, old: jax.Array, mask: jax.Array, segment_ids: jax.Array,
                   tokens: jax.Array) -> jax.Array:
        """log(ratio) on every token: its own, or its completion's mean (sequence)."""
        log_ratio = logps - old
        if self.importance_sampling == "token":
            return log_ratio
        per_sequence = _per_sequence(log_ratio * mask, segment_ids) / jnp.maximum(tokens, 1.0)
        return _on_tokens(per_sequence, segment_ids)

    def sums(self, logps: jax.Array, batch: Batch, totals: dict[str, jax.Array],
             reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        mask, segment_ids = batch["loss_weights"].astype(jnp.float32), batch["segment_ids"]
        advantages = batch["advantages"]
        tokens = _per_sequence(mask, segment_ids)  # [batch, sequences]
        ratio = jnp.exp(self._log_ratio(logps, batch["old_logps"], mask, segment_ids, tokens))
        low, high = 1.0 - self.epsilon, 1.0 + (self.epsilon_high or self.epsilon)
        token_loss = -jnp.minimum(ratio * advantages, jnp.clip(ratio, low, high) * advantages)
        kl = jnp.zeros_like(logps)
        if reference is not None:
            kl = jnp.exp(reference - logps) - (reference - logps) - 1.0
            if self.kl_estimator == "bias_corrected":
                kl = kl * ratio
            token_loss = token_loss + self.kl_beta * kl
        counted = (tokens > 0).astype(jnp.float32)
        sequences = jnp.sum(counted)
        loss_sum, weight_sum = self._reduce(token_loss * mask, segment_ids, tokens, counted, sequences, mask)
        was_clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))  # no gradient there
        clipped = jnp.sum(was_clipped * mask)
        if self.importance_sampling == "sequence":  # one ratio a completion: count completions, as TRL does
            clipped = jnp.sum(_per_sequence(was_clipped * mask, segment_ids) / jnp.maximum(tokens, 1.0))
        return loss_sum, {
            "loss_sum": loss_sum,
            "weight_sum": weight_sum,
            "sequences": sequences,
            "tokens": jnp.sum(mask),
            "kl": jnp.sum(kl * mask),
            "clipped": clipped,
        }

    def _reduce(self, token_loss: jax.Array, segment_ids: jax.Array, tokens: jax.Array, counted: jax.Array,
                sequences: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(loss_sum, weight_sum) of the masked per-token losses by `loss_type` (module docstring)."""
        if self.loss_type == "grpo":
            per_sequence = _per_sequence(token_loss, segment_ids) / jnp.maximum(tokens, 1.0)
            return jnp.sum(per_sequence * counted), sequences
        if self.loss_type == "dapo":
            return jnp.sum(token_loss), jnp.sum(mask)
        if self.loss_type == "dr_grpo":
            return jnp.sum(token_loss) / self.max_new_tokens, sequences
        raise ValueError(f"grpo_loss_type={self.loss_type}: one of {', '.join(kinds.GRPO_LOSS_TYPES)}")

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        tokens = jnp.maximum(sums["tokens"], 1.0)
        clip_units = sums["sequences"] if self.importance_sampling == "sequence" else sums["tokens"]
        return {"kl": sums["kl"] / tokens, "clip_fraction": sums["clipped"] / jnp.maximum(clip_units, 1.0),
                "completion_length": sums["tokens"] / jnp.maximum(sums["sequences"], 1.0)}
