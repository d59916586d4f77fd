"""Writes tests/fixtures/qwen3_next/: the Qwen3-Next / Qwen3.5 family's pieces and tiny models, with what
transformers computes for them.

Run once, by hand, in the reference venv (torch and transformers are never dependencies of maxshard or its CI):

    /work/refvenv/bin/python tools/make_qwen3_next_fixtures.py [NAME ...]

  pieces.safetensors + pieces.json   transformers' own modules on tiny random weights, each with its input and
               output (float32): `attention.*` Qwen3NextAttention (gated: q_proj twice as wide, per head [query,
               gate]; partial rotary 0.25 of head_dim 32; q/k (1 + w) norms; 4 query / 2 kv heads) over positions
               0..11 of 2 rows, causal; `rope.*` apply_rotary_pos_emb's query for the same positions (rotary part 8
               of 32 features); `norm.*` Qwen3NextRMSNorm (1 + w); `moe.*` Qwen3NextSparseMoeBlock (4 experts,
               top-2 renormalised, a shared expert of width 32 = 2 x moe_intermediate_size 16, its sigmoid gate).
  qwen3_next   Qwen3NextForCausalLM, width 32: 4 layers, 3 linear_attention (gated DeltaNet: 2 key heads, 4 value
               heads of 8, conv 4) then 1 full_attention (gated, partial rotary 0.25 of head_dim 16), every layer MoE
               as pieces', untied head, bfloat16, a byte-level BPE Qwen tokenizer; generate.json: 16 greedy tokens.
  qwen3_5_text Qwen3_5ForCausalLM (model_type qwen3_5_text): the same hybrid layout with a dense SwiGLU MLP and
               Qwen3.5's separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, float32, mRoPE sections in
               rope_parameters as released (plain RoPE for text).
  qwen3_5_moe_text  Qwen3_5MoeForCausalLM: qwen3_5_text's attention with the gated-shared-expert MoE, bfloat16.
  defaults/    each config class's config.json at transformers' defaults (the published sizes' shapes its docstrings
               name), which the configs/models/ presets are checked against.
  qwen3_5_mm   Qwen3_5ForConditionalGeneration (how Qwen publishes Qwen3.5) around qwen3_5_text's weights with a
               one-block vision tower; logits.npy is the wrapper's text-only forward (qwen3_5_text's, checked).

Each model directory holds what `save_pretrained` writes plus tokens.npy (int32 [2, 12]) and logits.npy (float32
[2, 12, vocab], positions 0..11, no padding). Weights are redrawn larger than transformers' init (std 0.15; (1 + w)
norms at 0 +- 0.1, the DeltaNet's gated norm at 1 +- 0.1), so the gates, the rotary part and the routing move the
logits. The tensor names are transformers 5.24's save format (experts one by one).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                          Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig,
                          Qwen3NextForCausalLM)
from transformers.models.qwen3_next import modeling_qwen3_next as qn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_hf_fixtures import NEW_TOKENS, greedy, qwen_tokenizer, reference  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen3_next"
VOCAB = 128
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, layer_types=LAYER_TYPES,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25})
# Qwen3.5's released configs carry mRoPE's sections (for image positions); text positions are equal on its three
# axes, where mRoPE is plain RoPE, and the converter accepts them so
MROPE = {"mrope_section": [1, 1, 0], "mrope_interleaved": True}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)


def redraw(model: torch.nn.Module, seed: int, bf16: bool = False) -> None:
    """std 0.15 weights; norms multiplying by (1 + w) at 0 +- 0.1, the DeltaNet's gated norm (w itself) at 1 +- 0.1;
    bfloat16-representable when the fixture is stored in bfloat16, so the float32 reference is the stored model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)
            if bf16:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))


def fresh(name: str) -> pathlib.Path:
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def save_model(model: torch.nn.Module, name: str, seed: int, bf16: bool) -> pathlib.Path:
    """The model's weights redrawn, its reference logits (float32), its files (bfloat16 with `bf16`), a tokenizer
    and 16 greedy tokens."""
    directory = fresh(name)
    model.eval()
    redraw(model, seed, bf16)
    reference(model, directory)
    (model.to(torch.bfloat16) if bf16 else model).save_pretrained(directory)
    tok = qwen_tokenizer()
    tok.save_pretrained(directory)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 0, 0
    model.generation_config.save_pretrained(directory)
    reloaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        again = reloaded(torch.from_numpy(np.load(directory / "tokens.npy").astype(np.int64))).logits.numpy()
    np.testing.assert_array_equal(again, np.load(directory / "logits.npy"))  # what was saved is what was run
    greedy(reloaded, tok, directory)
    return directory


def qwen3_next() -> None:
    save_model(Qwen3NextForCausalLM(Qwen3NextConfig(**SHAPE, **MOE, norm_topk_prob=True, decoder_sparse_step=1,
                                                    intermediate_size=48)), "qwen3_next", seed=41, bf16=True)


