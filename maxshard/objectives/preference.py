"""Preference objectives on pairs of replies to one prompt: DPO, SimPO and ORPO, as TRL defines them.

A batch row holds whole pairs (`kinds.py`): pair p is segments 2p - 1 (chosen) and 2p (rejected), and only reply
targets weigh 1. Each pair's log-probability is the sum over its reply tokens (`Pairs`), computed row by row, so a
pair never depends on another row and gradient accumulation, which splits the batch by rows, keeps pairs whole.
Worked example, one row of 12 targets holding two pairs (prompt P, chosen C, rejected R; weight 1 on C and R):

    segment_ids   1 1 1 | 2 2 2 2 | 3 3 | 4 4 4        pair 1 = segments 1, 2; pair 2 = segments 3, 4
    targets       P C C | P R R R | C C | R R R        chosen[1] = log p of its 2 C targets, rejected[1] of 3 R

A pair counts only when both halves have a reply target (padding segments and empty slots have none). Losses are
means over counted pairs (weight_sum = pairs), as TRL's are over a batch; ORPO's cross-entropy term is a mean over
every target of the chosen halves of the whole batch, prompt included (TRL's), which `totals` counts before the
batch is split.

    DPO    margin = beta ((chosen - ref chosen) - (rejected - ref rejected))
           loss   = -log sigmoid(margin)
           with dpo_label_smoothing e > 0, robust DPO (TRL's `robust`: unbiased when labels flip with chance e):
           loss   = (-(1 - e) log sigmoid(margin) + e log sigmoid(-margin)) / (1 - 2e)
    SimPO  margin = beta (chosen / |chosen| - rejected / |rejected|) - gamma      (length-normalised, no reference)
           loss   = -log sigmoid(margin)
    ORPO   with mean log-probabilities a, b of chosen and rejected,
           log odds = (a - b) - (log(1 - e^a) - log(1 - e^b))
           loss   = NLL(chosen halves, prompt included) - lambda log sigmoid(log odds)

Rewards (reported, as TRL logs them): DPO beta (logp - ref logp); SimPO beta x mean logp; ORPO lambda x mean logp.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from maxshard.objectives import kinds
from maxshard.objectives.segments import halves

__all__ = ["Pairs", "pairs_of", "DPO", "SimPO", "ORPO"]

Batch = dict[str, jax.Array]


class Pairs(NamedTuple):
    """Per-pair sums [batch, slots] (a row has at most length / 2 pairs; unused slots are all zero)."""

    chosen: jax.Array  # summed log-probabilities of the chosen reply's targets
    rejected: jax.Array
    chosen_tokens: jax.Array  # reply targets in each half
    rejected_tokens: jax.Array

    @property
    def counted(self) -> jax.Array:
        return ((self.chosen_tokens > 0) & (self.rejected_tokens > 0)).astype(jnp.float32)

    def means(self) -> tuple[jax.Array, jax.Array]:
        """Mean log-probability per reply token of each half (0 for empty slots)."""
        return (self.chosen / jnp.maximum(self.chosen_tokens, 1.0),
                self.rejected / jnp.maximum(self.rejected_tokens, 1.0))


def pairs_of(logps: jax.Array, batch: Batch) -> Pairs:
    """Per-pair log-probabilities and reply lengths of log-probabilities [batch, length] (reply targets only)."""
    weights = batch["loss_weights"].astype(jnp.float32)
    chosen, rejected = halves(logps * weights, batch["segment_ids"])
    chosen_tokens, rejected_tokens = halves(weights, batch["segment_ids"])
    return Pairs(chosen, rejected, chosen_tokens, rejected_tokens)


def _sigmoid_loss(margin: jax.Array, smoothing: float = 0.0) -> jax.Array:
    """-log sigmoid(margin), or robust DPO's unbiased form under labels flipped with chance `smoothing`."""
    if not smoothing:
        return -jax.nn.log_sigmoid(margin)
    flipped = smoothing * jax.nn.log_sigmoid(-margin)
    return (-(1.0 - smoothing) * jax.nn.log_sigmoid(margin) + flipped) / (1.0 - 2.0 * smoothing)


def _pair_sums(loss: jax.Array, pairs: Pairs, chosen: jax.Array, rejected: jax.Array,
               reward_chosen: jax.Array, reward_rejected: jax.Array) -> dict[str, jax.Array]:
    """The sums every preference objective reports, over counted pairs: `chosen`/`rejected` are the log-probs it
    logs (summed or mean), the rewards as the objective defines them."""
    counted = pairs.counted
    total = lambda x: jnp.sum(x * counted)  # noqa: E731 - a one-line reduction
    return {
        "loss_sum": total(loss),
        "weight_sum": jnp.sum(counted),
        "tokens": jnp.sum(pairs.chosen_tokens + pairs.rejected_tokens),
        "rewards_chosen": total(reward_chosen),
        "rewards_rejected": total(reward_rejected),
        "rewards_correct": total((reward_chosen > reward_rejected).astype(jnp.float32)),
        "logps_chosen": total(chosen),
        "logps_rejected": total(rejected),
    }


