"""The Qwen3-Next / Qwen3.5 pieces against transformers' own modules on tiny random weights: the gated attention
(q_proj twice as wide, sigmoid(gate) on the output), partial rotary (the first quarter of each head turned, the
rest passed), the zero-centred (1 + w) RMSNorm (`norm_unit_offset`, Gemma's, reused) and the MoE with a gated shared
expert. tests/fixtures/qwen3_next/pieces.* were written by tools/make_qwen3_next_fixtures.py with transformers 5.24.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from maxshard.model.layers import rope
from maxshard.model.layers.attention import Attention
from maxshard.model.layers.moe import STATS_COLLECTION, MoEBlock
from maxshard.model.layers.norms import RMSNorm
from maxshard.spec.model_config import ModelConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "qwen3_next"
TOLERANCE = 1e-5
LENGTH = 12


@pytest.fixture(scope="module")
def hf() -> dict[str, np.ndarray]:
    return load_file(str(FIXTURES / "pieces.safetensors"))


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    """The pieces' ModelConfig, from the fields transformers' config had."""
    c = json.loads((FIXTURES / "pieces.json").read_text())
    return ModelConfig(vocab_size=128, emb_dim=c["hidden_size"], num_heads=c["num_attention_heads"],
                       num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], norm_epsilon=c["rms_norm_eps"],
                       qk_norm=True, norm_unit_offset=True, attention_output_gate=True,
                       partial_rotary_factor=c["rope_parameters"]["partial_rotary_factor"],
                       rope_max_timescale=c["rope_parameters"]["rope_theta"], num_experts=c["num_experts"],
                       num_experts_per_tok=c["num_experts_per_tok"], moe_mlp_dim=c["moe_intermediate_size"],
                       num_shared_experts=c["shared_expert_intermediate_size"] // c["moe_intermediate_size"],
                       shared_expert_gate=True, moe_renormalize_top_k=c["norm_topk_prob"], capacity_factor=-1.0,
                       max_target_length=LENGTH)


def linear(weight: np.ndarray, *shape: int) -> np.ndarray:
    """A torch Linear weight [out, in] as a maxshard kernel [in, *out dims] (`shape`: the kernel's shape)."""
    return weight.T.reshape(shape)


def positions() -> jax.Array:
    return jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (2, LENGTH))


