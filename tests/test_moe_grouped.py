"""Dropless MoE with grouped matmuls (`maxshard/model/layers/moe_grouped.py`), routing groups and shared experts.

Parity: one MoE layer, forward output and gradients (of the kernels, the router and the input), grouped dropless
against the all-experts computation (`moe_dropless_impl=dense`, no mesh), float32, each leaf's error relative to
its own largest value < 1e-5, with expert parallelism 1, 2, 4 and 8 on the 8 simulated devices (fsdp fills the
rest). Compiled cost: FLOPs of the grouped layer vs the all-experts one, and temporaries of the dropping path with
`moe_group_size` at two lengths.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.errors import ConfigError
from maxshard.model import flops as model_flops
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import moe, moe_grouped
from maxshard.parallel import sharding
from maxshard.run import loading
from maxshard.training.step import mesh_context
from tests.helpers import layout_overrides, max_relative_difference, mesh_for, tiny_config

LAYER = ModelConfig(vocab_size=128, emb_dim=16, mlp_dim=32, num_experts=8, num_experts_per_tok=2,
                    capacity_factor=-1.0)
BATCH, LENGTH = 8, 16


def _block(cfg: ModelConfig) -> moe.MoEBlock:
    return moe.MoEBlock(cfg, jnp.float32, jnp.float32)


def _loss_and_grads(cfg: ModelConfig, params: dict, x: jax.Array, segments: jax.Array) -> tuple:
    """(output, gradients of a fixed nonlinear function of it w.r.t. params and x), jitted."""

    def loss(p: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, _ = _block(cfg).apply({"params": p}, x, segments, mutable=[moe.STATS_COLLECTION])
        return jnp.sum(y * jnp.cos(3.0 * y)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


@pytest.fixture(scope="module")
def reference():
    """Parameters, inputs (rows end in 0-4 padding tokens) and the all-experts output and gradients, no mesh."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(BATCH, LENGTH, LAYER.emb_dim)), jnp.float32)
    segments = jnp.asarray(np.arange(LENGTH)[None, :] < LENGTH - rng.integers(0, 5, (BATCH, 1)), jnp.int32)
    params = jax.jit(lambda r: nn.unbox(_block(LAYER).init(r, x, segments)["params"]))(jax.random.key(0))
    y, grads = _loss_and_grads(dataclasses.replace(LAYER, moe_dropless_impl="dense"), params, x, segments)
    return params, x, segments, y, grads


# --------------------------------------------------------------------------------------------- grouped matmul


@pytest.mark.parametrize("impl", moe_grouped.IMPLS)
def test_grouped_swiglu_equals_a_loop_over_experts(impl):
    """Skewed sizes (an empty expert, one expert with most rows) and rows past sum(sizes), which come out zero."""
    rng = np.random.default_rng(1)
    sizes = np.array([0, 37, 2, 1, 0, 5, 3, 0], np.int32)  # 48 of 52 rows
    x = rng.normal(size=(52, 8)).astype(np.float32)
    kernels = tuple(rng.normal(size=s).astype(np.float32) for s in ((8, 8, 12), (8, 8, 12), (8, 12, 8)))
    got = jax.jit(moe_grouped.grouped_swiglu, static_argnums=3)(x, sizes, kernels, impl)
    expected, start = np.zeros_like(x), 0
    for e, n in enumerate(sizes):
        rows = x[start:start + n]
        gate, up = rows @ kernels[0][e], rows @ kernels[1][e]
        expected[start:start + n] = (gate / (1 + np.exp(-gate)) * up) @ kernels[2][e]
        start += n
    np.testing.assert_allclose(np.asarray(got), expected, rtol=2e-5, atol=2e-4)
    assert np.all(np.asarray(got[48:]) == 0)


