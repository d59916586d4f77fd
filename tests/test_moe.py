"""Mixture of Experts: routing and drops by hand, router losses by hand, dropping == dropless when nothing drops,
expert parallelism == one device, FLOP count by hand, and an MoE model training through the CLI.

Tolerances (float32, each leaf's error relative to its own largest value, as in test_parity.py): 1e-5 for losses,
router statistics and gradients. Routing is per sequence, so sharding never changes which token goes where; only
the order of sums changes, which moves results by ~1e-7.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard import config, data
from maxshard.errors import ConfigError
from maxshard.model import flops as model_flops
from maxshard.model import transformer as model
from maxshard.model.layers import moe
from maxshard.observe import metrics
from maxshard.run import loading
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import layout_overrides, max_relative_difference, mesh_for, tiny_config
import cli_processes

route = jax.jit(moe.route, static_argnums=(1, 2))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two layers: one dense, one MoE (moe_layer_interval=2), 8 experts of top-2.
MOE = ("num_experts=8", "num_experts_per_tok=2", "moe_layer_interval=2")


def _grads_and_sums(cfg: config.Config, params, batch) -> tuple[dict, dict]:
    """(gradients, loss/MoE sums) of one batch on the config's mesh, from the given host parameters."""
    trainer = Trainer(cfg, mesh_for(cfg))
    params = jax.device_put(params, trainer.state_shardings.params)
    batch = jax.device_put(batch, trainer.batch_shardings(data.batch_sharding(cfg, trainer.mesh)))
    with mesh_context(trainer.mesh, trainer.rules):
        grads, sums = jax.jit(trainer._grads)(params, batch)
    return jax.device_get(grads), jax.device_get(sums)


def _params_and_batch(cfg: config.Config) -> tuple[dict, dict]:
    """Initial parameters (host) and a random batch whose rows end in 0-4 padding tokens."""
    params = jax.jit(lambda r: nn.unbox(model.Transformer(cfg.model).init(r, *model.dummy_batch(cfg.model))["params"]))
    rng = np.random.default_rng(0)
    shape = (cfg.global_batch_size, cfg.max_target_length)
    real = np.arange(shape[1])[None, :] < shape[1] - rng.integers(0, 5, (shape[0], 1))  # [batch, length]
    batch = {
        "inputs": rng.integers(3, cfg.vocab_size, shape).astype(np.int32),
        "targets": rng.integers(3, cfg.vocab_size, shape).astype(np.int32),
        "segment_ids": real.astype(np.int32),
        "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy(),
        "loss_weights": real.astype(np.float32),
    }
    return jax.device_get(params(jax.random.key(0))), batch


@pytest.fixture(scope="module")
def moe_reference():
    """One device, capacity_factor 1.0 (so some assignments drop): parameters, a batch, gradients and sums."""
    cfg = tiny_config(*MOE, "capacity_factor=1.0", num_devices=1)
    params, batch = _params_and_batch(cfg)
    grads, sums = _grads_and_sums(cfg, params, batch)
    assert float(sums["moe_dropped"]) > 0  # the parity below covers real drops
    return params, batch, grads, sums


# --------------------------------------------------------------------------------------------- routing by hand


def test_capacity_formula():
    assert moe.capacity(64, 2, 8, 1.25) == 20  # ceil(64 * 2 / 8 * 1.25)
    assert moe.capacity(64, 2, 8, 1.0) == 16
    assert moe.capacity(4, 2, 2, 0.5) == 2
    assert moe.capacity(64, 2, 8, 100.0) == 64  # never more slots than tokens in the group