def attention_params(hf: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    e, h, kv, d = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = {k.removeprefix("attention."): v for k, v in hf.items() if k.startswith("attention.")}
    return {"query": {"kernel": linear(a["q_proj.weight"], e, h, 2 * d)},
            "key": {"kernel": linear(a["k_proj.weight"], e, kv, d)},
            "value": {"kernel": linear(a["v_proj.weight"], e, kv, d)},
            "out": {"kernel": linear(a["o_proj.weight"], h, d, e)},
            "query_norm": {"scale": a["q_norm.weight"]}, "key_norm": {"scale": a["k_norm.weight"]}}


def run_attention(cfg: ModelConfig, params: dict, x: np.ndarray) -> np.ndarray:
    layer = Attention(cfg, jnp.float32, jnp.float32)
    seg = jnp.ones((2, LENGTH), jnp.int32)
    return np.asarray(jax.jit(lambda p: layer.apply({"params": p}, jnp.asarray(x), seg, positions()))(params))


def test_gated_attention_with_partial_rotary_is_transformers(hf, cfg):
    """Qwen3NextAttention: each head's [query, gate] from one q_proj, (1 + w) q/k norms, RoPE on 8 of 32 features,
    sigmoid(gate) times the output before o_proj; without the gate, or with RoPE on the whole head, the output
    is far off."""
    params = attention_params(hf, cfg)
    got = run_attention(cfg, params, hf["x"])
    want = hf["attention.out"]
    assert np.std(want) > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    ungated = dataclasses.replace(cfg, attention_output_gate=False)
    plain = {**params, "query": {"kernel": params["query"]["kernel"][..., : cfg.head_dim]}}
    assert np.max(np.abs(run_attention(ungated, plain, hf["x"]) - want)) > 100 * TOLERANCE
    whole = dataclasses.replace(cfg, partial_rotary_factor=1.0)
    assert np.max(np.abs(run_attention(whole, params, hf["x"]) - want)) > 100 * TOLERANCE


def test_partial_rotary_turns_the_first_features_in_halves_of_that_part(hf, cfg):
    """apply_rotary_pos_emb with partial_rotary_factor 0.25: the pairs are (i, i + 4) of the first 8 features, the
    other 24 pass unchanged; maxshard's rotary_dim and frequencies give the same."""
    assert rope.rotary_dim(cfg) == 8 and rope.frequencies_for(cfg).shape == (4,)
    q = np.swapaxes(hf["rope.q"], 1, 2)  # transformers' [batch, heads, length, dim] -> [batch, length, heads, dim]
    got = np.asarray(rope.apply_rope(jnp.asarray(q), positions(), rope.frequencies_for(cfg)))
    want = np.swapaxes(hf["rope.out"], 1, 2)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
    np.testing.assert_array_equal(got[..., 8:], q[..., 8:])
    assert np.max(np.abs(got[..., :8] - q[..., :8])) > 0.1


def test_zero_centred_norm_is_norm_unit_offset(hf, cfg):
    """Qwen3NextRMSNorm (weights at 0, x * (1 + w) in float32) is the RMSNorm of `norm_unit_offset` (Gemma's)."""
    norm = RMSNorm(cfg.norm_epsilon, jnp.float32, jnp.float32, unit_offset=True)
    params = nn.unbox(norm.init(jax.random.key(0), hf["x"])["params"])
    assert np.all(np.asarray(params["scale"]) == 0)  # (1 + 0): the identity scale at init, as transformers' zeros
    got = np.asarray(norm.apply({"params": {"scale": hf["norm.weight"]}}, hf["x"]))
    np.testing.assert_allclose(got, hf["norm.out"], rtol=0, atol=TOLERANCE)


def moe_params(hf: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """transformers 5's fused experts (gate_up_proj [experts, 2 x mlp, embed], down_proj [experts, embed, mlp]) as
    maxshard's wi_0, wi_1 [experts, embed, mlp] and wo [experts, mlp, embed]."""
    m = {k.removeprefix("moe."): v for k, v in hf.items() if k.startswith("moe.")}
    gate_up = np.swapaxes(m["experts.gate_up_proj"], 1, 2)  # [experts, embed, 2 x mlp]
    width = cfg.expert_dim
    return {"gate": {"kernel": m["gate.weight"].T}, "wi_0": gate_up[..., :width], "wi_1": gate_up[..., width:],
            "wo": np.swapaxes(m["experts.down_proj"], 1, 2),
            "shared": {name: {"kernel": m[f"shared_expert.{hf_name}.weight"].T}
                       for name, hf_name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))},
            "shared_gate": {"kernel": m["shared_expert_gate.weight"].T}}


def run_moe(cfg: ModelConfig, params: dict, x: np.ndarray) -> np.ndarray:
    block = MoEBlock(cfg, jnp.float32, jnp.float32)
    seg = jnp.ones((2, LENGTH), jnp.int32)
    out, _ = jax.jit(lambda p: block.apply({"params": p}, jnp.asarray(x), seg, mutable=[STATS_COLLECTION]))(params)
    return np.asarray(out)


def test_moe_with_a_gated_shared_expert_is_transformers(hf, cfg):
    """Qwen3NextSparseMoeBlock: top-2 of 4 renormalised, plus the shared expert (width 32: num_shared_experts 2 of
    16) times sigmoid(shared_expert_gate(x)); the same block without the gate is far off."""
    params = moe_params(hf, cfg)
    want = hf["moe.out"]
    np.testing.assert_allclose(run_moe(cfg, params, hf["x"]), want, rtol=0, atol=TOLERANCE)
    ungated = dataclasses.replace(cfg, shared_expert_gate=False)
    plain = {k: v for k, v in params.items() if k != "shared_gate"}
    assert np.max(np.abs(run_moe(ungated, plain, hf["x"]) - want)) > 100 * TOLERANCE


def test_the_gate_parameters_have_their_shapes_and_axes(cfg):
    """The query kernel is [embed, heads, 2 x head_dim] under the query's logical axes (heads shard over tensor as
    before); the shared gate is [embed, 1]."""
    x, seg = jnp.zeros((1, LENGTH, cfg.emb_dim)), jnp.ones((1, LENGTH), jnp.int32)
    attn = jax.eval_shape(lambda: Attention(cfg, jnp.float32, jnp.float32).init(jax.random.key(0), x, seg,
                                                                                 positions()[:1]))["params"]
    assert attn["query"]["kernel"].value.shape == (cfg.emb_dim, cfg.num_heads, 2 * cfg.head_dim)
    assert attn["query"]["kernel"].names == ("embed", "heads", "kv")
    moe = jax.eval_shape(lambda: MoEBlock(cfg, jnp.float32, jnp.float32).init(jax.random.key(0), x, seg))["params"]
    assert moe["shared_gate"]["kernel"].value.shape == (cfg.emb_dim, 1)
