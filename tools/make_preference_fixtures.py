"""Writes tests/fixtures/preference/: TRL's own losses, metrics, log-probs and gradients for DPO, SimPO, ORPO, GRPO
and KTO on the tests/fixtures/hf/qwen3 model, the reference for maxshard's preference objectives.

Run once, by hand, in a venv of its own: torch, transformers and trl are never dependencies of maxshard or its CI.

    python3 -m venv /work/trlvenv
    /work/trlvenv/bin/pip install torch==2.14.1 transformers==5.24.0 trl==1.16.0 datasets==5.2.0 accelerate==1.15.0 \
        safetensors==0.8.0 tokenizers==0.23.3 numpy==2.4.6
    /work/trlvenv/bin/python tools/make_preference_fixtures.py
    /work/trlvenv/bin/python tools/make_preference_fixtures.py --only grpo.dapo_t07,grpo.gspo   # those cases only
    /work/trlvenv/bin/python tools/make_preference_fixtures.py --only kto,reward

`--only` recomputes the named GRPO cases (and `kto`, `reward`) and writes them into the cases.json already there
(each with the versions that computed it) and their gradients, leaving every other file byte-identical: another
torch build moves the log-probs in their last bits (2.13 against 2.14: 5e-7), so a whole rerun would rewrite every
file.

Everything runs on CPU in float32 with dropout off, no truncation (max lengths far above the batch), no padding-free
batches, no packing, no liger kernels and no precomputed reference log-probs. Every number comes out of TRL's own code
path: the trainers are built on tiny in-memory `datasets.Dataset`s, TRL tokenizes the text records, TRL's collator
builds the batch, and `trainer.compute_loss` gives the loss (then `loss.backward()` the gradients):

  pairs       4 text records {prompt, chosen, rejected} (plain text: the qwen3 tokenizer has no chat template) and the
              ids DPOTrainer._prepare_dataset made of them (the EOS it appends included); CPOTrainer/ORPOTrainer's
              tokenize_row must give the same ids (checked). A conversational record with a tiny ChatML-like template
              (no newlines: the fixture's byte-level BPE has no byte for them) is tokenized too (ids only).
  dpo         DPOTrainer, loss_type ["sigmoid"], beta 0.1, reference = tests/fixtures/preference/reference/
              (qwen3 with every weight + 0.05 * N(0, 1), torch.manual_seed(0), parameters in named_parameters order).
  dpo_smooth  the same with beta 0.5 and label_smoothing 0.2. In TRL 1.16 the "sigmoid" loss ignores label_smoothing
              (only "robust", "exo_pair" and "aot*" read it), so this equals beta-0.5 DPO; the script checks that.
  dpo_robust  loss_type ["robust"], beta 0.5, label_smoothing 0.2: the one pairwise-sigmoid DPO loss that uses it.
  simpo       trl.experimental.cpo.CPOTrainer, loss_type "simpo", cpo_alpha 0, beta 2.0, simpo_gamma 0.5.
  orpo        trl.experimental.orpo.ORPOTrainer, beta (lambda) 0.1.
  grpo        GRPOTrainer on 2 prompts x 4 fixed completions fed through `rollout_func`, fixed rewards from a reward
              function, beta 0.04 (k3 KL to the reference model), epsilon 0.2, old log-probs from another
              perturbation of qwen3 (seed 1, scale 0.05) computed by TRL itself (num_iterations 2 makes
              _generate_and_score_completions score the rollouts with the model as it is then, which holds the old
              weights for that call). Three losses: "dapo" (TRL 1.16's default loss_type), "grpo", both with TRL
              1.16's default use_bias_correction_kl=True (the k3 KL multiplied by the policy/old ratio), and
              "grpo_k3": loss_type "grpo" with use_bias_correction_kl=False, the GRPO paper's plain k3 term; and
              with that plain k3 term the other normalisations maxshard offers (`grpo_loss_type`): "dapo_k3" and
              "dr_grpo_k3" (max_completion_length 64 divides it), their losses and metrics only. Then TRL's defaults
              with one change each: "dr_grpo" (losses and metrics only), "dapo_t07" (temperature 0.7: old,
              reference and policy log-probs all from logits / 0.7), "dapo_eps_high" (epsilon_high 0.28) and
              "gspo" (importance_sampling_level "sequence"), with gradients.
  kto         KTOTrainer (loss_type "kto", beta 0.5, desirable_weight 1.0, undesirable_weight 1.5) on 5 unpaired
              records {prompt, completion, label} (3 desirable, 2 undesirable) in one batch of 5, the reference
              model of dpo: TRL tokenizes them, builds the KL sequences by rotating the completions by one within
              the batch (example i's KL completion is example i - 1's, the first takes the last) and pads both.
  reward      RewardTrainer on the 4 pairs (Bradley-Terry, no margin, no centring), qwen3 loaded as a
              sequence-classification model (num_labels 1) whose score head is drawn after torch.manual_seed(2)
              (its weight is stored); TRL scores the last token that is not the pad id, which here is the EOS.

See tests/fixtures/preference/README.md for the file format and each loss's exact convention.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile

import accelerate
import datasets
import numpy as np
import torch
import transformers
import trl
from datasets import Dataset
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

ROOT = pathlib.Path(__file__).resolve().parent.parent
POLICY = ROOT / "tests" / "fixtures" / "hf" / "qwen3"
OUT = ROOT / "tests" / "fixtures" / "preference"

# Plain-text records. Prompts end on a word, completions start with a space: the byte-level pre-tokenizer splits
# there, so tokenize(prompt) is a prefix of tokenize(prompt + completion) and no trainer has to move the boundary.
RECORDS = [
    {"prompt": "the tiny book", "chosen": " reads a book", "rejected": " jumps over"},
    {"prompt": "grouped query attention shares", "chosen": " keys", "rejected": " between the heads of a book"},
    {"prompt": "the quick brown fox", "chosen": " jumps over the dog", "rejected": " reads"},
    {"prompt": "rotary position", "chosen": " embeddings rotate", "rejected": " and the lazy dog"},
]
# No newlines: the fixture tokenizer's byte-level BPE was trained on text without them and drops them.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)
CHAT_RECORDS = [
    {
        "prompt": [{"role": "user", "content": "the lazy dog"}],
        "chosen": [{"role": "assistant", "content": "reads a book"}],
        "rejected": [{"role": "assistant", "content": "jumps"}],
    }
]
REFERENCE_SEED, OLD_SEED, PERTURBATION = 0, 1, 0.05

# GRPO rollouts: two of the pairs' prompts, four completions each (EOS-terminated or not), and their rewards.
GRPO_PROMPTS = [0, 2]  # indices into RECORDS
GRPO_COMPLETIONS = [
    [" reads a book", " jumps", " and the lazy dog reads heads of", " a"],
    [" the lazy dog", " a fox and", " keys", " the tiny book about sharded arrays"],
]
GRPO_EOS = [[True, True, False, True], [True, False, True, True]]  # whether the rollout ended on <|endoftext|>
GRPO_REWARDS = [[1.0, 0.0, 0.5, 2.0], [-1.0, 0.25, 0.25, 3.0]]
# KTO: unpaired records, the pairs' completions each with its own label (3 desirable, 2 undesirable), one batch
KTO_RECORDS = [
    {"prompt": RECORDS[0]["prompt"], "completion": RECORDS[0]["chosen"], "label": True},
    {"prompt": RECORDS[1]["prompt"], "completion": RECORDS[1]["rejected"], "label": False},
    {"prompt": RECORDS[2]["prompt"], "completion": RECORDS[2]["chosen"], "label": True},
    {"prompt": RECORDS[3]["prompt"], "completion": RECORDS[3]["rejected"], "label": False},
    {"prompt": RECORDS[1]["prompt"], "completion": RECORDS[1]["chosen"], "label": True},
]
KTO_CONFIG = {"beta": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.5}
REWARD_SEED = 2  # torch.manual_seed before the sequence-classification model draws its score head
# GRPO cases kept without gradients (280 KiB each): their per-token terms are another case's, only weighted otherwise
# (dapo_k3, dr_grpo_k3: grpo_k3's; dr_grpo: dapo's times num_items_in_batch / (completions x max_completion_length))
GRPO_LOSS_ONLY = ("dapo_k3", "dr_grpo_k3", "dr_grpo")


def versions() -> dict:
    return {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "datasets": datasets.__version__, "accelerate": accelerate.__version__}


def load_policy() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32).eval()


def perturb(model: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    """Adds scale * N(0, 1) to every parameter, drawn in named_parameters order after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(scale * torch.randn(p.shape))
    return model


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tokenizer():
    return AutoTokenizer.from_pretrained(POLICY)