def test_worked_example_of_the_docstring():
    """4 tokens, 2 experts, top-2, capacity 2: 1st choices queue before 2nd choices; 4 of 8 assignments drop."""
    logits = jnp.array([[[2.0, 1.0], [1.0, 2.0], [2.0, 1.0], [2.0, 1.0]]])  # 1st choices e0 e1 e0 e0
    routing = route(logits, 2, 2, jnp.ones((1, 4), bool))
    kept = np.asarray(routing.kept[0])
    np.testing.assert_array_equal(kept, [[1, 1], [0, 1], [1, 0], [0, 0]])
    slots = {(s, e): int(np.argmax(routing.dispatch[0, s, e])) for s, e in zip(*np.nonzero(kept))}
    assert slots == {(0, 0): 0, (2, 0): 1, (1, 1): 0, (0, 1): 1}
    assert float(jnp.sum(routing.chosen) - jnp.sum(routing.kept)) == 4
    # With k = num_experts the renormalised weights are the softmax itself; combine carries them at the slots.
    probs = jax.nn.softmax(logits, axis=-1)
    np.testing.assert_allclose(jnp.sum(routing.combine, -1), probs * routing.kept, rtol=1e-6)


def test_padding_takes_no_slot():
    """Top-1, 5 tokens, capacity 3 all on expert 0 but token 4: token 3 drops, unless token 0 is padding."""
    logits = jnp.array([[[1.0, 0.0]] * 4 + [[0.0, 1.0]]])
    full = route(logits, 1, moe.capacity(5, 1, 2, 1.0), jnp.ones((1, 5), bool))
    np.testing.assert_array_equal(full.kept[0, :, 0], [1, 1, 1, 0, 0])
    padded = route(logits, 1, 3, jnp.array([[False, True, True, True, True]]))
    np.testing.assert_array_equal(padded.kept[0, :, 0], [0, 1, 1, 1, 0])
    assert float(jnp.sum(padded.chosen)) == 4  # padding chose nothing


def _identity_router_block(capacity_factor: float, k: int = 2) -> tuple[moe.MoEBlock, dict]:
    """An MoEBlock of width 2 whose router kernel is the identity, so the router logits are the input itself."""
    cfg = dataclasses.replace(tiny_config(*MOE, num_devices=1).model, emb_dim=2, mlp_dim=8, num_experts=2,
                              num_experts_per_tok=k, capacity_factor=capacity_factor)
    block = moe.MoEBlock(cfg, jnp.float32, jnp.float32)
    x = jnp.zeros((1, 4, 2))
    params = jax.jit(lambda r: nn.unbox(block.init(r, x, jnp.ones((1, 4), jnp.int32))["params"]))(jax.random.key(0))
    params["gate"]["kernel"] = jnp.eye(2)
    return block, params


def test_the_layer_adds_nothing_to_a_fully_dropped_token():
    block, params = _identity_router_block(capacity_factor=0.5)  # the worked example: capacity 2
    x = jnp.array([[[2.0, 1.0], [1.0, 2.0], [2.0, 1.0], [2.0, 1.0]]])
    apply = jax.jit(lambda p, x, seg: block.apply({"params": p}, x, seg, mutable=[moe.STATS_COLLECTION]))
    y, state = apply(params, x, jnp.ones((1, 4), jnp.int32))
    assert np.all(np.asarray(y[0, 3]) == 0.0)  # token 3 lost both experts
    assert np.all(np.abs(np.asarray(y[0, :3])) > 0)
    stats = moe.collect_stats(state[moe.STATS_COLLECTION])
    assert float(stats["dropped"][0]) == 4 and float(stats["assigned"][0]) == 8


# --------------------------------------------------------------------------------------------- router losses


def test_router_losses_by_hand():
    logits = np.array([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.5], [3.0, 1.0, 0.0]]], np.float32)
    mask = np.array([[True, True, True, False]])  # the last token is padding
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    real = probs[0, :3]
    f = np.array([1, 1, 1]) / 3  # top-1 choices e0, e1, e2
    expected_balance = 3 * np.sum(f * real.mean(0))
    expected_z = np.mean(np.log(np.exp(logits[0, :3]).sum(-1)) ** 2)
    routing = route(jnp.asarray(logits), 1, 4, jnp.asarray(mask))
    balance, z = jax.jit(moe.router_losses)(jnp.asarray(logits), routing.chosen, jnp.asarray(mask))
    np.testing.assert_allclose(float(balance), expected_balance, rtol=1e-6)
    np.testing.assert_allclose(float(z), expected_z, rtol=1e-6)


