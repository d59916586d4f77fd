"""The training objectives (`objective`): one row each, so an objective is named here once. Read by the config
schema (the allowed names), `maxshard.objectives.of` (the implementation), the input pipelines (what a row of the
batch holds: documents, preference pairs, or rollouts sampled from the model: `samples`) and the train state (whether
a reference model is kept and where it comes from: `reference_source`). Code outside `maxshard/objectives/` reads
these properties, never an objective's name (tests/test_objective_kinds.py).

A leaf, so that the config schema and the data pipelines can read it without the losses (jax).

Every objective reads the five batch fields `FIELDS` [batch, length] (and its own `extra` ones, `fields`); what
differs is what a row holds:

    documents   packed documents; the loss counts targets whose loss_weights is 1 (`lm`)
    pairs       preference pairs, each whole in one row: pair p of a row is its segments 2p - 1 (the chosen reply
                with its prompt) and 2p (the rejected one); loss_weights is 1 on reply targets only, so the prompt
                counts in neither half (`data/preference.py` writes such rows, `data/synthetic.py` makes them)
    unpaired    unpaired examples (KTO), each whole in one row: example e of a row is its segments 2e - 1 (a
                completion with its prompt) and 2e (the same prompt with another record's completion, for the KL
                reference point); loss_weights is the label on the completion's targets (+1 desirable, -1
                undesirable), 1 on the other completion's, 0 on prompts (`data/preference.py` writes such rows)
    rollouts    sampled completions of prompts, one a row (`generation/rollouts.py`): loss_weights is 1 on the
                completion's targets, beside the rollout policy's log-probabilities and the completion's advantage
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["FIELDS", "Kind", "KINDS", "NAMES", "kind", "fields", "rollout_fields", "trains_mtp", "REFERENCES",
           "REFERENCE_FIELD", "reference_source", "names_where", "GRPO_LOSS_TYPES", "GRPO_KL_ESTIMATORS",
           "GRPO_IMPORTANCE_SAMPLING"]

# name -> dtype of every batch field, [batch, length] each (maxshard/data/__init__.py says what each holds)
FIELDS = {"inputs": "int32", "targets": "int32", "segment_ids": "int32", "positions": "int32",
          "loss_weights": "float32"}

# dpo_reference, kto_reference: where the reference log-probabilities come from (`auto`: lora_base with LoRA, else
# frozen; `precomputed`: a first pass writes them, training reads them as the batch field REFERENCE_FIELD)
REFERENCES = ("auto", "frozen", "lora_base", "precomputed")
REFERENCE_FIELD = "reference_logps"

# grpo_loss_type: how GRPO's per-token losses become one (objectives/grpo.py), named as TRL's `loss_type`s
GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
# grpo_kl_estimator: bias_corrected (TRL 1.16's default use_bias_correction_kl: k3 x the policy/old ratio) or k3
GRPO_KL_ESTIMATORS = ("bias_corrected", "k3")
# grpo_importance_sampling: the ratio per token, or one per completion (GSPO; TRL's importance_sampling_level)
GRPO_IMPORTANCE_SAMPLING = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class Kind:
    """One objective (module docstring)."""

    name: str
    rows: str  # "documents", "pairs", "unpaired" or "rollouts": what a batch row holds
    reference: bool  # it compares with a reference model's log-probabilities
    keys: tuple[str, ...]  # its config keys
    summary: str
    extra: tuple[str, ...] = ()  # float32 [batch, length] batch fields beyond FIELDS
    reference_key: str = ""  # the config key saying where the reference comes from (one of REFERENCES); "": auto
    reference_weight_key: str = ""  # a config key whose 0 keeps no reference at all
    scores: bool = False  # it reads the score head's per-token scores (a reward model, `score_head`), not log-probs

    @property
    def samples(self) -> bool:
        """Its rows are completions sampled from the model being trained (generation/rollouts.py), not read."""
        return self.rows == "rollouts"

    @property
    def pairs(self) -> bool:
        """Its rows hold preference pairs."""
        return self.rows == "pairs"

    @property
    def unpaired(self) -> bool:
        """Its rows hold unpaired examples, each with its KL completion (KTO)."""
        return self.rows == "unpaired"

    @property
    def preference(self) -> bool:
        """Its rows are made of preference records (dataset_type preference): pairs or unpaired examples."""
        return self.pairs or self.unpaired

    @property
    def documents(self) -> bool:
        """Its rows hold packed documents."""
        return self.rows == "documents"


KINDS = (
    Kind("lm", "documents", False, (), "next-token cross-entropy (pre-training, SFT)"),
    Kind("dpo", "pairs", True, ("dpo_beta", "dpo_label_smoothing", "dpo_reference"),
         "direct preference optimisation against a reference model (objectives/preference.py)",
         reference_key="dpo_reference"),
    Kind("simpo", "pairs", False, ("simpo_beta", "simpo_gamma"),
         "SimPO: length-normalised log-probabilities with a target margin, no reference"),
    Kind("orpo", "pairs", False, ("orpo_lambda",),
         "ORPO: the chosen reply's cross-entropy plus a log-odds-ratio term, no reference"),
    Kind("reward_model", "pairs", False, (),
         "a reward model: the Bradley-Terry loss on the scores of each pair's chosen and rejected replies "
         "(objectives/reward.py; needs score_head)", scores=True),
    Kind("kto", "unpaired", True, ("kto_beta", "kto_desirable_weight", "kto_undesirable_weight", "kto_reference"),
         "KTO: unpaired completions labelled desirable or not, each log-ratio to the reference against a KL "
         "reference point from mismatched prompts and completions (objectives/kto.py)", reference_key="kto_reference"),
    Kind("grpo", "rollouts", True, ("grpo_group_size", "grpo_updates_per_rollout", "grpo_kl_beta", "grpo_epsilon",
                                    "grpo_temperature", "grpo_top_p", "grpo_max_new_tokens", "reward",
                                    "grpo_loss_type", "grpo_kl_estimator", "grpo_epsilon_high",
                                    "grpo_importance_sampling", "grpo_environment", "grpo_max_turns",
                                    "grpo_rollout_rows"),
         "GRPO: completions sampled from the current model, rewarded, advantages normalised within each prompt's "
         "group, a clipped ratio and a KL term to the reference (objectives/grpo.py)",
         extra=("old_logps", "advantages"), reference_weight_key="grpo_kl_beta"),
)
NAMES = tuple(k.name for k in KINDS)
_BY_NAME = {k.name: k for k in KINDS}


def kind(name: str) -> Kind:
    """The objective called `name` (KeyError for an unknown one; the schema admits only NAMES)."""
    return _BY_NAME[name]


def fields(name: str) -> dict[str, str]:
    """name -> dtype of every batch field objective `name` reads: FIELDS and its own."""
    return {**FIELDS, **dict.fromkeys(kind(name).extra, "float32")}


def rollout_fields() -> dict[str, str]:
    """name -> dtype of every field of a sampled row (generation/rollouts.py): the sampling objectives' (one)."""
    return {k: v for name in names_where("samples") for k, v in fields(name).items()}


def names_where(prop: str) -> tuple[str, ...]:
    """The objectives whose Kind property `prop` holds, for messages that list them."""
    return tuple(k.name for k in KINDS if getattr(k, prop))


def reference_source(cfg: Any) -> str:
    """Where the run's reference log-probabilities come from as configured: "" (its objective keeps none, or its
    reference weight is 0), else its `reference_key`'s value (one of REFERENCES; "auto" without one). `cfg` is the
    run Config (read by attribute: this module sits below the config)."""
    k = kind(cfg.objective)
    if not k.reference or (k.reference_weight_key and not getattr(cfg, k.reference_weight_key)):
        return ""
    return getattr(cfg, k.reference_key) if k.reference_key else "auto"


def trains_mtp(name: str, mtp_depth: int, mtp_loss_weight: float) -> bool:
    """Whether a step of objective `name` trains the multi-token prediction modules (layers/mtp.py): a model with
    some, a weight for their loss, and an objective on documents (lm: the others read the main head only)."""
    return bool(mtp_depth and mtp_loss_weight and kind(name).documents)
