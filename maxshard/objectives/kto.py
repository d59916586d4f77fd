"""`objective: kto`: Kahneman-Tversky optimisation on unpaired completions, as TRL's `KTOTrainer` (loss_type kto).

A batch row holds whole examples (`kinds.py`, rows "unpaired"): example e is segments 2e - 1 (its prompt and
completion) and 2e (its prompt with another record's completion: the KL sequence), each shifted by one. The
completion's targets weigh its label, +1 desirable or -1 undesirable; the KL completion's weigh 1; prompts 0:

    segment_ids   1 1 1 1 | 2 2 2 | 3 3 3 | 4 4 4 4 4     example 1 = segments 1, 2; example 2 = segments 3, 4
    loss_weights  0 0 1 1 | 0 0 1 | 0 0 -1 -1 | 0 0 1 1 1  example 1 desirable, example 2 undesirable

With r the summed log-probability of an example's completion minus the reference's, and z0 the KL reference point,
the mean over the microbatch's examples of (KL completion's log-probability - the reference's), clamped at 0 and
without gradient (TRL's `kl`, per forward pass as TRL's is):

    desirable     loss = desirable_weight   (1 - sigmoid(beta (r - z0)))
    undesirable   loss = undesirable_weight (1 - sigmoid(beta (z0 - r)))

The loss is the mean over examples (weight_sum = examples, as TRL's `losses.nanmean()` over the batch). Rewards
(reported, as TRL logs them): beta r, averaged over the desirable examples (rewards/chosen) and the undesirable
ones (rewards/rejected); logps/chosen, logps/rejected the summed completion log-probabilities likewise; kl the mean
of the microbatches' z0. The KL completions take no loss; their log-probabilities only place z0.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from maxshard.objectives import kinds
from maxshard.objectives.segments import halves

__all__ = ["KTO"]

Batch = dict[str, jax.Array]


def _examples(logps: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """(summed completion log-probabilities, summed KL completion log-probabilities) [batch, slots]."""
    weights = jnp.abs(batch["loss_weights"].astype(jnp.float32))
    return halves(logps * weights, batch["segment_ids"])


@dataclasses.dataclass(frozen=True)
class KTO:
    """KTO's loss against a reference model's log-probabilities (module docstring)."""

    beta: float
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    kind: kinds.Kind = kinds.kind("kto")
    temperature: ClassVar[float] = 1.0

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        return {}

    def sums(self, logps: jax.Array, batch: Batch, totals: dict[str, jax.Array],
             reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        assert reference is not None, "KTO needs the reference model's log-probabilities"
        weights = batch["loss_weights"].astype(jnp.float32)
        signed, kl_tokens = halves(weights, batch["segment_ids"])  # label x completion targets; KL targets
        tokens = halves(jnp.abs(weights), batch["segment_ids"])[0]
        counted = ((tokens > 0) & (kl_tokens > 0)).astype(jnp.float32)
        desirable = (signed > 0).astype(jnp.float32) * counted
        undesirable = counted - desirable
        (policy, policy_kl), (ref, ref_kl) = _examples(logps, batch), _examples(reference, batch)
        examples = jnp.sum(counted)
        z0 = jax.lax.stop_gradient(jnp.maximum(jnp.sum((policy_kl - ref_kl) * counted) / jnp.maximum(examples, 1.0),
                                               0.0))
        ratio = policy - ref
        loss = (self.desirable_weight * desirable * (1.0 - jax.nn.sigmoid(self.beta * (ratio - z0)))
                + self.undesirable_weight * undesirable * (1.0 - jax.nn.sigmoid(self.beta * (z0 - ratio))))
        rewards = self.beta * jax.lax.stop_gradient(ratio)
        sums = {
            "loss_sum": jnp.sum(loss),
            "weight_sum": examples,
            "tokens": jnp.sum(tokens + kl_tokens),
            "desirable": jnp.sum(desirable),
            "undesirable": jnp.sum(undesirable),
            "rewards_chosen": jnp.sum(rewards * desirable),
            "rewards_rejected": jnp.sum(rewards * undesirable),
            "logps_chosen": jnp.sum(policy * desirable),
            "logps_rejected": jnp.sum(policy * undesirable),
            "kl": z0,
            "kl_passes": jnp.ones((), jnp.float32),  # microbatches: kl is their mean
        }
        return sums["loss_sum"], sums

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        chosen, rejected = jnp.maximum(sums["desirable"], 1.0), jnp.maximum(sums["undesirable"], 1.0)
        return {
            "rewards/chosen": sums["rewards_chosen"] / chosen,
            "rewards/rejected": sums["rewards_rejected"] / rejected,
            "rewards/margin": sums["rewards_chosen"] / chosen - sums["rewards_rejected"] / rejected,
            "logps/chosen": sums["logps_chosen"] / chosen,
            "logps/rejected": sums["logps_rejected"] / rejected,
            "kl": sums["kl"] / jnp.maximum(sums["kl_passes"], 1.0),
        }
