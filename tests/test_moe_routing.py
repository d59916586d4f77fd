"""DeepSeek-V3 routing (layers/moe.py): sigmoid scores, group-limited top-k, routed scaling, the selection bias and
its aux-loss-free update, the sequence-wise balance loss.

- Choices and weights equal transformers' DeepseekV3TopkRouter on a committed fixture (tools/make_routing_fixture.py).
- Every MoE path (dropping with room for all, dropless tiled, ragged_dot and the ragged exchange), on one device and
  under expert=4 x fsdp=2, gives the all-experts (dense) output, float32, relative error < 1e-5; the router's
  gradient flows through the weights, the bias's is 0.
- The bias has no gradient and no optimizer moments (LoRA too) but is checkpointed; one step (under the pipeline,
  with gradient accumulation) moves it by exactly +-rate from the loads of all microbatches.
- Through `maxshard.train`, from parameters whose bias sends most tokens to two experts: the load's coefficient of
  variation (moe/expert_load_cv) falls with moe_bias_update_rate > 0 and stays without it; a run resumed half way
  ends with the straight run's bias, bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from maxshard import data, train
from maxshard.checkpoint.manager import Checkpoints
from maxshard.errors import ConfigError
from maxshard.model import trainable
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import moe, pipeline
from maxshard.model.transformer import Transformer, apply_with_stats
from maxshard.parallel import sharding
from maxshard.run import loading
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import layout_overrides, max_relative_difference, mesh_for, tiny_config

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "routing" / "deepseek_v3.npz"

# ---------------------------------------------------------------------------------------------- transformers


def _fixture_cases() -> list[str]:
    with np.load(FIXTURE) as f:
        return sorted({name.split("/")[0] for name in f.files})


@pytest.mark.parametrize("case", _fixture_cases())
def test_choices_and_weights_are_transformers(case):
    """Same experts per token (as sets: torch's topk is unsorted) and the same weight for each, 1e-6; the bias and
    the group limit each change some token's choice, so both are exercised."""
    with np.load(FIXTURE) as f:
        hidden, weight, bias, indices, weights, config = (f[f"{case}/{k}"] for k in
                                                          ("hidden", "weight", "bias", "indices", "weights", "config"))
    experts, k, n_group, topk_group, norm, scale = config
    scoring = moe.Scoring("sigmoid", int(n_group), int(topk_group), float(scale), bool(norm))
    logits = jnp.asarray(hidden @ weight.T)[None]  # [1 group, tokens, experts]
    mask = jnp.ones(logits.shape[:2], bool)

    def choices(scoring: moe.Scoring, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        r = moe.route(logits, int(k), logits.shape[1], mask, scoring=scoring,  # eager: a few tiny ops
                      bias=None if bias is None else jnp.asarray(bias))
        return np.asarray(r.top_experts[0]), np.asarray(r.top_weights[0])

    got_experts, got_weights = choices(scoring, bias)
    np.testing.assert_array_equal(np.sort(got_experts, -1), np.sort(indices, -1))
    order, ref_order = np.argsort(got_experts, -1), np.argsort(indices, -1)
    np.testing.assert_allclose(np.take_along_axis(got_weights, order, -1),
                               np.take_along_axis(weights, ref_order, -1), rtol=1e-6, atol=1e-7)
    unbiased = choices(scoring, None)[0]
    assert np.any(np.sort(unbiased, -1) != np.sort(got_experts, -1))  # the bias moved some choice
    if n_group > 1:
        ungrouped = choices(dataclasses.replace(scoring, n_group=1, topk_group=1), bias)[0]
        assert np.any(np.sort(ungrouped, -1) != np.sort(got_experts, -1))  # so did the group limit


# ---------------------------------------------------------------------------------------------- every path

# 8 experts in 4 groups of 2, the 2 best groups kept, top-3, a bias, scaling 2.5, a shared expert, experts of 24.
LAYER = ModelConfig(vocab_size=128, emb_dim=16, mlp_dim=32, moe_mlp_dim=24, num_experts=8, num_experts_per_tok=3,
                    capacity_factor=-1.0, moe_router="sigmoid", moe_n_group=4, moe_topk_group=2,
                    moe_router_bias=True, moe_routed_scaling_factor=2.5, num_shared_experts=1)
BATCH, LENGTH = 8, 8


def _apply(cfg: ModelConfig, params: dict, x: jax.Array, segments: jax.Array) -> jax.Array:
    block = moe.MoEBlock(cfg, jnp.float32, jnp.float32)
    return block.apply({"params": params}, x, segments, mutable=[moe.STATS_COLLECTION])[0]


@pytest.fixture(scope="module")
def reference():
    """Parameters (a random bias), inputs with padding, and the all-experts output, no mesh."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(BATCH, LENGTH, LAYER.emb_dim)), jnp.float32)
    segments = jnp.asarray(np.arange(LENGTH)[None, :] < LENGTH - rng.integers(0, 3, (BATCH, 1)), jnp.int32)
    block = moe.MoEBlock(LAYER, jnp.float32, jnp.float32)
    params = jax.jit(lambda r: nn.unbox(block.init(r, x, segments)["params"]))(jax.random.key(0))
    params[moe.BIAS_PARAM] = jnp.asarray(rng.normal(size=LAYER.num_experts) * 0.2, jnp.float32)
    dense = dataclasses.replace(LAYER, moe_dropless_impl="dense")
    return params, x, segments, jax.jit(functools.partial(_apply, dense))(params, x, segments)


PATHS = {  # name: ModelConfig changes
    "tiled": {"moe_dropless_impl": "tiled", "moe_exchange": "all_to_all"},
    "ragged_dot": {"moe_dropless_impl": "ragged_dot", "moe_exchange": "all_to_all"},
    "ragged_exchange": {"moe_dropless_impl": "tiled", "moe_exchange": "ragged"},
    "dropping": {"capacity_factor": 8.0},  # room for every choice: nothing drops
}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["one_device", "expert4_fsdp2"])
def test_every_path_equals_all_experts(expert_parallel, reference):
    """Every path in one compiled function (one compile per layout); the router's gradient through the weights is
    there, the bias's is 0."""
    params, x, segments, ref_y = reference
    dense = dataclasses.replace(LAYER, moe_dropless_impl="dense")

    def outputs(p: dict) -> tuple[dict[str, jax.Array], dict]:
        ys = {name: _apply(dataclasses.replace(LAYER, **changes), p, x, segments) for name, changes in PATHS.items()}
        return ys, jax.grad(lambda q: jnp.sum(jnp.sin(_apply(dense, q, x, segments))))(p)

    if expert_parallel:
        mesh_cfg = tiny_config(*layout_overrides(["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]))
        with mesh_context(mesh_for(mesh_cfg), sharding.flax_rules(mesh_cfg)):
            ys, grads = jax.jit(outputs)(params)
    else:
        ys, grads = jax.jit(outputs)(params)
    for name, y in ys.items():
        assert max_relative_difference(y, ref_y) < 1e-5, name
    assert float(jnp.max(jnp.abs(grads["gate"]["kernel"]))) > 0
    assert float(jnp.max(jnp.abs(grads[moe.BIAS_PARAM]))) == 0.0  # it only chooses


def test_sequence_balance_loss_by_hand():
    """Two sequences of 3 experts, top-1: one balanced (loss 1), one whose real tokens all choose expert 0; the
    padding token counts nowhere."""
    logits = np.array([[[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]],
                       [[2.0, 0.0, 0.0], [1.0, 0.0, 0.5], [0.0, 3.0, 0.0]]], np.float32)
    mask = np.array([[True, True, True], [True, True, False]])
    chosen = np.zeros_like(logits)
    chosen[0, [0, 1, 2], [0, 1, 2]] = 1
    chosen[1, [0, 1], [0, 0]] = 1
    s = 1 / (1 + np.exp(-logits))
    p = s / s.sum(-1, keepdims=True)
    second = np.sum(3 / (1 * 2) * np.array([2, 0, 0]) * p[1, :2].mean(0))
    first = np.sum(3 / (1 * 3) * np.array([1, 1, 1]) * p[0].mean(0))
    got = jax.jit(moe.sequence_balance_loss, static_argnums=(3, 4))(logits, chosen, mask, 1, "sigmoid")
    np.testing.assert_allclose(float(got), (first + second) / 2, rtol=1e-6)
    np.testing.assert_allclose(first, 1.0, rtol=1e-6)
    # into the objective as the balance loss goes: the mean over layers, scaled by the batch's loss weight
    stats = {"lb_loss": jnp.array([1.0, 2.0]), "z_loss": jnp.array([3.0, 4.0]), "seq_loss": jnp.array([1.5, 2.5]),
             "assigned": jnp.array([8.0, 8.0]), "dropped": jnp.zeros(2), "load": jnp.ones((2, 3))}
    sums = moe.loss_sums(stats, jnp.float32(10.0))
    assert float(moe.objective(sums, 0.5, 0.25, 0.1)) == pytest.approx(10 * (0.5 * 1.5 + 0.25 * 3.5 + 0.1 * 2.0))
    assert float(moe.metrics(sums, jnp.float32(10.0))["moe/seq_balance_loss"]) == pytest.approx(2.0)


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, message", [
    (("moe_bias_update_rate=0.01",), "^moe_bias_update_rate=0.01 moves the experts' selection bias: set "
                                     "moe_router_bias=true"),
    (("moe_n_group=3",), "^moe_n_group=3 must be >= 1 and divide num_experts=8"),
    (("moe_n_group=2", "moe_topk_group=3"), r"^moe_topk_group=3 must be in \[1, moe_n_group=2\]"),
    (("moe_n_group=4", "moe_topk_group=1", "num_experts_per_tok=3"), "^num_experts_per_tok=3 is more than the 2 "
                                                                     "experts of moe_topk_group=1 groups"),
])
def test_bad_routing_keys_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config("num_experts=8", "num_experts_per_tok=2", *overrides)


# ---------------------------------------------------------------------------------------------- the train step

SMALL = ("emb_dim=16", "num_heads=2", "num_kv_heads=2", "head_dim=8", "mlp_dim=32", "max_target_length=16")
ROUTED = ("num_experts=8", "num_experts_per_tok=2", "capacity_factor=-1", "moe_router=sigmoid", "moe_n_group=4",
          "moe_topk_group=2", "moe_router_bias=true", "load_balance_loss_weight=0", "router_z_loss_weight=0")


def _bias_paths(tree) -> list[str]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]
    return [p for p in paths if p.endswith(moe.BIAS_PARAM)]


@pytest.mark.parametrize("lora", [False, True])
def test_the_bias_has_no_gradient_and_no_optimizer_state(lora):
    cfg = tiny_config(*ROUTED, *(("lora_rank=4",) if lora else ()), num_devices=1)
    state = nn.unbox(Trainer(cfg, mesh_for(cfg)).abstract_state)
    assert _bias_paths(state.params) == ["decoder/layers/layer_0/moe/router_bias"]
    trained, frozen = trainable.split(state.params, cfg.model)
    assert not _bias_paths(trained) and _bias_paths(frozen) and not _bias_paths(state.opt_state)
    assert _bias_paths(trainable.saved_subset(state.params, cfg.model))  # checkpoints keep it, with LoRA too
    assert not trainable.is_trainable(cfg.model, "params/decoder/layers/moe/router_bias")
    bias = state.params["decoder"]["layers"]["layer_0"]["moe"][moe.BIAS_PARAM]
    assert bias.shape == (2, 8) and bias.dtype == jnp.float32  # [layers, experts], whatever weight_dtype


def test_one_step_moves_the_bias_by_the_rate_from_all_microbatches():
    """One step in 2 accumulation microbatches, under the pipeline (2 stages x 2 repeats, 2 pipeline microbatches
    each): every bias entry of its stacks [repeats, stages, layers, experts] moves by exactly +-rate (0 at the mean),
    toward the experts below the mean load of the whole batch, each layer its own."""
    rate = 0.25  # exactly representable: bias = 0 + sign * rate holds bit for bit
    cfg = tiny_config(*ROUTED, *SMALL, "num_layers=4", f"moe_bias_update_rate={rate}", "gradient_accumulation_steps=2",
                      *layout_overrides(["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"]),
                      "num_pipeline_microbatches=2", "num_pipeline_repeats=2")
    trainer = Trainer(cfg, mesh_for(cfg))
    state = trainer.init_state()
    rng = np.random.default_rng(0)
    shape = (cfg.global_batch_size, cfg.max_target_length)
    batch = {"inputs": rng.integers(3, cfg.vocab_size, shape).astype(np.int32),
             "targets": rng.integers(3, cfg.vocab_size, shape).astype(np.int32),
             "segment_ids": np.ones(shape, np.int32), "loss_weights": np.ones(shape, np.float32),
             "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy()}
    # The loads of the same layers unpipelined, on one device, over the whole batch (routing is per sequence).
    flat = pipeline.to_scanned(jax.device_get(state.params))
    plain = Transformer(dataclasses.replace(cfg.model, pipeline=None))
    inputs = (batch["inputs"], batch["segment_ids"], batch["positions"])
    _, stats = jax.jit(lambda p: apply_with_stats(plain, p, *inputs))(flat)
    load = np.asarray(stats["bias_loads"]["decoder/layers/layer_0/moe/router_bias"])  # [layers, experts]
    np.testing.assert_array_equal(load.sum(-1), [2 * np.prod(shape)] * 4)  # k = 2 choices of every token
    expected = rate * np.sign(load.mean(-1, keepdims=True) - load)
    assert np.any(expected != 0) and np.any(expected[0] != expected[1])
    with mesh_context(trainer.mesh, trainer.rules):
        new, _ = jax.jit(trainer._train_step)(state, jax.device_put(batch, trainer.batch_shardings(
            data.batch_sharding(cfg, trainer.mesh))))
    bias = pipeline.to_scanned(jax.device_get(new.params))["decoder"]["layers"]["layer_0"]["moe"][moe.BIAS_PARAM]
    np.testing.assert_array_equal(np.asarray(bias), expected)


# ---------------------------------------------------------------------------------------------- through the CLI

STEPS, RATE, SKEW = 12, 0.05, 0.5
RUN = ("configs/base.yml", *ROUTED, *SMALL, "dataset_type=synthetic", "cpu_device_count=8", "num_layers=2",
       "per_device_batch_size=2", "eval_period=0", "log_period=1", "enable_tensorboard=false",
       "remat_policy=full", f"steps={STEPS}", "async_checkpointing=false")
BIAS = ("decoder", "layers", "layer_0", "moe", moe.BIAS_PARAM)  # [layers, experts]


def _cv(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["moe/expert_load_cv"] for r in records if "moe/expert_load_cv" in r}


def _skewed_parameters(root: Path) -> Path:
    """A parameters checkpoint (as the CLI saves one) whose biases send most tokens to experts 0 and 1 (the load's
    cv starts at ~1.4; 1.73 is all of them)."""
    cfg = loading.load_run([*RUN, f"base_output_directory={root}", "run_name=skewed"], check_fit=False)
    trainer = Trainer(cfg, mesh_for(cfg))
    state = trainer.init_state()
    moe_params = functools.reduce(dict.get, BIAS[:-1], state.params)
    moe_params[moe.BIAS_PARAM] = jnp.zeros_like(moe_params[moe.BIAS_PARAM]).at[:, :2].set(SKEW)
    with Checkpoints(cfg, trainer) as ckpt:
        ckpt.save(0, state, {})
    return Path(cfg.checkpoint_dir) / "0"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """From the skewed parameters: STEPS steps with the bias moving (a checkpoint half way and at the end), the same
    without, and the moving run resumed from its half-way checkpoint."""
    root = tmp_path_factory.mktemp("routing")
    start = f"load_parameters_path={_skewed_parameters(root)}"
    base = (*RUN[1:], f"base_output_directory={root}", start)
    moving = ("moe_bias_update_rate=" + str(RATE), f"checkpoint_period={STEPS // 2}")
    assert train.main([RUN[0], *base, "run_name=moving", *moving]) == 0
    assert train.main([RUN[0], *base, "run_name=fixed", "enable_checkpointing=false"]) == 0
    (root / "resumed" / "checkpoints").mkdir(parents=True)
    half = str(STEPS // 2)
    shutil.copytree(root / "moving" / "checkpoints" / half, root / "resumed" / "checkpoints" / half)
    assert train.main([RUN[0], *base, "run_name=resumed", *moving]) == 0
    return root


def test_moving_the_bias_balances_the_load(runs):
    moving, fixed = _cv(runs / "moving"), _cv(runs / "fixed")
    print(f"expert_load_cv moving: step 1 {moving[1]:.3f}, step {STEPS} {moving[STEPS]:.3f}; "
          f"fixed: step 1 {fixed[1]:.3f}, step {STEPS} {fixed[STEPS]:.3f}")
    assert moving[1] > 1.0 and fixed[1] == moving[1]  # the same skewed start
    late = lambda cv: np.mean([cv[s] for s in range(STEPS - 3, STEPS + 1)])  # noqa: E731
    assert late(moving) < 0.5 * moving[1]
    assert late(fixed) > 0.8 * fixed[1]


def test_the_bias_resumes_bit_exactly(runs):
    def saved_bias(run: str) -> np.ndarray:
        tree = ocp.PyTreeCheckpointer().restore(runs / run / "checkpoints" / str(STEPS) / "state")
        return np.asarray(functools.reduce(dict.get, BIAS, tree["params"]))

    straight, resumed = saved_bias("moving"), saved_bias("resumed")
    assert np.all(straight[:, :2] < SKEW)  # it moved
    np.testing.assert_array_equal(resumed, straight)
    moving = _cv(runs / "moving")
    assert _cv(runs / "resumed") == {s: moving[s] for s in range(STEPS // 2 + 1, STEPS + 1)}  # the same loads