def test_balance_loss_gradient_reaches_only_the_router():
    """Top-1 (with top-2 of 2 experts every f_i is 1/2 and the loss is constant)."""
    block, params = _identity_router_block(capacity_factor=1.0, k=1)
    x = jax.random.normal(jax.random.key(1), (2, 4, 2))
    segments = jnp.ones((2, 4), jnp.int32)

    def balance(p: dict) -> jax.Array:
        _, state = block.apply({"params": p}, x, segments, mutable=[moe.STATS_COLLECTION])
        return moe.collect_stats(state[moe.STATS_COLLECTION])["lb_loss"][0]

    grads = jax.jit(jax.grad(balance))(params)
    assert float(jnp.max(jnp.abs(grads["gate"]["kernel"]))) > 1e-4
    assert all(float(jnp.max(jnp.abs(grads[k]))) == 0.0 for k in ("wi_0", "wi_1", "wo"))


# --------------------------------------------------------------------------------------------- the model


def test_dropping_equals_dropless_when_nothing_drops(moe_reference):
    """Enough capacity (C = tokens) routes every token like the dropless path: same objective and gradients."""
    params, batch = moe_reference[:2]
    roomy = tiny_config(*MOE, "capacity_factor=8.0", num_devices=1)
    grads, sums = _grads_and_sums(roomy, params, batch)
    ref_grads, ref_sums = _grads_and_sums(loading.replace(roomy, capacity_factor=-1.0), params, batch)
    assert float(sums["moe_dropped"]) == 0
    assert float(sums["moe_assigned"]) == 2 * batch["segment_ids"].sum()  # k = 2 per real token, padding none
    assert max_relative_difference(grads, ref_grads) < 1e-5
    assert max_relative_difference(sums, ref_sums) < 1e-5
    assert float(jnp.max(jnp.abs(grads["decoder"]["layers"]["layer_1"]["moe"]["gate"]["kernel"]))) > 0


EXPERT_LAYOUTS = {
    "expert1_fsdp8": ["ici_fsdp_parallelism=8"],
    "expert2_fsdp4": ["ici_expert_parallelism=2", "ici_fsdp_parallelism=4"],
    "expert4_fsdp2": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"],
    "expert8": ["ici_expert_parallelism=8"],
}


@pytest.mark.parametrize("name", sorted(EXPERT_LAYOUTS))
def test_expert_parallelism_matches_single_device(name, moe_reference):
    params, batch, ref_grads, ref_sums = moe_reference
    cfg = tiny_config(*MOE, "capacity_factor=1.0", *layout_overrides(EXPERT_LAYOUTS[name]))
    grads, sums = _grads_and_sums(cfg, params, batch)
    assert float(sums["moe_dropped"]) == float(ref_sums["moe_dropped"])  # the same tokens drop
    np.testing.assert_allclose(float(sums["loss_sum"]), float(ref_sums["loss_sum"]), rtol=1e-5)
    assert max_relative_difference(sums, ref_sums) < 1e-5
    assert max_relative_difference(grads, ref_grads) < 1e-5


def test_router_losses_enter_the_objective(moe_reference):
    params, batch, _, sums = moe_reference
    cfg = tiny_config(*MOE, "capacity_factor=1.0", num_devices=1)
    trainer = Trainer(cfg, mesh_for(cfg))
    with mesh_context(trainer.mesh, trainer.rules):
        objective, _ = jax.jit(trainer._loss)(params, batch)
    aux = cfg.load_balance_loss_weight * sums["moe_lb_loss"] + cfg.router_z_loss_weight * sums["moe_z_loss"]
    np.testing.assert_allclose(float(objective), float(sums["loss_sum"] + aux), rtol=1e-6)
    assert float(sums["moe_lb_loss"] / sums["weight_sum"]) >= 1.0  # >= 1, equal only when perfectly balanced


