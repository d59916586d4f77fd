"""Writes tests/fixtures/deltanet/: transformers' gated DeltaNet, the reference for maxshard's
layers/gated_deltanet.py and layers/delta_rule.py.

Run once, by hand, in a venv of its own: torch and transformers are never dependencies of maxshard or its CI.

    /work/refvenv/bin/python tools/make_deltanet_fixtures.py

Everything is float32 on CPU, seeded. Files (numpy .npz, a few KB each):

  qwen3_next.npz  a tiny random `Qwen3NextGatedDeltaNet` (fused projections in_proj_qkvz, in_proj_ba, grouped per
                  key head): its config numbers (`config/...`), its weights under their transformers names
                  (`weight/...`), an input `x` [2, 11, 16] and the layer's output `out` (no cache).
  qwen3_5.npz     the same for `Qwen3_5GatedDeltaNet` (separate in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
  rule.npz        transformers' `torch_chunk_gated_delta_rule` (chunk 4) and `torch_recurrent_gated_delta_rule` on
                  random q, k [2, 11, 2, 8], v [2, 11, 4, 6], g, beta [2, 11, 4] and an initial state [2, 4, 8, 6],
                  q and k L2-normalised inside (use_qk_l2norm_in_kernel): outputs and final states of each.

Weights are redrawn larger than transformers' default init (std 0.15; the gated norm's weight 1 +- 0.1; A_log as
transformers draws it), so every part of the layer moves the output.
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextGatedDeltaNet, torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deltanet"
SIZES = dict(hidden_size=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=4,
             num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32)
BATCH, LENGTH = 2, 11


def redraw(layer: torch.nn.Module, seed: int) -> None:
    """Weights of a useful scale: std 0.15 noise, the norm's weight 1 +- 0.1; A_log kept as drawn."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                continue
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name == "norm.weight" else 0.15 * noise)


def layer_fixture(layer: torch.nn.Module, config: object, seed: int) -> dict[str, np.ndarray]:
    layer.eval()
    redraw(layer, seed)
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((BATCH, LENGTH, SIZES["hidden_size"]))
                         .astype(np.float32))
    with torch.no_grad():
        out = layer(x)
    arrays = {f"weight/{name}": p.detach().numpy() for name, p in layer.named_parameters()}
    arrays |= {f"config/{key}": np.asarray(getattr(config, key)) for key in SIZES if key.startswith(("linear", "rms",
                                                                                                    "hidden"))}
    return arrays | {"x": x.numpy(), "out": out.numpy()}


def rule_fixture(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hk, hv, dk, dv = 2, 4, 8, 6

    def normal(*shape: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

    q, k, v = normal(BATCH, LENGTH, hk, dk), normal(BATCH, LENGTH, hk, dk), normal(BATCH, LENGTH, hv, dv)
    g = -torch.nn.functional.softplus(normal(BATCH, LENGTH, hv))
    beta = torch.sigmoid(normal(BATCH, LENGTH, hv))
    state = 0.1 * normal(BATCH, hv, dk, dv)
    inputs = dict(query=q, key=k, value=v, g=g, beta=beta, initial_state=state, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    chunk_out, chunk_state = torch_chunk_gated_delta_rule(**inputs, chunk_size=4)
    rec_out, rec_state = torch_recurrent_gated_delta_rule(**inputs)
    arrays = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state, chunk_out=chunk_out, chunk_state=chunk_state,
                  recurrent_out=rec_out, recurrent_state=rec_state)
    return {name: t.numpy() for name, t in arrays.items()}


def main() -> None:
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    next_config = Qwen3NextConfig(**SIZES)
    np.savez(OUT / "qwen3_next.npz", **layer_fixture(Qwen3NextGatedDeltaNet(next_config, 0), next_config, 1))
    text_config = Qwen3_5TextConfig(**SIZES)
    np.savez(OUT / "qwen3_5.npz", **layer_fixture(Qwen3_5GatedDeltaNet(text_config, 0), text_config, 2))
    np.savez(OUT / "rule.npz", **rule_fixture(3))
    for path in sorted(OUT.glob("*.npz")):
        print(path.name, path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
