"""Writes tests/fixtures/glm4_moe/: a tiny random GLM-4.5 model and what transformers computes for it.

Run once, by hand, in the reference venv (torch and transformers are never dependencies of maxshard or its CI):

    /work/refvenv/bin/python tools/make_glm4_moe_fixtures.py [NAME ...]

  glm4_moe     Glm4MoeForCausalLM, width 32, 3 layers: one dense (first_k_dense_replace 1), then mixtures of 8
               experts in 2 groups, the best group kept, top-2 by sigmoid scores plus a random selection bias
               (gate.e_score_correction_bias), renormalised and scaled by 2.5, beside one shared expert; biases on q,
               k and v but not the output (attention_bias); RoPE on half of each head (partial_rotary_factor 0.5);
               untied head, float32, a byte-level BPE Qwen-style tokenizer; generate.json: 16 greedy tokens.
               config.json names one multi-token prediction layer (transformers' default), which transformers
               neither builds nor saves.
  glm4_moe_qk_norm  glm4_moe's shape in 2 layers with use_qk_norm (an RMSNorm over head_dim on each q and k head before
               RoPE, off in the releases): its files and logits only.
  defaults/    Glm4MoeConfig's config.json at transformers' defaults (its docstring's GLM-4.5-Air-style shape),
               which the configs/models/glm4_5_air.yml preset is checked against.

The model directory holds what `save_pretrained` writes (experts one by one under mlp.experts, as released)
plus tokens.npy (int32 [2, 12]) and logits.npy (float32 [2, 12, vocab], positions 0..11, no padding). Weights are
redrawn larger than transformers' init (std 0.15, norms 1 +- 0.1), so routing, the biases and the partial RoPE move
the logits.
"""

from __future__ import annotations

import pathlib
import sys

from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_hf_fixtures import correction_biases, family_fixture, fresh, redraw, reference, run_builders  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "glm4_moe"
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
             routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True,
             rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})


def glm4_moe() -> None:
    """The model's weights and correction biases redrawn, its reference logits, its files, a tokenizer and 16
    greedy tokens."""
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**SHAPE)).eval()
    directory = fresh(OUT / "glm4_moe")
    redraw(model, seed=67, bf16=False)
    correction_biases(model, 71)
    family_fixture(model, directory)


def glm4_moe_qk_norm() -> None:
    """The q/k norms on: weights redrawn (the norm scales 1 +- 0.1), the reference logits, the files."""
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**SHAPE, "num_hidden_layers": 2, "use_qk_norm": True})).eval()
    directory = fresh(OUT / "glm4_moe_qk_norm")
    redraw(model, seed=79, bf16=False)
    correction_biases(model, 83)
    reference(model, directory)
    model.save_pretrained(directory)


def defaults() -> None:
    directory = fresh(OUT / "defaults")
    (directory / "glm4_moe.json").write_text(Glm4MoeConfig().to_json_string())


BUILDERS = {"glm4_moe": glm4_moe, "glm4_moe_qk_norm": glm4_moe_qk_norm, "defaults": defaults}


def main(names: list[str]) -> None:
    run_builders(BUILDERS, OUT, names)


if __name__ == "__main__":
    main(sys.argv[1:])