def test_ragged_dot_in_a_vmap_loops_instead_of_taking_a_batch_dimension():
    """Inside the pipeline's stage vmap (`_RAGGED_IN_VMAP`): XLA:TPU's ragged-dot takes no batch dimension, so the
    batch is a loop of unbatched ragged dots, forward and backward (no ragged_dot_general with lhs batch dims in the
    jaxpr; plain ragged_dot has one), with the same values and gradients."""
    rng = np.random.default_rng(2)
    sizes = jnp.asarray([[3, 0, 5, 2], [1, 6, 0, 3]], jnp.int32)  # a batch of 2, 10 rows each
    x = jnp.asarray(rng.normal(size=(2, 10, 8)), jnp.float32)
    kernels = tuple(jnp.asarray(rng.normal(size=(2, *s)), jnp.float32) for s in ((4, 8, 6), (4, 8, 6), (4, 6, 8)))

    def loss(impl: str):
        swiglu = jax.vmap(lambda x, s, k: moe_grouped.grouped_swiglu(x, s, k, impl))
        return lambda x, k: jnp.sum(jnp.cos(swiglu(x, sizes, k)))

    grads = {impl: jax.value_and_grad(loss(impl), argnums=(0, 1)) for impl in ("ragged_dot", "ragged_dot in vmap")}
    for impl, g in grads.items():  # 3 forward, 6 backward ragged dots; the loop's lhs batch dims: () (none)
        dims = list(_ragged_dot_batch_dims(jax.make_jaxpr(g)(x, kernels).jaxpr))
        assert len(dims) >= 9 and {d == ((), ()) for d in dims} == {impl != "ragged_dot"}, dims
    expected, got = (jax.jit(g)(x, kernels) for g in grads.values())
    assert max_relative_difference(got, expected) < 1e-6


def _ragged_dot_batch_dims(jaxpr: jax.extend.core.Jaxpr):
    """The (lhs, rhs) batch dimensions of every ragged_dot_general equation, in loop bodies and branches too. Read
    from the equations, not the printed jaxpr: jax 0.12 prints a sub-jaxpr that several loops share only once."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ragged_dot_general":
            yield eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers[1]
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    yield from _ragged_dot_batch_dims(getattr(sub, "jaxpr", sub))


def test_tile_bound_covers_the_worst_routing():
    """Every row on one expert, or one row on each: the tiles needed never exceed the static count."""
    for sizes in ([52, 0, 0, 0], [1, 1, 1, 49], [13, 13, 13, 13], [9, 17, 25, 1]):
        tiles = moe_grouped._tiles(jnp.asarray(sizes, jnp.int32), 52)
        assert sum(-(-n // tiles.size) for n in sizes) <= tiles.count


# --------------------------------------------------------------------------------------------- parity


EXPERT_PARALLEL = {1: ["ici_fsdp_parallelism=8"], 2: ["ici_expert_parallelism=2", "ici_fsdp_parallelism=4"],
                   4: ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"], 8: ["ici_expert_parallelism=8"]}


@pytest.mark.parametrize("experts_per_device", [8, 4, 2, 1])
def test_grouped_dropless_equals_all_experts(experts_per_device, reference):
    params, x, segments, ref_y, ref_grads = reference
    shards = LAYER.num_experts // experts_per_device
    cfg = tiny_config(*layout_overrides(EXPERT_PARALLEL[shards]))
    with mesh_context(mesh_for(cfg), sharding.flax_rules(cfg)):
        y, grads = _loss_and_grads(dataclasses.replace(LAYER, moe_dropless_impl="tiled"), params, x, segments)
    assert max_relative_difference(y, ref_y) < 1e-5
    assert max_relative_difference(grads, ref_grads) < 1e-5
    assert float(jnp.max(jnp.abs(grads[0]["gate"]["kernel"]))) > 0  # the router learns through the weights


def test_a_batch_the_mesh_does_not_divide_runs_unsharded(reference):
    """Init traces the model with a batch of 1: under expert=4 x fsdp=2 it takes the unsharded computation."""
    params, x, segments, ref_y, _ = reference
    cfg = tiny_config(*layout_overrides(EXPERT_PARALLEL[4]))
    apply = jax.jit(lambda p, x, s: _block(LAYER).apply({"params": p}, x, s, mutable=[moe.STATS_COLLECTION])[0])
    with mesh_context(mesh_for(cfg), sharding.flax_rules(cfg)):
        y = apply(params, x[:1], segments[:1])
    assert max_relative_difference(y, ref_y[:1]) < 1e-5


def test_ragged_dot_dropless_equals_all_experts(reference):
    """The accelerators' grouped matmul, on CPU lowered as a masked dense dot: same numbers, expert parallel 4."""
    params, x, segments, ref_y, ref_grads = reference
    cfg = tiny_config(*layout_overrides(EXPERT_PARALLEL[4]))
    with mesh_context(mesh_for(cfg), sharding.flax_rules(cfg)):
        y, grads = _loss_and_grads(dataclasses.replace(LAYER, moe_dropless_impl="ragged_dot"), params, x, segments)
    assert max_relative_difference(y, ref_y) < 1e-5
    assert max_relative_difference(grads, ref_grads) < 1e-5