def _metric_keys(cfg: config.Config) -> set[str]:
    """Keys of the train step's metrics, from tracing alone (nothing compiled)."""
    trainer = Trainer(cfg, mesh_for(cfg))
    batch = {k: jax.ShapeDtypeStruct((cfg.global_batch_size, cfg.max_target_length), jnp.int32)
             for k in ("inputs", "targets", "segment_ids", "positions")}
    batch["loss_weights"] = jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.float32)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nn.unbox(trainer.abstract_state))
    with mesh_context(trainer.mesh, trainer.rules):
        return set(jax.eval_shape(trainer._train_step, state, batch)[1])


MOE_METRICS = {"moe/lb_loss", "moe/z_loss", "moe/seq_balance_loss", "moe/dropped_fraction", "moe/expert_load_min",
               "moe/expert_load_max", "moe/expert_load_cv"}


def test_metrics_keys_and_dense_models_unchanged():
    dense = tiny_config()
    dense_keys = _metric_keys(dense)
    assert dense_keys == {"loss", "tokens", "grad_norm", "param_norm", "learning_rate"}
    assert _metric_keys(tiny_config(*MOE)) == dense_keys | MOE_METRICS
    assert {metrics.tag_for(key) for key in MOE_METRICS} == MOE_METRICS  # grouped under moe/ in TensorBoard
    assert _metric_keys(tiny_config(*MOE, "gradient_accumulation_steps=2")) == dense_keys | MOE_METRICS
    paths = [str(path) for path, _ in jax.tree_util.tree_flatten_with_path(model.abstract_params(dense.model))[0]]
    assert paths and not any("moe" in path or "layer_0" in path for path in paths)


def test_flops_and_params_of_tiny_moe_by_hand():
    """tiny_moe: 4 layers of width 64 (4 heads of 16), every 2nd MoE with 8 experts of 128, top-2; vocab 384."""
    preset = config.finalize(config.parse(["configs/base.yml", "model_name=tiny_moe"]), 8)
    cfg = loading.complete(dataclasses.replace(preset, vocab_size=384))
    attention = 64 * 16 * (4 + 4 + 4 + 4)  # q, k, v, out kernels: 16384
    mlp = 3 * 64 * 128  # one SwiGLU: 24576
    dense_layers = 2 * (attention + mlp)
    moe_layers = 2 * (attention + 2 * mlp + 64 * 8)  # 2 experts per token + the router
    matmul = dense_layers + moe_layers + 64 * 384  # 238592
    assert model_flops.matmul_params(cfg.model) == matmul == 238592
    scores = 6 * 4 * 64 * 4 * 16  # attention scores and values, as for dense models
    assert model_flops.flops_per_token(cfg.model) == 6 * matmul + scores
    idle_experts = 2 * (8 - 2) * mlp  # parameters that exist but a token does not use
    norms = (2 * 4 + 1) * 64
    assert model.param_count(cfg.model) == matmul + idle_experts + 384 * 64 + norms


@pytest.mark.parametrize(
    "override, message",
    [("num_experts_per_tok=9", "num_experts_per_tok"), ("moe_layer_interval=3", "moe_layer_interval"),
     ("num_experts=0", "num_experts")],
)
def test_bad_moe_keys_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*MOE, override)


# --------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_moe_trains_through_the_cli(tmp_path):
    cmd = [
        sys.executable, "-m", "maxshard.train", "configs/base.yml", "model_name=tiny_moe", "cpu_device_count=8",
        "dataset_type=synthetic", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "capacity_factor=1.25",
        "steps=20", "log_period=5", "eval_period=0", "enable_checkpointing=false", f"base_output_directory={tmp_path}",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = cli_processes.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [float(v) for v in re.findall(r"^step \d+/20 \| loss ([0-9.]+)", result.stdout, re.MULTILINE)]
    assert len(losses) >= 4 and all(math.isfinite(v) for v in losses), result.stdout[-2000:]
    assert losses[-1] < losses[0] - 0.5, losses