def qwen3_5_text() -> None:
    config = Qwen3_5TextConfig(**{**SHAPE, "rope_parameters": {**SHAPE["rope_parameters"], **MROPE}},
                               intermediate_size=48)
    save_model(Qwen3_5ForCausalLM(config), "qwen3_5_text", seed=22, bf16=False)


def qwen3_5_moe_text() -> None:
    config = Qwen3_5MoeTextConfig(**{**SHAPE, "rope_parameters": {**SHAPE["rope_parameters"], **MROPE}}, **MOE)
    save_model(Qwen3_5MoeForCausalLM(config), "qwen3_5_moe_text", seed=33, bf16=True)


def qwen3_5_mm() -> None:
    """qwen3_5_text's model inside the multimodal wrapper: the same weights, so the same text-only logits."""
    text = Qwen3_5ForCausalLM.from_pretrained(OUT / "qwen3_5_text", dtype=torch.float32).eval()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, out_hidden_size=32,
                  num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)
    text_config = {k: v for k, v in text.config.to_dict().items() if k not in ("architectures", "_name_or_path")}
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text_config, vision_config=vision)).eval()
    with torch.no_grad():
        model.model.language_model.load_state_dict(text.model.state_dict())
        model.lm_head.load_state_dict(text.lm_head.state_dict())
    directory = fresh("qwen3_5_mm")
    logits = reference(model, directory)
    np.testing.assert_allclose(logits, np.load(OUT / "qwen3_5_text" / "logits.npy"), rtol=0, atol=1e-5)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(OUT / "qwen3_5_text" / name, directory / name)


def pieces() -> None:
    """Each piece's module on random weights with an input and transformers' output (module docstring)."""
    torch.manual_seed(0)
    config = Qwen3NextConfig(**{**SHAPE, "head_dim": 32, "hidden_size": 32}, **MOE, norm_topk_prob=True)
    config._attn_implementation = "sdpa"  # causal without a mask tensor
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 12, 32, generator=gen)
    positions = torch.arange(12)[None].expand(2, -1)
    cos, sin = qn.Qwen3NextRotaryEmbedding(config)(x, positions)
    tensors: dict[str, torch.Tensor] = {"x": x}

    attention = qn.Qwen3NextAttention(config, layer_idx=3).eval()
    moe = qn.Qwen3NextSparseMoeBlock(config).eval()
    norm = qn.Qwen3NextRMSNorm(32, eps=config.rms_norm_eps)
    for prefix, module in (("attention", attention), ("moe", moe), ("norm", norm)):
        redraw(module, seed=len(prefix))
        tensors |= {f"{prefix}.{k}": v for k, v in module.state_dict().items()}
    with torch.no_grad():
        tensors["attention.out"] = attention(x, (cos, sin), attention_mask=None)[0]
        tensors["moe.out"] = moe(x)
        tensors["norm.out"] = norm(x)
        q = torch.randn(2, 4, 12, 32, generator=gen)  # [batch, heads, length, head_dim], as transformers holds it
        tensors["rope.q"], tensors["rope.out"] = q, qn.apply_rotary_pos_emb(q, q, cos, sin)[0]
    OUT.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT / "pieces.safetensors")
    fields = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "rope_parameters", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "norm_topk_prob")
    (OUT / "pieces.json").write_text(json.dumps({f: getattr(config, f) for f in fields}, indent=2) + "\n")


def defaults() -> None:
    """defaults/<model_type>.json: the config.json of each config class at transformers' defaults (its docstring:
    the Qwen3-Next-80B-A3B, Qwen3.5-9B and Qwen3.5-35B-A3B style configurations), which configs/models/ presets
    are checked against."""
    (OUT / "defaults").mkdir(parents=True, exist_ok=True)
    for config, architecture in ((Qwen3NextConfig(), "Qwen3NextForCausalLM"),
                                 (Qwen3_5TextConfig(), "Qwen3_5ForCausalLM"),
                                 (Qwen3_5MoeTextConfig(), "Qwen3_5MoeForCausalLM")):
        fields = {**config.to_dict(), "architectures": [architecture]}
        fields = {k: v for k, v in fields.items() if k not in ("transformers_version", "_name_or_path")}
        (OUT / "defaults" / f"{config.model_type}.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


BUILDERS = {"pieces": pieces, "defaults": defaults, "qwen3_next": qwen3_next, "qwen3_5_text": qwen3_5_text,
            "qwen3_5_moe_text": qwen3_5_moe_text, "qwen3_5_mm": qwen3_5_mm}


def main(names: list[str]) -> None:
    for name in names or list(BUILDERS):
        BUILDERS[name]()
        print(f"wrote {OUT / name}")
    assert NEW_TOKENS == 16


if __name__ == "__main__":
    main(sys.argv[1:])
