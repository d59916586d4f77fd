"""A reward model trained on preference pairs (TRL's RewardTrainer): the Bradley-Terry loss on one score per reply.

The model ends in a score head (`score_head`: one float32 score per token), and the step hands the objective those
scores [batch, length] where the others get log-probabilities. Rows hold pairs as for DPO (`kinds.py`): pair p of a
row is segments 2p - 1 (prompt + chosen) and 2p (prompt + rejected), weight 1 on reply targets. A reply's reward is
its score at the last position with a reply target (whose input is the reply's last token, the target its EOS):
the token TRL scores, the last that is not padding, when the pad id is the EOS.

    loss = -log sigmoid(r_chosen - r_rejected), a mean over counted pairs (no margin, no centring)

Reported as TRL logs them: rewards/accuracy (r_chosen > r_rejected), rewards/margin, and the mean rewards.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from maxshard.objectives import kinds
from maxshard.objectives.preference import pairs_of
from maxshard.objectives.segments import halves

__all__ = ["RewardModel", "last_reply_position"]

Batch = dict[str, jax.Array]


def last_reply_position(batch: Batch) -> jax.Array:
    """1.0 [batch, length] at each segment's last position with a reply target, 0 elsewhere."""
    weights = batch["loss_weights"].astype(jnp.float32)
    segments = batch["segment_ids"]
    follows = jnp.pad((segments[:, 1:] == segments[:, :-1]).astype(jnp.float32), ((0, 0), (0, 1)))
    next_weight = jnp.pad(weights[:, 1:], ((0, 0), (0, 1)))
    return weights * (1.0 - next_weight * follows)


@dataclasses.dataclass(frozen=True)
class RewardModel:
    """Bradley-Terry on the scores of each pair's replies (module docstring)."""

    kind: kinds.Kind = kinds.kind("reward_model")
    temperature: ClassVar[float] = 1.0

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        return {}

    def sums(self, scores: jax.Array, batch: Batch, totals: dict[str, jax.Array],
             reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        pairs = pairs_of(jnp.zeros_like(scores), batch)
        counted = pairs.counted
        chosen, rejected = halves(scores * last_reply_position(batch), batch["segment_ids"])
        loss = -jax.nn.log_sigmoid(chosen - rejected)
        total = lambda x: jnp.sum(x * counted)  # noqa: E731 - a one-line reduction
        sums = {"loss_sum": total(loss), "weight_sum": jnp.sum(counted),
                "tokens": jnp.sum(pairs.chosen_tokens + pairs.rejected_tokens), "rewards_chosen": total(chosen),
                "rewards_rejected": total(rejected), "rewards_correct": total((chosen > rejected).astype(jnp.float32))}
        return sums["loss_sum"], sums

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        pairs = jnp.maximum(sums["weight_sum"], 1.0)
        chosen, rejected = sums["rewards_chosen"] / pairs, sums["rewards_rejected"] / pairs
        return {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/mean": (chosen + rejected) / 2,
                "rewards/accuracy": sums["rewards_correct"] / pairs, "rewards/margin": chosen - rejected}