def common_args(**kwargs) -> dict:
    # bf16=False matters: TRL's configs default to bf16=True, and accelerator.autocast() (reference and GRPO forwards)
    # would then run in bfloat16 even on CPU
    return dict(output_dir=tempfile.mkdtemp(prefix="pref-fixture-"), report_to=[], use_cpu=True, seed=0,
                bf16=False, fp16=False,
                save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **kwargs)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradient of every parameter, keyed by HF name (the tied head's lands on model.embed_tokens.weight)."""
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[name] = p.grad.detach().to(torch.float32).contiguous().clone()
    return out


def floats(t: torch.Tensor) -> list:
    return t.detach().to(torch.float64).cpu().tolist()


def last_metrics(store: dict) -> dict:
    return {k: v[-1] for k, v in store.items() if v}


def masked_rows(values: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [floats(v[m.bool()]) for v, m in zip(values, mask)]


# ----------------------------------------------------------------------------------------------------------- DPO
def dpo_trainer(policy, reference, records, **config) -> DPOTrainer:
    args = DPOConfig(**common_args(per_device_train_batch_size=len(records), max_length=None, padding_free=False,
                                   precompute_ref_log_probs=False, disable_dropout=True, **config))
    return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(records),
                      processing_class=tokenizer())


def dpo_ids(trainer) -> list[dict]:
    ds = trainer.train_dataset
    return [{k: list(ds[i][k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for i in range(len(ds))]


def dpo_case(policy, reference, **config) -> tuple[dict, dict, list[dict]]:
    trainer = dpo_trainer(policy, reference, RECORDS, **config)
    pairs = dpo_ids(trainer)
    model = trainer.model
    model.train()
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))]))
    for store in trainer._metrics.values():
        store.clear()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    g = grads(model)
    metrics = last_metrics(trainer._metrics["train"])
    # Per-sequence summed completion log-probs through TRL's own method (the same forward _compute_loss makes)
    chosen, rejected = trainer.compute_ref_log_probs(model, batch)
    ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.ref_model, batch)
    with torch.no_grad():
        kwargs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        per_token = model(**kwargs, labels=labels, fused_lm_head=True, use_cache=False).log_probs
        ref_per_token = trainer.ref_model(**kwargs, labels=labels, fused_lm_head=True, use_cache=False).log_probs
    shift_mask = batch["completion_mask"][:, 1:]
    n = len(pairs)
    record = {
        "trainer": "trl.DPOTrainer", "loss_function": "trl.trainer.dpo_trainer.DPOTrainer._compute_loss",
        "config": {"loss_type": trainer.loss_types, "loss_weights": trainer.loss_weights, "beta": trainer.beta,
                   "label_smoothing": trainer.label_smoothing, "f_divergence_type": trainer.f_divergence_type,
                   "ld_alpha": trainer.ld_alpha, "use_weighting": trainer.use_weighting,
                   "max_length": trainer.args.max_length, "padding_free": trainer.args.padding_free,
                   "precompute_ref_log_probs": trainer.args.precompute_ref_log_probs,
                   "reference": "reference/"},
        "loss": loss.item(),
        "metrics": metrics,
        "policy_chosen_logps": floats(chosen), "policy_rejected_logps": floats(rejected),
        "reference_chosen_logps": floats(ref_chosen), "reference_rejected_logps": floats(ref_rejected),
        "policy_chosen_token_logps": masked_rows(per_token[:n], shift_mask[:n]),
        "policy_rejected_token_logps": masked_rows(per_token[n:], shift_mask[n:]),
        "reference_chosen_token_logps": masked_rows(ref_per_token[:n], shift_mask[:n]),
        "reference_rejected_token_logps": masked_rows(ref_per_token[n:], shift_mask[n:]),
    }
    # TRL's logged means are means of these per-pair numbers
    np.testing.assert_allclose(metrics["logps/chosen"], chosen.mean().item(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(metrics["logps/rejected"], rejected.mean().item(), rtol=1e-6, atol=1e-6)
    model.zero_grad(set_to_none=True)
    return record, g, pairs


def chat_ids(policy, reference) -> list[dict]:
    tok = tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    args = DPOConfig(**common_args(per_device_train_batch_size=1, max_length=None, precompute_ref_log_probs=False))
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(CHAT_RECORDS),
                         processing_class=tok)
    return dpo_ids(trainer)


# ---------------------------------------------------------------------------------------------------- CPO / ORPO
def cpo_like_case(kind: str, policy, **config) -> tuple[dict, dict, list[dict]]:
    if kind == "simpo":
        args = CPOConfig(**common_args(per_device_train_batch_size=len(RECORDS), max_length=4096,
                                       max_completion_length=None, disable_dropout=True, **config))
        trainer = CPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(RECORDS),
                             processing_class=tokenizer())
        name, fn = ("trl.experimental.cpo.CPOTrainer",
                    "CPOTrainer.get_batch_loss_metrics / cpo_loss / concatenated_forward")
    else:
        args = ORPOConfig(**common_args(per_device_train_batch_size=len(RECORDS), max_length=4096,
                                        max_completion_length=None, disable_dropout=True, **config))
        trainer = ORPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(RECORDS),
                              processing_class=tokenizer())
        name, fn = ("trl.experimental.orpo.ORPOTrainer",
                    "ORPOTrainer.get_batch_loss_metrics / odds_ratio_loss / concatenated_forward")
    ds = trainer.train_dataset
    pairs = []
    for i in range(len(ds)):
        row = ds[i]
        p = list(row["prompt_input_ids"])
        assert list(row["chosen_input_ids"][: len(p)]) == p and list(row["rejected_input_ids"][: len(p)]) == p
        pairs.append({"prompt_ids": p, "chosen_ids": list(row["chosen_input_ids"][len(p):]),
                      "rejected_ids": list(row["rejected_input_ids"][len(p):])})
    model = trainer.model
    model.train()
    batch = trainer._prepare_inputs(trainer.data_collator([ds[i] for i in range(len(ds))]))
    model.zero_grad(set_to_none=True)
    loss, metrics = trainer.compute_loss(model, batch, return_outputs=True)
    loss.backward()
    g = grads(model)
    with torch.no_grad():
        out = trainer.concatenated_forward(model, batch)
    chosen, rejected, nll = out[0], out[1], out[4]
    record = {"trainer": name, "loss_function": fn, "loss": loss.item(), "metrics": dict(metrics),
              "policy_chosen_logps": floats(chosen), "policy_rejected_logps": floats(rejected),
              "nll_loss": nll.item()}
    if kind == "simpo":
        record["config"] = {"loss_type": trainer.loss_type, "beta": trainer.beta, "simpo_gamma": trainer.simpo_gamma,
                            "cpo_alpha": trainer.cpo_alpha, "label_smoothing": trainer.label_smoothing,
                            "alpha": trainer.alpha, "max_length": trainer.max_length}
        record["logps_are"] = "mean over completion tokens (average_log_prob=True for loss_type simpo)"
    else:
        record["config"] = {"beta": trainer.beta, "max_length": trainer.max_length}
        record["logps_are"] = "mean over completion tokens (average_log_prob=True)"
    model.zero_grad(set_to_none=True)
    return record, g, pairs


