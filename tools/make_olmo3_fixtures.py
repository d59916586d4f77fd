"""Writes tests/fixtures/olmo3/: a tiny random OLMo 3 model and what transformers computes for it.

Run once, by hand, in the reference venv (torch and transformers are never dependencies of maxshard or its CI):

    /work/refvenv/bin/python tools/make_olmo3_fixtures.py [NAME ...]

  olmo3        Olmo3ForCausalLM, width 32: 4 layers by transformers' rule (3 sliding_attention, window 4, shorter
               than the 12-token text and than prompt + generation, then 1 full_attention), norms after attention
               and after the MLP only, q/k RMSNorm over all heads (q_norm [4 x 8], k_norm [2 x 8]), RoPE per layer
               type in rope_parameters (full layers: base 1000 with YaRN x4 over an original context of 64; sliding
               layers: base 50, unscaled), untied head, float32, a byte-level BPE Qwen-style tokenizer;
               generate.json: 16 greedy tokens past the window.
  defaults/    Olmo3Config's config.json at transformers' defaults (its docstring's 7B shape), which the
               configs/models/olmo3_7b.yml preset is checked against.

The model directory holds what `save_pretrained` writes plus tokens.npy (int32 [2, 12]) and logits.npy (float32
[2, 12, vocab], positions 0..11, no padding). Weights are redrawn larger than transformers' init (std 0.15, norms
1 +- 0.1), so the window, the per-type RoPE and the norms move the logits.
"""

from __future__ import annotations

import json
import pathlib
import sys

from transformers import Olmo3Config, Olmo3ForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_hf_fixtures import NEW_TOKENS, family_fixture, fresh, redraw, run_builders  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "olmo3"
ROPE = {"full_attention": {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                           "original_max_position_embeddings": 64},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=4, rms_norm_eps=1e-6,
             rope_parameters=ROPE, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0)


def olmo3() -> None:
    """The model's weights redrawn, its reference logits, its files, a tokenizer and 16 greedy tokens."""
    config = Olmo3Config(**SHAPE)
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    model = Olmo3ForCausalLM(config).eval()
    directory = fresh(OUT / "olmo3")
    redraw(model, seed=53, bf16=False)
    family_fixture(model, directory)
    record = json.loads((directory / "generate.json").read_text())
    assert len(record["input_ids"]) + NEW_TOKENS > 2 * SHAPE["sliding_window"]  # generation runs past the window


def defaults() -> None:
    directory = fresh(OUT / "defaults")
    (directory / "olmo3.json").write_text(Olmo3Config().to_json_string())


BUILDERS = {"olmo3": olmo3, "defaults": defaults}


def main(names: list[str]) -> None:
    run_builders(BUILDERS, OUT, names)


if __name__ == "__main__":
    main(sys.argv[1:])
