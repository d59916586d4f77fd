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
  llama4_mm/   llama4's text model inside Llama4ForConditionalGeneration (a 1-layer vision tower beside it), as
               Meta publishes Llama 4: the same weights, so the same text-only logits.
  rope_step.json  transformers' llama3-scaled inverse frequencies at equal low and high frequency factors (no
               blended band, a step at the original context) for a 128-wide head, the parameters beside them.
  defaults/    Llama4TextConfig's config.json at transformers' defaults (Llama 4 Scout's shape), which the
               configs/models/llama4_scout.yml preset is checked against.

The model directory holds what `save_pretrained` writes (each MoE layer's experts stacked: gate_up_proj with the
gate columns then the up columns, down_proj) plus tokens.npy (int32 [2, 12]) and logits.npy (float32
[2, 12, vocab], positions 0..11, no padding). Weights are redrawn larger than transformers' init (std 0.15, norms
1 +- 0.1), so routing, the chunks, the norms and the temperature move the logits.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
from transformers import Llama4Config, Llama4ForCausalLM, Llama4ForConditionalGeneration, Llama4TextConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_hf_fixtures import family_fixture, fresh, redraw, reference, run_builders  # noqa: E402

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


def llama4_multimodal() -> None:
    """llama4's text model in the multimodal wrapper, which holds it as language_model.*."""
    text = Llama4ForCausalLM.from_pretrained(OUT / "llama4", dtype=torch.float32).eval()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    text_config = {k: v for k, v in text.config.to_dict().items() if k not in ("architectures", "_name_or_path")}
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text_config, vision_config=vision)).eval()
    with torch.no_grad():
        model.language_model.load_state_dict(text.state_dict())
    directory = fresh(OUT / "llama4_mm")
    # transformers 5.24's wrapper forward fails on text alone (it reads image_outputs from the language model's
    # output), so the reference is its language model's, which that forward returns for text
    logits = reference(model.language_model, directory)
    np.testing.assert_allclose(logits, np.load(OUT / "llama4" / "logits.npy"), rtol=0, atol=1e-5)  # same model
    model.save_pretrained(directory)
    reloaded = Llama4ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    for name, tensor in text.state_dict().items():  # what was saved is the text model, under the wrapper
        assert torch.equal(reloaded.language_model.state_dict()[name], tensor), name
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(OUT / "llama4" / name, directory / name)


ROPE_STEP = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
             "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}


def rope_step() -> None:
    """transformers' frequencies for ROPE_STEP (it warns that high should exceed low, and computes them)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Llama4TextConfig(head_dim=128, rope_parameters=dict(ROPE_STEP))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    record = {"rope_parameters": ROPE_STEP, "head_dim": 128, "inv_freq": inv_freq.double().tolist()}
    (OUT / "rope_step.json").write_text(json.dumps(record) + "\n")


def defaults() -> None:
    directory = fresh(OUT / "defaults")
    (directory / "llama4_text.json").write_text(Llama4TextConfig().to_json_string())


BUILDERS = {"llama4": llama4, "llama4_mm": llama4_multimodal, "rope_step": rope_step, "defaults": defaults}


def main(names: list[str]) -> None:
    run_builders(BUILDERS, OUT, names)


if __name__ == "__main__":
    main(sys.argv[1:])