# ---------------------------------------------------------------------------------------------------------- GRPO
def grpo_rollouts(tok) -> tuple[list[list[int]], list[list[int]], dict[tuple, float]]:
    eos = tok.eos_token_id
    prompt_ids, completion_ids, rewards = [], [], {}
    for g, record in enumerate(GRPO_PROMPTS):
        p = tok(RECORDS[record]["prompt"])["input_ids"]
        for text, ends, reward in zip(GRPO_COMPLETIONS[g], GRPO_EOS[g], GRPO_REWARDS[g]):
            ids = tok(RECORDS[record]["prompt"] + text)["input_ids"][len(p):] + ([eos] if ends else [])
            prompt_ids.append(p)
            completion_ids.append(ids)
            rewards[(g, tuple(ids))] = reward
    return prompt_ids, completion_ids, rewards


def grpo_case(loss_type: str, bias_corrected_kl: bool, reference_weights: dict, old_weights: dict,
              **variant) -> tuple[dict, dict, dict]:
    """One GRPO loss on the fixed rollouts; `variant`: GRPOConfig keys beyond the shared ones (temperature,
    epsilon_high, importance_sampling_level)."""
    tok = tokenizer()
    prompt_ids, completion_ids, reward_table = grpo_rollouts(tok)
    group = len(GRPO_COMPLETIONS[0])

    def rollout_func(prompts, trainer):
        assert prompts == [RECORDS[r]["prompt"] for r in GRPO_PROMPTS for _ in range(group)], prompts
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def fixed_reward(prompts, completions, completion_ids, **kwargs):
        return [reward_table[(i // group, tuple(ids))] for i, ids in enumerate(completion_ids)]

    policy = load_policy()
    policy_weights = weights(policy)
    args = GRPOConfig(**common_args(per_device_train_batch_size=len(prompt_ids), num_generations=group,
                                    max_completion_length=64, beta=0.04, epsilon=0.2, loss_type=loss_type,
                                    num_iterations=2, gradient_accumulation_steps=1,
                                    scale_rewards="group", mask_truncated_completions=False, disable_dropout=True,
                                    use_bias_correction_kl=bias_corrected_kl,
                                    shuffle_dataset=False, **{"temperature": 1.0, **variant}))
    dataset = Dataset.from_list([{"prompt": RECORDS[r]["prompt"]} for r in GRPO_PROMPTS])
    trainer = GRPOTrainer(model=policy, reward_funcs=[fixed_reward], args=args, train_dataset=dataset,
                          processing_class=tok, rollout_func=rollout_func)
    trainer.ref_model.load_state_dict(reference_weights)  # TRL built it from qwen3: make it the perturbed reference
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets for gradient_accumulation_steps=1
    model = trainer.model
    model.train()
    inputs = [{"prompt": RECORDS[r]["prompt"]} for r in GRPO_PROMPTS for _ in range(group)]
    # The rollouts were sampled by an older policy: TRL scores them (old_per_token_logps) with the model as it is now
    model.load_state_dict(old_weights)
    batch = trainer._generate_and_score_completions(inputs)
    model.load_state_dict(policy_weights)
    assert "old_per_token_logps" in batch and "ref_per_token_logps" in batch
    for store in trainer._metrics.values():
        store.clear()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    g = grads(model)
    metrics = last_metrics(trainer._metrics["train"])
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention,
                                                                 batch["completion_ids"].size(1))
    mask = batch["completion_mask"]
    ratio = torch.exp(logps - batch["old_per_token_logps"])
    if trainer.importance_sampling_level == "sequence":  # one ratio per completion: its mean log-ratio's exp
        log_ratio = ((logps - batch["old_per_token_logps"]) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        ratio = torch.exp(log_ratio).unsqueeze(1).expand_as(logps)
    adv = batch["advantages"].unsqueeze(1)
    clipped = ((ratio < 1 - trainer.epsilon_low) & (adv < 0)) | ((ratio > 1 + trainer.epsilon_high) & (adv > 0))
    record = {
        "trainer": "trl.GRPOTrainer",
        "loss_function": "trl.trainer.grpo_trainer.GRPOTrainer._compute_loss",
        "advantage_function": "trl.trainer.grpo_trainer.GRPOTrainer._generate_and_score_completions",
        "config": {"loss_type": trainer.loss_type, "beta": trainer.beta, "epsilon_low": trainer.epsilon_low,
                   "epsilon_high": trainer.epsilon_high, "delta": args.delta, "num_generations": group,
                   "scale_rewards": trainer.scale_rewards,
                   "importance_sampling_level": trainer.importance_sampling_level,
                   "temperature": trainer.temperature, "use_bias_correction_kl": args.use_bias_correction_kl,
                   "top_entropy_quantile": trainer.top_entropy_quantile, "entropy_coef": args.entropy_coef,
                   "off_policy_mask_threshold": args.off_policy_mask_threshold,
                   "multi_objective_aggregation": args.multi_objective_aggregation,
                   "mask_truncated_completions": args.mask_truncated_completions,
                   "max_completion_length": args.max_completion_length,
                   "gradient_accumulation_steps": 1, "steps_per_generation": args.steps_per_generation,
                   "num_processes": trainer.accelerator.num_processes,
                   "reference": "reference/", "old_policy": f"qwen3 + {PERTURBATION} * N(0, 1), seed {OLD_SEED}"},
        "loss": loss.item(),
        "metrics": metrics,
        "num_items_in_batch": int(batch["num_items_in_batch"].item()),
        "advantages": floats(batch["advantages"]),
        "policy_token_logps": masked_rows(logps, mask),
        "old_token_logps": masked_rows(batch["old_per_token_logps"], mask),
        "reference_token_logps": masked_rows(batch["ref_per_token_logps"], mask),
        "clipped_tokens": [[bool(x) for x in row[m.bool()]] for row, m in zip(clipped, mask)],
        "clip_fraction": (clipped.float() * mask).sum().item() / mask.sum().item(),
    }
    rollouts = {
        "prompt_ids": prompt_ids, "completion_ids": completion_ids,
        "prompts": [RECORDS[r]["prompt"] for r in GRPO_PROMPTS for _ in range(group)],
        "completions": [c for group_texts in GRPO_COMPLETIONS for c in group_texts],
        "ends_with_eos": [e for row in GRPO_EOS for e in row],
        "rewards": [r for row in GRPO_REWARDS for r in row], "group_size": group,
        "padded_prompt_ids": batch["prompt_ids"].tolist(), "prompt_mask": batch["prompt_mask"].tolist(),
        "padded_completion_ids": batch["completion_ids"].tolist(), "completion_mask": mask.tolist(),
    }
    model.zero_grad(set_to_none=True)
    return record, g, rollouts


# ----------------------------------------------------------------------------------------------------------- KTO
def kto_case(policy, reference) -> tuple[dict, dict]:
    """KTOTrainer (loss_type "kto") on KTO_RECORDS in one batch: TRL tokenizes them, rotates the completions by one
    within the batch for the KL sequences, and its collator pads both."""
    args = KTOConfig(**common_args(per_device_train_batch_size=len(KTO_RECORDS), max_length=None,
                                   precompute_ref_log_probs=False, disable_dropout=True, loss_type="kto",
                                   **KTO_CONFIG))
    trainer = KTOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(KTO_RECORDS),
                         processing_class=tokenizer())
    ds = trainer.train_dataset
    examples = [{k: (list(ds[i][k]) if k.endswith("_ids") else ds[i][k])
                 for k in ("prompt_ids", "completion_ids", "KL_completion_ids", "label")} for i in range(len(ds))]
    model = trainer.model
    model.train()
    batch = trainer._prepare_inputs(trainer.data_collator([ds[i] for i in range(len(ds))]))
    for store in trainer._metrics.values():
        store.clear()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    g = grads(model)
    metrics = last_metrics(trainer._metrics["train"])
    logps, kl_logps = trainer.compute_ref_log_probs(model, batch)
    ref_logps, ref_kl_logps = trainer.compute_ref_log_probs(trainer.ref_model, batch)
    record = {
        "trainer": "trl.KTOTrainer", "loss_function": "trl.trainer.kto_trainer.KTOTrainer._compute_loss",
        "config": {"loss_type": trainer.loss_type, "beta": trainer.beta,
                   "desirable_weight": trainer.desirable_weight, "undesirable_weight": trainer.undesirable_weight,
                   "max_length": trainer.args.max_length,
                   "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
                   "train_sampling_strategy": trainer.args.train_sampling_strategy,
                   "precompute_ref_log_probs": trainer.args.precompute_ref_log_probs, "reference": "reference/"},
        "records": KTO_RECORDS,
        "examples": examples,
        "loss": loss.item(),
        "metrics": metrics,
        "policy_logps": floats(logps), "reference_logps": floats(ref_logps),
        "policy_kl_logps": floats(kl_logps), "reference_kl_logps": floats(ref_kl_logps),
    }
    kl = (kl_logps - ref_kl_logps).mean().clamp(min=0).item()
    np.testing.assert_allclose(metrics["kl"], kl, rtol=1e-6, atol=1e-6)
    assert kl > 0, "the fixture's KL reference point is clamped to 0: it would not test the KL term"
    model.zero_grad(set_to_none=True)
    return record, g


# -------------------------------------------------------------------------------------------------- reward model
def reward_case() -> tuple[dict, dict]:
    """RewardTrainer (Bradley-Terry: -logsigmoid(r_chosen - r_rejected), no margin, no centring) on RECORDS in one
    batch, the policy loaded as a sequence-classification model whose score head (hidden -> 1, no bias) is drawn
    after torch.manual_seed(REWARD_SEED)."""
    torch.manual_seed(REWARD_SEED)
    model = AutoModelForSequenceClassification.from_pretrained(POLICY, num_labels=1, dtype=torch.float32)
    score = floats(model.score.weight[0])
    args = RewardConfig(**common_args(per_device_train_batch_size=len(RECORDS), max_length=None,
                                      disable_dropout=True, center_rewards_coefficient=None))
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(RECORDS),
                            processing_class=tokenizer())
    ds = trainer.train_dataset
    pairs = [{k: list(ds[i][k]) for k in ("chosen_ids", "rejected_ids")} for i in range(len(ds))]
    model = trainer.model
    model.train()
    batch = trainer._prepare_inputs(trainer.data_collator([ds[i] for i in range(len(ds))]))
    for store in trainer._metrics.values():
        store.clear()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    g = grads(model)
    with torch.no_grad():
        rewards = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    n = len(pairs)
    record = {
        "trainer": "trl.RewardTrainer", "loss_function": "trl.trainer.reward_trainer.RewardTrainer.compute_loss",
        "model": "AutoModelForSequenceClassification(tests/fixtures/hf/qwen3, num_labels=1)",
        "config": {"center_rewards_coefficient": args.center_rewards_coefficient, "max_length": args.max_length,
                   "pad_token_id": model.config.get_text_config().pad_token_id, "score_seed": REWARD_SEED},
        "score_weight": score,
        "pairs": pairs,
        "loss": loss.item(),
        "metrics": last_metrics(trainer._metrics["train"]),
        "rewards_chosen": floats(rewards[:n]), "rewards_rejected": floats(rewards[n:]),
        "scored_position": "the last token that is not the pad id (pad = EOS = 0 here: the token before the EOS)",
    }
    model.zero_grad(set_to_none=True)
    return record, g


# ---------------------------------------------------------------------------------------------------------- main
def grpo_cases(reference_weights: dict, old_weights: dict, all_grads: dict) -> tuple[dict, dict]:
    """Every GRPO case (name -> record; their gradients into `all_grads`) and the rollouts they share."""
    grpo, rollouts = {}, None
    # TRL 1.16's defaults (loss_type "dapo", use_bias_correction_kl True), "grpo" with them, and "grpo" with the plain
    # k3 KL of the GRPO paper; then with that k3 term the normalisations of TRL's "dapo" and "dr_grpo" loss types;
    # then TRL's defaults with one thing changed each: "dr_grpo", temperature 0.7 (every log-prob of the loss from
    # logits / 0.7), DAPO's asymmetric clip (epsilon_high 0.28) and GSPO's sequence-level importance ratio
    for name, loss_type, bias_corrected_kl, variant in (
            ("dapo", "dapo", True, {}), ("grpo", "grpo", True, {}), ("grpo_k3", "grpo", False, {}),
            ("dapo_k3", "dapo", False, {}), ("dr_grpo_k3", "dr_grpo", False, {}), ("dr_grpo", "dr_grpo", True, {}),
            ("dapo_t07", "dapo", True, {"temperature": 0.7}), ("dapo_eps_high", "dapo", True, {"epsilon_high": 0.28}),
            ("gspo", "dapo", True, {"importance_sampling_level": "sequence"})):
        grpo[name], g, r = grpo_case(loss_type, bias_corrected_kl, reference_weights, old_weights, **variant)
        if name not in GRPO_LOSS_ONLY:
            all_grads[f"grpo_{name}"] = g
        assert rollouts is None or r == rollouts
        rollouts = r
    return grpo, rollouts


def main_only(names: list[str], ref_dir: pathlib.Path) -> None:
    """The GRPO cases `names` (and `kto`) only, from the reference model already in `ref_dir` (write_only)."""
    all_grads, grpo, rollouts, kto = {}, {}, None, None
    if "kto" in names:
        reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
        kto, all_grads["kto"] = kto_case(load_policy(), reference)
    reward = None
    if "reward" in names:
        reward, all_grads["reward"] = reward_case()
    if any(name.startswith("grpo.") for name in names):
        reference_weights = weights(AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32))
        old_weights = weights(perturb(load_policy(), OLD_SEED, PERTURBATION))
        grpo, rollouts = grpo_cases(reference_weights, old_weights, all_grads)
    write_only(names, grpo, rollouts, all_grads, kto, reward)