def _pair_metrics(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    pairs = jnp.maximum(sums["weight_sum"], 1.0)
    return {
        "rewards/chosen": sums["rewards_chosen"] / pairs,
        "rewards/rejected": sums["rewards_rejected"] / pairs,
        "rewards/accuracy": sums["rewards_correct"] / pairs,
        "rewards/margin": (sums["rewards_chosen"] - sums["rewards_rejected"]) / pairs,
        "logps/chosen": sums["logps_chosen"] / pairs,
        "logps/rejected": sums["logps_rejected"] / pairs,
    }


@dataclasses.dataclass(frozen=True)
class DPO:
    """Direct preference optimisation (TRL's `sigmoid` loss, `robust` with label smoothing) against a reference
    model's log-probabilities."""

    beta: float
    label_smoothing: float = 0.0
    kind: kinds.Kind = kinds.kind("dpo")
    temperature: ClassVar[float] = 1.0

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        return {}

    def sums(self, logps: jax.Array, batch: Batch, totals: dict[str, jax.Array],
             reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        assert reference is not None, "DPO needs the reference model's log-probabilities"
        pairs, ref = pairs_of(logps, batch), pairs_of(reference, batch)
        reward_chosen = self.beta * (pairs.chosen - ref.chosen)
        reward_rejected = self.beta * (pairs.rejected - ref.rejected)
        loss = _sigmoid_loss(reward_chosen - reward_rejected, self.label_smoothing)
        sums = _pair_sums(loss, pairs, pairs.chosen, pairs.rejected, reward_chosen, reward_rejected)
        return sums["loss_sum"], sums

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return _pair_metrics(sums)


@dataclasses.dataclass(frozen=True)
class SimPO:
    """SimPO (TRL's CPO with loss_type simpo and no behaviour-cloning term): no reference model."""

    beta: float
    gamma: float
    kind: kinds.Kind = kinds.kind("simpo")
    temperature: ClassVar[float] = 1.0

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        return {}

    def sums(self, logps: jax.Array, batch: Batch, totals: dict[str, jax.Array],
             reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        pairs = pairs_of(logps, batch)
        chosen, rejected = pairs.means()
        loss = _sigmoid_loss(self.beta * (chosen - rejected) - self.gamma)
        sums = _pair_sums(loss, pairs, chosen, rejected, self.beta * chosen, self.beta * rejected)
        return sums["loss_sum"], sums

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return _pair_metrics(sums)


def _chosen_halves(values: jax.Array, batch: Batch) -> jax.Array:
    """Sums of `values` [batch, length] over every target of each chosen half, prompt included: [batch, slots]."""
    return halves(values, batch["segment_ids"])[0]


@dataclasses.dataclass(frozen=True)
class ORPO:
    """Odds-ratio preference optimisation (TRL's ORPO): cross-entropy on the chosen halves plus the odds term."""

    lam: float
    kind: kinds.Kind = kinds.kind("orpo")
    temperature: ClassVar[float] = 1.0

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        """Pairs and chosen-half targets of the whole batch: the NLL term is a mean over all those targets."""
        pairs = pairs_of(jnp.zeros(batch["loss_weights"].shape, jnp.float32), batch)
        counted = pairs.counted
        targets = _chosen_halves(jnp.ones(batch["segment_ids"].shape, jnp.float32), batch)
        return {"pairs": jnp.sum(counted), "chosen_targets": jnp.sum(targets * counted)}

    def sums(self, logps: jax.Array, batch: Batch, totals: dict[str, jax.Array],
             reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        pairs = pairs_of(logps, batch)
        chosen, rejected = pairs.means()
        log_odds = (chosen - rejected) - (_log1m_exp(chosen) - _log1m_exp(rejected))
        ratio = jax.nn.log_sigmoid(log_odds)
        nll = -jnp.sum(_chosen_halves(logps, batch) * pairs.counted)  # this microbatch's chosen-half targets
        # The step divides by the pairs: the NLL's share is scaled so that its quotient is the batch's token mean.
        nll_share = nll * totals["pairs"] / jnp.maximum(totals["chosen_targets"], 1.0)
        sums = _pair_sums(-self.lam * ratio, pairs, chosen, rejected, self.lam * chosen, self.lam * rejected)
        sums.update(nll=nll_share, log_odds_ratio=jnp.sum(ratio * pairs.counted),
                    log_odds_chosen=jnp.sum(log_odds * pairs.counted))
        sums["loss_sum"] = sums["loss_sum"] + nll_share
        return sums["loss_sum"], sums

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        pairs = jnp.maximum(sums["weight_sum"], 1.0)
        return {**_pair_metrics(sums), "nll_loss": sums["nll"] / pairs,
                "log_odds_ratio": sums["log_odds_ratio"] / pairs, "log_odds_chosen": sums["log_odds_chosen"] / pairs}


def _log1m_exp(x: jax.Array) -> jax.Array:
    """log(1 - e^x) for x < 0, accurate at both ends (log1p far from 0, expm1 near it). Each branch sees only inputs
    where it is finite, so neither puts a NaN into the gradient; x is capped below 0 (an empty slot has x = 0)."""
    far = x < -jnp.log(2.0)
    near_zero = jnp.minimum(jnp.where(far, -1.0, x), -1e-7)
    return jnp.where(far, jnp.log1p(-jnp.exp(jnp.where(far, x, -1.0))), jnp.log(-jnp.expm1(near_zero)))
