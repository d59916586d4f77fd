"""Training objectives: what the train step minimises, computed from the model's per-token log-probabilities.

An objective (`Objective`) is one module; its row in `kinds.py` names it, says what a batch row holds and whether it
needs a reference model. The train step (`training/step.py`) runs the model to per-token log-probabilities of the
targets [batch, length] (a reward model's per-token scores, for an objective whose kind `scores`) and hands them
over with the batch:

    totals(batch)                          normalisers over the whole global batch (before gradient accumulation
                                           splits it), from the batch fields alone
    sums(logps, batch, totals, reference)  (loss_sum, sums): the step divides loss_sum, summed over microbatches, by
                                           sums["weight_sum"], summed likewise; every entry of sums adds up across
                                           microbatches; `reference` is the reference model's log-probabilities
    metrics(sums)                          what the objective reports beyond loss (from the summed sums)
    temperature                            the log-probabilities are of the logits divided by it (the step divides
                                           them, for the reference and GRPO's rollout policy too: Trainer._head)

so k microbatches give exactly the gradient of the whole batch for every objective, as they do for cross-entropy.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from maxshard.objectives import kinds
from maxshard.objectives.grpo import GRPO
from maxshard.objectives.kto import KTO
from maxshard.objectives.lm import LanguageModel
from maxshard.objectives.preference import DPO, ORPO, SimPO
from maxshard.objectives.reward import RewardModel

__all__ = ["Objective", "of", "Batch"]

Batch = dict[str, jax.Array]


class Objective(Protocol):
    kind: kinds.Kind
    temperature: float  # every log-probability it reads is of the logits / this (GRPO's sampling temperature; else 1)

    def totals(self, batch: Batch) -> dict[str, jax.Array]: ...

    def sums(self, logps: jax.Array, batch: Batch, totals: dict[str, jax.Array],
             reference: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    def metrics(self, sums: dict[str, jax.Array]) -> dict[str, jax.Array]: ...


def of(cfg: Any) -> Objective:
    """The run's objective with its hyperparameters (`cfg` is the run Config)."""
    name = cfg.objective
    if name == "lm":
        return LanguageModel()
    if name == "dpo":
        return DPO(cfg.dpo_beta, cfg.dpo_label_smoothing)
    if name == "simpo":
        return SimPO(cfg.simpo_beta, cfg.simpo_gamma)
    if name == "orpo":
        return ORPO(cfg.orpo_lambda)
    if name == "reward_model":
        return RewardModel()
    if name == "kto":
        return KTO(cfg.kto_beta, cfg.kto_desirable_weight, cfg.kto_undesirable_weight)
    if name == "grpo":
        # dr_grpo's constant length: the most tokens the model samples in an episode (every turn's)
        episode_tokens = cfg.grpo_max_new_tokens * cfg.grpo_max_turns
        return GRPO(cfg.grpo_epsilon, cfg.grpo_kl_beta, cfg.grpo_loss_type, episode_tokens, cfg.grpo_epsilon_high,
                    cfg.grpo_kl_estimator, cfg.grpo_importance_sampling, cfg.grpo_temperature)
    raise KeyError(name)