def write_only(names: list[str], grpo: dict, rollouts: dict | None, all_grads: dict,
               kto: dict | None = None, reward: dict | None = None) -> None:
    """`--only grpo.NAME,...,kto,reward`: adds (or replaces) those cases in the cases.json already there, each with the
    versions that computed it, and writes their gradients; every other file stays as it is, byte for byte (another
    torch build moves the log-probs in their last bits)."""
    fixture = json.loads((OUT / "cases.json").read_text())
    assert rollouts is None or fixture["grpo"]["rollouts"] == rollouts, "the stored rollouts are not this script's"
    if kto is not None:
        fixture["kto"] = {**kto, "versions": versions()}
        save_file(all_grads["kto"], str(OUT / "kto_grads.safetensors"), metadata={"format": "pt"})
    if reward is not None:
        fixture["reward"] = {**reward, "versions": versions()}
        save_file(all_grads["reward"], str(OUT / "reward_grads.safetensors"), metadata={"format": "pt"})
    for name in (n for n in names if n not in ("kto", "reward")):
        case = name.removeprefix("grpo.")
        fixture["grpo"][case] = {**grpo[case], "versions": versions()}
        if f"grpo_{case}" in all_grads:
            save_file(all_grads[f"grpo_{case}"], str(OUT / f"grpo_{case}_grads.safetensors"),
                      metadata={"format": "pt"})
    (OUT / "cases.json").write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"wrote {', '.join(names)} into {OUT}")


