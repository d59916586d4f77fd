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
import shutil
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, MiniMaxM2Config, MiniMaxM2ForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_hf_fixtures import correction_biases, greedy, qwen_tokenizer, redraw, reference  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "minimax_m2"
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_local_experts=8,
             num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0,
             pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})


def fresh(name: str) -> pathlib.Path:
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def minimax_m2() -> None:
    """The model's weights and correction biases redrawn, its reference logits, its files, a tokenizer and 16
    greedy tokens."""
    model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**SHAPE)).eval()
    directory = fresh("minimax_m2")
    redraw(model, seed=59, bf16=False)
    correction_biases(model, 61)
    reference(model, directory)
    model.save_pretrained(directory)
    tok = qwen_tokenizer()
    tok.save_pretrained(directory)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 0, 0
    model.generation_config.save_pretrained(directory)
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        again = reloaded(torch.from_numpy(np.load(directory / "tokens.npy").astype(np.int64))).logits.numpy()
    np.testing.assert_array_equal(again, np.load(directory / "logits.npy"))  # what was saved is what was run
    greedy(reloaded, tok, directory)


def defaults() -> None:
    directory = fresh("defaults")
    (directory / "minimax_m2.json").write_text(MiniMaxM2Config().to_json_string())


BUILDERS = {"minimax_m2": minimax_m2, "defaults": defaults}


def main(names: list[str]) -> None:
    for name in names or list(BUILDERS):
        BUILDERS[name]()
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main(sys.argv[1:])
