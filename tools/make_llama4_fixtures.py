"""Writes tests/fixtures/llama4/: a tiny random Llama 4 text model and what transformers computes for it.

Run once, by hand, in the reference venv (torch and transformers are never dependencies of maxshard or its CI):

    /work/refvenv/bin/python tools/make_llama4_fixtures.py [NAME ...]

  llama4       Llama4ForCausalLM (model_type llama4_text), width 32, 4 layers: RoPE layers (interleaved pairs,
               Llama 3 scaling over a short original context) attend within chunks of 4 tokens and L2-normalise
               q and k; every 2nd layer has no RoPE, attends globally and scales its queries by the temperature
               log(floor((p + 1) / 4) + 1) x 0.5 + 1; every 2nd layer is a mixture of 4 experts (top-1 by sigmoid
               score, the score multiplying the expert's input) beside a shared expert, the others a dense MLP
               of intermediate_size_mlp; untied head, float32, a byte-level BPE Qwen-style tokenizer;
               generate.json: 16 greedy tokens, past several chunk boundaries.
  defaults/    Llama4TextConfig's config.json at transformers' defaults (Llama 4 Scout's shape), which the
               configs/models/llama4_scout.yml preset is checked against.

The model directory holds what `save_pretrained` writes (each MoE layer's experts stacked: gate_up_proj with the
gate columns then the up columns, down_proj) plus tokens.npy (int32 [2, 12]) and logits.npy (float32
[2, 12, vocab], positions 0..11, no padding). Weights are redrawn larger than transformers' init (std 0.15, norms
1 +- 0.1), so routing, the chunks, the norms and the temperature move the logits.
"""

from __future__ import annotations

import pathlib
import sys

from transformers import Llama4ForCausalLM, Llama4TextConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_hf_fixtures import family_fixture, fresh, redraw, run_builders  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama4"
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
             num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2,
             attention_chunk_size=4, floor_scale=4, attn_scale=0.5, use_qk_norm=True, rms_norm_eps=1e-5,
             tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0,
             rope_parameters={"rope_type": "llama3", "rope_theta": 1000.0, "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


def llama4() -> None:
    """The model's weights redrawn, its reference logits, its files, a tokenizer and 16 greedy tokens."""
    model = Llama4ForCausalLM(Llama4TextConfig(**SHAPE)).eval()
    directory = fresh(OUT / "llama4")
    redraw(model, seed=73, bf16=False)
    family_fixture(model, directory)


def defaults() -> None:
    directory = fresh(OUT / "defaults")
    (directory / "llama4_text.json").write_text(Llama4TextConfig().to_json_string())


BUILDERS = {"llama4": llama4, "defaults": defaults}


def main(names: list[str]) -> None:
    run_builders(BUILDERS, OUT, names)


if __name__ == "__main__":
    main(sys.argv[1:])