# --------------------------------------------------------------------------------------------- compiled cost


def _compiled(cfg: ModelConfig, batch: int, length: int, grad: bool) -> jax.stages.Compiled:
    """One MoE layer (no mesh) compiled from abstract inputs: forward, or gradients w.r.t. params and input."""
    x = jax.ShapeDtypeStruct((batch, length, cfg.emb_dim), jnp.float32)
    segments = jnp.ones((batch, length), jnp.int32)
    params = jax.eval_shape(lambda: nn.unbox(_block(cfg).init(jax.random.key(0), jnp.zeros(x.shape), segments)))

    def forward(p: dict, x: jax.Array) -> jax.Array:
        return _block(cfg).apply(p, x, segments, mutable=[moe.STATS_COLLECTION])[0]

    fn = jax.grad(lambda p, x: jnp.sum(forward(p, x)), argnums=(0, 1)) if grad else forward
    return jax.jit(fn).lower(params, x).compile()


def _flops(compiled: jax.stages.Compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def test_grouped_flops_are_about_k_over_e_of_all_experts():
    """E=8, top-2: the all-experts layer computes 4x the routed expert FLOPs; the tiled grouped one about 1x
    (+ tile padding <= ~1/5 + router and sorting): forward <= 1.3 x k/E of the all-experts forward."""
    cfg = dataclasses.replace(LAYER, emb_dim=64, mlp_dim=128)
    dense, tiled = (_flops(_compiled(dataclasses.replace(cfg, moe_dropless_impl=impl), 2, 256, grad=False))
                    for impl in ("dense", "tiled"))
    routed = 2 * 256 * 2 * 3 * 2 * 64 * 128  # tokens x k x 3 matmuls x 2 x embed x mlp
    assert dense >= 4 * routed  # every expert on every token
    assert tiled <= 1.3 * 2 / 8 * dense, (tiled, dense)


def test_routing_groups_make_dispatch_memory_linear_in_length():
    """Dropping path, gradients of one layer: temporaries at length 4096 <= 4.5 x those at 1024 with 256-token
    groups; with whole-sequence groups (the default) the [group, tokens, experts, capacity] masks grow ~16x."""
    cfg = dataclasses.replace(LAYER, emb_dim=32, mlp_dim=64, capacity_factor=1.25)

    def temp(length: int, group: int) -> int:
        compiled = _compiled(dataclasses.replace(cfg, moe_group_size=group), 1, length, grad=True)
        return compiled.memory_analysis().temp_size_in_bytes

    grouped = temp(4096, 256) / temp(1024, 256)
    assert grouped <= 4.5, grouped
    assert temp(4096, 0) / temp(1024, 0) > 10  # the test can fail: without groups it is quadratic


# --------------------------------------------------------------------------------------------- shared experts


def test_shared_experts_are_one_dense_swiglu_beside_the_routed_ones(reference):
    """num_shared_experts=2: params `shared/wi_0|wi_1|wo` of width 2 x mlp_dim with the dense MLP's logical axes,
    and the output is the routed layer's plus that SwiGLU of the input."""
    params, x, segments = reference[:3]
    cfg = dataclasses.replace(LAYER, num_shared_experts=2)
    boxed = jax.eval_shape(lambda: _block(cfg).init(jax.random.key(0), x, segments))["params"]["shared"]
    assert boxed["wi_0"]["kernel"].names == ("embed", "mlp") and boxed["wo"]["kernel"].names == ("mlp", "embed")
    assert boxed["wi_1"]["kernel"].value.shape == (LAYER.emb_dim, 2 * LAYER.mlp_dim)
    shared = jax.tree.map(lambda a: jax.random.normal(jax.random.key(2), a.shape) * 0.1, nn.unbox(boxed))

    def apply(c: ModelConfig, p: dict) -> jax.Array:
        return _block(c).apply({"params": p}, x, segments, mutable=[moe.STATS_COLLECTION])[0]

    both = jax.jit(lambda p: apply(cfg, p))({**params, "shared": shared})
    routed = jax.jit(lambda p: apply(LAYER, p))(params)
    k = {name: shared[name]["kernel"] for name in ("wi_0", "wi_1", "wo")}
    dense = (nn.silu(x @ k["wi_0"]) * (x @ k["wi_1"])) @ k["wo"]
    np.testing.assert_allclose(np.asarray(both), np.asarray(routed + dense), rtol=1e-5, atol=1e-5)


def test_flops_count_shared_experts():
    """Each MoE layer adds n x the dense MLP's matmul params (the tiny config: 2 layers, the second one MoE)."""
    base = tiny_config("num_experts=8", "num_experts_per_tok=2", "moe_layer_interval=2", num_devices=1)
    shared = tiny_config("num_experts=8", "num_experts_per_tok=2", "moe_layer_interval=2", "num_shared_experts=2",
                         num_devices=1)
    mlp = 3 * 64 * 128
    extra = model_flops.matmul_params(shared.model) - model_flops.matmul_params(base.model)
    assert extra == 1 * 2 * mlp  # 1 MoE layer of 2
    assert model_flops.flops_per_token(shared.model) - model_flops.flops_per_token(base.model) == 6 * 2 * mlp


@pytest.mark.parametrize("override, message", [
    ("moe_group_size=24", "moe_group_size"), ("moe_group_size=-1", "moe_group_size"),
    ("num_shared_experts=-1", "num_shared_experts"), ("moe_dropless_impl=fast", "moe_dropless_impl"),
])
def test_bad_new_moe_keys_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config("num_experts=8", "num_experts_per_tok=2", override)


def test_auto_impl_is_tiled_on_cpu_and_group_size_reaches_the_model():
    cfg = tiny_config("num_experts=8", "moe_group_size=8")
    assert cfg.model.moe_dropless_impl == "tiled" and cfg.model.moe_group_size == 8


@pytest.mark.parametrize("device_kind, impl", [("TPU v5p", "ragged_dot"), ("NVIDIA H100 80GB HBM3", "tiled")])
def test_auto_impl_is_ragged_dot_on_tpu_only(device_kind, impl):
    """On an H100 ragged_dot's kernels were dense GEMMs, 1.5-3.3x tiled's step time (benchmarks/README.md)."""
    cfg = dataclasses.replace(tiny_config("num_experts=8", "capacity_factor=-1"), device_kind=device_kind)
    assert loading.model_config(cfg).moe_dropless_impl == impl
    explicit = dataclasses.replace(cfg, moe_dropless_impl="ragged_dot")
    assert loading.model_config(explicit).moe_dropless_impl == "ragged_dot"  # an explicit choice is kept
