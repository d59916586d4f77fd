"""MoE with biases and GPT-OSS's clamped SwiGLU (`moe_bias`, `mlp_activation=clamped_swiglu`, layers/moe.py).

Reference: a loop over tokens and their k chosen experts in numpy (float64), as transformers' GptOssMLP computes it:
router logits x @ W + b, the top k logits, a softmax over those k, and each chosen expert's
`(act(x @ wi_0 + bi_0, x @ wi_1 + bi_1) @ wo + bo)` weighted by it. Every MoE path (all-experts dense, grouped tiled
and ragged_dot, token dropping with a capacity no routing fills) equals it within 1e-5 (float32, random biases,
inputs large enough that the clamp binds); under expert=4 x fsdp=2 (both exchanges) the output and every gradient
equal the single-device ones.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import moe
from maxshard.parallel import sharding
from maxshard.training.step import mesh_context
from tests.helpers import layout_overrides, max_relative_difference, mesh_for, tiny_config

LAYER = ModelConfig(vocab_size=128, emb_dim=16, mlp_dim=24, num_experts=8, num_experts_per_tok=2,
                    capacity_factor=-1.0, moe_bias=True, mlp_activation="clamped_swiglu", swiglu_limit=1.5)
BATCH, LENGTH = 8, 8


def _block(cfg: ModelConfig) -> moe.MoEBlock:
    return moe.MoEBlock(cfg, jnp.float32, jnp.float32)


def _apply(cfg: ModelConfig, params: dict, x: jax.Array, segments: jax.Array) -> jax.Array:
    return _block(cfg).apply({"params": params}, x, segments, mutable=[moe.STATS_COLLECTION])[0]


def _reference(p: dict, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """transformers' GPT-OSS MoE, one token and one chosen expert at a time, float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    limit, alpha, k = cfg.swiglu_limit, cfg.swiglu_alpha, cfg.num_experts_per_tok
    out = np.zeros(x.shape, np.float64)
    for index in np.ndindex(*x.shape[:-1]):
        t = x[index].astype(np.float64)
        logits = t @ p["gate"]["kernel"] + p["gate"]["bias"]
        top = np.argsort(-logits)[:k]
        weights = np.exp(logits[top] - logits[top].max())
        for e, w in zip(top, weights / weights.sum()):
            gate = np.minimum(t @ p["wi_0"][e] + p["bi_0"][e], limit)
            up = np.clip(t @ p["wi_1"][e] + p["bi_1"][e], -limit, limit)
            hidden = gate / (1 + np.exp(-alpha * gate)) * (up + 1)
            out[index] += w * (hidden @ p["wo"][e] + p["bo"][e])
    return out


@pytest.fixture(scope="module")
def case():
    """Random parameters with every bias nonzero (init makes them zero), inputs, and the reference output."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(BATCH, LENGTH, LAYER.emb_dim)) * 2.0, jnp.float32)
    segments = jnp.ones((BATCH, LENGTH), jnp.int32)
    shapes = nn.unbox(jax.eval_shape(lambda: _block(LAYER).init(jax.random.key(0), x[:1], segments[:1]))["params"])
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.5, jnp.float32), shapes)
    return params, x, segments, _reference(params, np.asarray(x), LAYER)


def test_biases_are_params_with_logical_axes():
    """Router bias [experts], expert biases [experts, mlp] x 2 and [experts, embed], sharded by the kernels' rules."""
    boxed = jax.eval_shape(lambda: _block(LAYER).init(jax.random.key(0), jnp.zeros((1, 4, 16)),
                                                      jnp.ones((1, 4), jnp.int32)))["params"]
    axes = {name: boxed[name].names for name in ("bi_0", "bi_1", "bo")}
    assert axes == {"bi_0": ("exp", "mlp"), "bi_1": ("exp", "mlp"), "bo": ("exp", "embed")}
    assert boxed["gate"]["bias"].value.shape == (8,)
    assert "bi_0" not in jax.eval_shape(lambda: _block(dataclasses.replace(LAYER, moe_bias=False)).init(
        jax.random.key(0), jnp.zeros((1, 4, 16)), jnp.ones((1, 4), jnp.int32)))["params"]


@pytest.mark.parametrize("impl", ["dense", "tiled", "ragged_dot", "capacity"])
def test_every_implementation_equals_the_reference(impl, case):
    params, x, segments, expected = case
    cfg = (dataclasses.replace(LAYER, capacity_factor=LAYER.num_experts / LAYER.num_experts_per_tok)
           if impl == "capacity" else dataclasses.replace(LAYER, moe_dropless_impl=impl))
    got = jax.jit(lambda p, x: _apply(cfg, p, x, segments))(params, x)
    assert max_relative_difference(got, expected) < 1e-5
    if impl != "dense":
        return
    # the clamp binds somewhere, and the biases matter: without them the output moves
    assert np.max(np.abs(np.asarray(x) @ np.asarray(params["wi_1"][0]))) > LAYER.swiglu_limit
    unbiased = {**params, "bo": jnp.zeros_like(params["bo"])}
    assert max_relative_difference(jax.jit(lambda p, x: _apply(cfg, p, x, segments))(unbiased, x), expected) > 1e-2


def _grads(cfg: ModelConfig, params: dict, x: jax.Array, segments: jax.Array):
    def loss(p, x):
        y = _apply(cfg, p, x, segments)
        return jnp.sum(y * jnp.cos(3.0 * y)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


def test_expert_parallel_equals_one_device(case):
    """expert=4 x fsdp=2 (8 CPU devices): the tiled path with the fixed exchange gives the output and gradients
    (biases included) of one device; the ragged exchange and token dropping give its output."""
    params, x, segments, _ = case
    tiled = dataclasses.replace(LAYER, moe_dropless_impl="tiled")
    ref_y, ref_grads = _grads(tiled, params, x, segments)
    run = tiny_config(*layout_overrides(["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]))
    others = (dataclasses.replace(tiled, moe_exchange="ragged"),
              dataclasses.replace(LAYER, capacity_factor=LAYER.num_experts / LAYER.num_experts_per_tok))
    with mesh_context(mesh_for(run), sharding.flax_rules(run)):
        y, grads = _grads(tiled, params, x, segments)
        outputs = [jax.jit(lambda p, x, c=c: _apply(c, p, x, segments))(params, x) for c in others]
    assert max_relative_difference(y, ref_y) < 1e-5
    assert max_relative_difference(grads, ref_grads) < 1e-5
    assert float(jnp.max(jnp.abs(grads[0]["bo"]))) > 0 and float(jnp.max(jnp.abs(grads[0]["gate"]["bias"]))) > 0
    for out in outputs:
        assert max_relative_difference(out, ref_y) < 1e-5
