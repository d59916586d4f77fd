"""Writes tests/fixtures/gemma4/: a tiny random Gemma 4 text model and what transformers computes for it.

Run once, by hand, in the reference venv (torch and transformers are never dependencies of maxshard or its CI):

    /work/refvenv/bin/python tools/make_gemma4_fixtures.py [NAME ...]

  gemma4       Gemma4ForCausalLM (model_type gemma4_text), width 32, 8 layers alternating sliding (window 4) and
               full attention; per-layer input embeddings of 8 features a layer; the last 4 layers reuse the keys
               and values of the last earlier layer of their type (num_kv_shared_layers), have no K/V
               projections and an MLP twice as wide (use_double_wide_mlp); the full layers' heads 16 wide
               (global_head_dim, written as per_layer_config) beside the sliding layers' 8; q/k norms with a
               scale, a value norm without one, softmax scale 1; sandwich norms that multiply by their weight;
               a scalar a layer (the layer_scalar buffer, drawn away from 1); the full layers' proportional RoPE
               (half of each head's pairs rotate, the base 1e6 over the whole head); logits soft-capped at 15;
               tied head, float32, a byte-level BPE Qwen-style tokenizer; generate.json: 16 greedy tokens, past
               several window boundaries.
  gemma4_dense/  the shape of the releases without per-layer inputs: 6 layers, 5 sliding ones per full one by
               transformers' rule (config.json without layer_types), the full layer's values its key projection
               (attention_k_eq_v) over one key/value head 16 wide (global_head_dim, num_global_key_value_heads),
               no per-layer inputs or KV sharing; otherwise as gemma4.
  gemma4_moe/  gemma4_dense's shape with the MoE block (enable_moe_block): beside each layer's MLP 4 experts 16 wide,
               2 a token, the router's scale drawn about 1 and its per-expert scale in 0.5..1.5.
  gemma4_mm/   gemma4's text model inside Gemma4ForConditionalGeneration (a 1-layer vision tower beside it, no
               audio tower), as Google publishes Gemma 4: the same weights, so the same text-only logits.
  defaults/    Gemma4TextConfig's config.json at transformers' defaults.

The model directory holds what `save_pretrained` writes plus tokens.npy (int32 [2, 12]) and logits.npy (float32
[2, 12, vocab], positions 0..11, no padding). Weights are redrawn larger than transformers' init (std 0.15, norms
1 +- 0.1), so every piece moves the logits.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

import numpy as np
import torch
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_hf_fixtures import family_fixture, fresh, redraw, reference, run_builders  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gemma4"
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, global_head_dim=16, max_position_embeddings=256,
             layer_types=["sliding_attention", "full_attention"] * 4, sliding_window=4,
             final_logit_softcapping=15.0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
             num_kv_shared_layers=4, use_double_wide_mlp=True, rms_norm_eps=1e-6, tie_word_embeddings=True,
             bos_token_id=None, eos_token_id=0, pad_token_id=0,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                 "rope_theta": 1000000.0}})


def layer_scalars(model: torch.nn.Module, seed: int) -> None:
    """Each layer's layer_scalar buffer 0.5 .. 1.5: a buffer, so `redraw` leaves it at 1, where it would not be
    checked."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))


def gemma4() -> None:
    """The model's weights redrawn, its reference logits, its files, a tokenizer and 16 greedy tokens."""
    model = Gemma4ForCausalLM(Gemma4TextConfig(**SHAPE)).eval()
    directory = fresh(OUT / "gemma4")
    redraw(model, seed=79, bf16=False)
    layer_scalars(model, seed=75)
    family_fixture(model, directory)


# The shape of the releases without per-layer inputs (31B-like): 5 sliding layers per full one by transformers' rule
# (no layer_types given), the full layers' values their key projection (attention_k_eq_v) over one key/value head
# 16 wide (global_head_dim, num_global_key_value_heads), no KV sharing
DENSE = {**{k: v for k, v in SHAPE.items() if k not in ("layer_types", "num_kv_shared_layers", "use_double_wide_mlp")},
         "num_hidden_layers": 6, "hidden_size_per_layer_input": 0, "attention_k_eq_v": True,
         "num_global_key_value_heads": 1}


def gemma4_dense() -> None:
    model = Gemma4ForCausalLM(Gemma4TextConfig(**DENSE)).eval()
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert model.model.layers[5].self_attn.v_proj is None and model.model.layers[5].self_attn.k_proj.out_features == 16
    directory = fresh(OUT / "gemma4_dense")
    redraw(model, seed=81, bf16=False)
    layer_scalars(model, seed=77)
    family_fixture(model, directory)


# gemma4_dense with the MoE block beside every layer's MLP (26B-A4B-like)
MOE = {**DENSE, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16}


def gemma4_moe() -> None:
    model = Gemma4ForCausalLM(Gemma4TextConfig(**MOE)).eval()
    assert model.model.layers[0].experts.gate_up_proj.shape == (4, 32, 32)  # [experts, 2 x 16, hidden]
    directory = fresh(OUT / "gemma4_moe")
    redraw(model, seed=83, bf16=False)
    layer_scalars(model, seed=85)
    gen = torch.Generator().manual_seed(87)
    with torch.no_grad():  # redraw gives them kernels' scale; as trained they are about 1 (scale) and positive
        for layer in model.model.layers:
            layer.router.scale.copy_(1 + 0.1 * torch.randn(layer.router.scale.shape, generator=gen))
            layer.router.per_expert_scale.copy_(0.5 + torch.rand(layer.router.per_expert_scale.shape, generator=gen))
    family_fixture(model, directory)


def gemma4_multimodal() -> None:
    """gemma4's text model in the multimodal wrapper, which holds it as model.language_model.*."""
    text = Gemma4ForCausalLM.from_pretrained(OUT / "gemma4", dtype=torch.float32).eval()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
    text_config = {k: v for k, v in text.config.to_dict().items() if k not in ("architectures", "_name_or_path")}
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text_config, vision_config=vision,
                                                        audio_config=None)).eval()
    with torch.no_grad():
        model.model.language_model.load_state_dict(
            {k.removeprefix("model."): v for k, v in text.state_dict().items() if k.startswith("model.")})
    directory = fresh(OUT / "gemma4_mm")
    logits = reference(model, directory)
    np.testing.assert_allclose(logits, np.load(OUT / "gemma4" / "logits.npy"), rtol=0, atol=1e-5)  # same model
    model.save_pretrained(directory)
    reloaded = Gemma4ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    for name, tensor in text.state_dict().items():  # what was saved is the text model, under the wrapper
        if name.startswith("model."):
            assert torch.equal(reloaded.model.language_model.state_dict()[name.removeprefix("model.")], tensor), name
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(OUT / "gemma4" / name, directory / name)


def defaults() -> None:
    directory = fresh(OUT / "defaults")
    (directory / "gemma4_text.json").write_text(Gemma4TextConfig().to_json_string())


BUILDERS = {"gemma4": gemma4, "gemma4_dense": gemma4_dense, "gemma4_moe": gemma4_moe, "gemma4_mm": gemma4_multimodal,
            "defaults": defaults}


def main(names: list[str]) -> None:
    run_builders(BUILDERS, OUT, names)


if __name__ == "__main__":
    main(sys.argv[1:])
