"""Writes tests/fixtures/mla/: YaRN's numbers and DeepSeek-V3's latent attention as transformers computes them.

Run once, by hand, in a venv with torch and transformers (never dependencies of maxshard or its CI):

    /work/trlvenv/bin/python tools/make_mla_fixtures.py

  yarn.json       per case, transformers' YaRN inverse frequencies and cos/sin factor (`_compute_yarn_parameters`,
                  the function every model's rotary embedding calls for `rope_type: yarn`) and the softmax scale
                  DeepseekV3Attention uses (`scaling`): DeepSeek-V3's own constants (factor 40, both mscales 1,
                  64 RoPE features), a case with two different mscales (the cos/sin factor is their ratio), and a
                  Qwen2-style grouped-query case (no mscale: factor 0.1 ln(factor) + 1, head_dim 128).
  attention.npz   DeepseekV3Attention (eager, float32, causal, rope_interleave: DeepSeek's interleaved RoPE pairs)
                  on random weights with YaRN at a short original context, once with a low-rank query
                  (q_lora_rank 16) and once with a plain query projection; and Qwen3Attention (grouped-query, 4 query
                  / 2 kv heads, q/k norm) with Qwen's YaRN (no mscale): `{case}/{param}` weights as transformers
                  names them ([out, in]), `{case}/x` [2, 12, 32] inputs and `{case}/out` its output, positions 0..11.
                  attention.json holds both configs.

The shapes are the smallest that exercise everything: 4 heads, qk_nope 8, qk_rope 4, v 6 (query/key heads wider
than value heads), kv_lora_rank 8, YaRN factor 4 over an original context of 8 positions.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
from transformers import DeepseekV3Config, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mla"
YARN_CASES = {
    "deepseek_v3": dict(family="deepseek", rope_dim=64, theta=10000.0, factor=40.0, original=4096, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    "two_mscales": dict(family="deepseek", rope_dim=16, theta=10000.0, factor=16.0, original=64, beta_fast=16.0,
                        beta_slow=2.0, mscale=0.707, mscale_all_dim=1.3),
    "qwen_gqa": dict(family="qwen2", rope_dim=128, theta=1000000.0, factor=4.0, original=32768, beta_fast=32.0,
                     beta_slow=1.0, mscale=None, mscale_all_dim=None),
}
ATTENTION = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-6, max_position_embeddings=32,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 50.0, "factor": 4.0,
                                  "original_max_position_embeddings": 8, "beta_fast": 4.0, "beta_slow": 1.0,
                                  "mscale": 0.9, "mscale_all_dim": 1.1})
QWEN3 = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
             max_position_embeddings=32, rope_parameters={"rope_type": "yarn", "rope_theta": 50.0, "factor": 4.0,
                                                          "original_max_position_embeddings": 8})


def yarn_case(c: dict) -> dict:
    rope = {"rope_type": "yarn", "rope_theta": c["theta"], "factor": c["factor"],
            "original_max_position_embeddings": c["original"], "beta_fast": c["beta_fast"],
            "beta_slow": c["beta_slow"]}
    if c["mscale"] is not None:
        rope.update(mscale=c["mscale"], mscale_all_dim=c["mscale_all_dim"])
    if c["family"] == "deepseek":
        config = DeepseekV3Config(qk_rope_head_dim=c["rope_dim"], qk_nope_head_dim=128, hidden_size=64,
                                  num_attention_heads=4, max_position_embeddings=int(c["original"] * c["factor"]),
                                  rope_parameters=rope)
        scaling = DeepseekV3Attention(config, 0).scaling
        width = config.qk_head_dim
    else:
        config = Qwen2Config(hidden_size=c["rope_dim"] * 4, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=int(c["original"] * c["factor"]), rope_parameters=rope)
        width = c["rope_dim"]
        scaling = width**-0.5  # Qwen2Attention: head_dim ** -0.5, no mscale
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    return {**c, "width": width, "inv_freq": inv_freq.double().tolist(), "attention_factor": float(attention_factor),
            "softmax_scale": float(scaling)}


def attention_case(q_lora_rank: int | None, seed: int, qwen3: bool = False) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    if qwen3:
        config = Qwen3Config(**QWEN3)
        config._attn_implementation = "eager"
        layer, rotary = Qwen3Attention(config, 0).eval(), Qwen3RotaryEmbedding(config)
    else:
        config = DeepseekV3Config(**ATTENTION, q_lora_rank=q_lora_rank, rope_interleave=True)
        config._attn_implementation = "eager"
        layer, rotary = DeepseekV3Attention(config, 0).eval(), DeepseekV3RotaryEmbedding(config)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.3 * torch.randn(p.shape))
        x = torch.randn(2, 12, config.hidden_size)
        positions = torch.arange(12)[None].expand(2, 12)
        cos_sin = rotary(x, positions)
        causal = torch.full((12, 12), torch.finfo(torch.float32).min).triu(1)[None, None]
        out, _ = layer(x, cos_sin, causal)
    arrays = {name: p.detach().numpy() for name, p in layer.named_parameters()}
    return {**arrays, "x": x.numpy(), "out": out.numpy()}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "yarn.json").write_text(json.dumps({k: yarn_case(c) for k, c in YARN_CASES.items()}, indent=1) + "\n")
    arrays = {}
    for case, rank, seed in (("q_lora", 16, 0), ("plain_query", None, 1)):
        arrays.update({f"{case}/{k}": v for k, v in attention_case(rank, seed).items()})
    arrays.update({f"qwen3_yarn/{k}": v for k, v in attention_case(None, 2, qwen3=True).items()})
    np.savez(OUT / "attention.npz", **arrays)
    (OUT / "attention.json").write_text(json.dumps({"deepseek_v3": ATTENTION, "qwen3_yarn": QWEN3}, indent=1) + "\n")
    print(f"wrote {OUT}: {sorted(p.name for p in OUT.iterdir())}")


if __name__ == "__main__":
    main()