def main() -> None:
    only = sys.argv[2].split(",") if sys.argv[1:2] == ["--only"] else []
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental; the warning says so
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    ref_dir = OUT / "reference"
    if only:
        return main_only(only, ref_dir)
    for stale in OUT.glob("*_grads.safetensors"):
        stale.unlink()

    reference = perturb(load_policy(), REFERENCE_SEED, PERTURBATION)
    shutil.rmtree(ref_dir, ignore_errors=True)
    reference.save_pretrained(ref_dir)
    tokenizer().save_pretrained(ref_dir)
    reference_weights = weights(AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32))
    old_weights = weights(perturb(load_policy(), OLD_SEED, PERTURBATION))

    cases, all_grads = {}, {}

    def ref_model():
        return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()

    cases["dpo"], all_grads["dpo"], pairs = dpo_case(load_policy(), ref_model(), loss_type=["sigmoid"], beta=0.1,
                                                     label_smoothing=0.0)
    cases["dpo_smooth"], all_grads["dpo_smooth"], again = dpo_case(load_policy(), ref_model(), loss_type=["sigmoid"],
                                                                   beta=0.5, label_smoothing=0.2)
    assert again == pairs
    unsmoothed, unsmoothed_grads, _ = dpo_case(load_policy(), ref_model(), loss_type=["sigmoid"], beta=0.5,
                                               label_smoothing=0.0)
    assert unsmoothed["loss"] == cases["dpo_smooth"]["loss"], "TRL's sigmoid loss now reads label_smoothing"
    assert all(torch.equal(unsmoothed_grads[k], v) for k, v in all_grads["dpo_smooth"].items())
    cases["dpo_smooth"]["label_smoothing_has_no_effect"] = True
    cases["dpo_robust"], all_grads["dpo_robust"], _ = dpo_case(load_policy(), ref_model(), loss_type=["robust"],
                                                               beta=0.5, label_smoothing=0.2)
    cases["simpo"], all_grads["simpo"], simpo_pairs = cpo_like_case("simpo", load_policy(), loss_type="simpo",
                                                                    beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0,
                                                                    label_smoothing=0.0)
    cases["orpo"], all_grads["orpo"], orpo_pairs = cpo_like_case("orpo", load_policy(), beta=0.1)
    assert simpo_pairs == pairs and orpo_pairs == pairs, (pairs, simpo_pairs, orpo_pairs)

    grpo, rollouts = grpo_cases(reference_weights, old_weights, all_grads)
    conversational = chat_ids(load_policy(), ref_model())
    kto, all_grads["kto"] = kto_case(load_policy(), ref_model())
    reward, all_grads["reward"] = reward_case()

    for name, g in all_grads.items():
        save_file(g, str(OUT / f"{name}_grads.safetensors"), metadata={"format": "pt"})
    fixture = {
        "versions": versions(),
        "policy": "tests/fixtures/hf/qwen3",
        "reference": {"path": "tests/fixtures/preference/reference", "seed": REFERENCE_SEED, "scale": PERTURBATION},
        "records": RECORDS,
        "pairs": pairs,
        "conversational": {"chat_template": CHAT_TEMPLATE, "records": CHAT_RECORDS, "pairs": conversational},
        "preference": cases,
        "grpo": {"rollouts": rollouts, "old_policy": {"seed": OLD_SEED, "scale": PERTURBATION}, **grpo},
        "kto": kto,
        "reward": reward,
    }
    (OUT / "cases.json").write_text(json.dumps(fixture, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT}: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
