"""Writes tests/fixtures/minimax_m2/: a tiny random MiniMax-M2 model and what transformers computes for it.

Run once, by hand, in the reference venv (torch and transformers are never dependencies of maxshard or its CI):

    /work/refvenv/bin/python tools/make_minimax_m2_fixtures.py [NAME ...]

  minimax_m2   MiniMaxM2ForCausalLM, width 32, 2 layers, each a mixture of 8 experts, top-2 by sigmoid scores plus a
               random e_score_correction_bias (for choosing only), the chosen scores renormalised; q/k RMSNorm over
               all heads (q_norm [4 x 8], k_norm [2 x 8]); RoPE on half of each head (partial_rotary_factor 0.5,
               rotate-half over the first 4 features); untied head, float32, a byte-level BPE Qwen-style tokenizer;
               generate.json: 16 greedy tokens.
  defaults/    MiniMaxM2Config's config.json at transformers' defaults (MiniMax-M2's published shape), which the
               configs/models/minimax_m2.yml preset is checked against.

The model directory holds what `save_pretrained` writes (experts one by one under block_sparse_moe, as released)
plus tokens.npy (int32 [2, 12]) and logits.npy (float32 [2, 12, vocab], positions 0..11, no padding). Weights are
redrawn larger than transformers' init (std 0.15, norms 1 +- 0.1), so routing, the norms and the partial RoPE move
the logits.
"""

from __future__ import annotations

import pathlib
import sys

from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_hf_fixtures import correction_biases, family_fixture, fresh, redraw, run_builders  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "minimax_m2"
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_local_experts=8,
             num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0,
             pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})


def minimax_m2() -> None:
    """The model's weights and correction biases redrawn, its reference logits, its files, a tokenizer and 16
    greedy tokens."""
    model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**SHAPE)).eval()
    directory = fresh(OUT / "minimax_m2")
    redraw(model, seed=59, bf16=False)
    correction_biases(model, 61)
    family_fixture(model, directory)


def defaults() -> None:
    directory = fresh(OUT / "defaults")
    (directory / "minimax_m2.json").write_text(MiniMaxM2Config().to_json_string())


BUILDERS = {"minimax_m2": minimax_m2, "defaults": defaults}


def main(names: list[str]) -> None:
    run_builders(BUILDERS, OUT, names)


if __name__ == "__main__":
    main(sys.argv[1:])
