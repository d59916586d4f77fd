"""Circular pipeline: the pipelined model is the non-pipelined model, computed in another order.

Parity: the same parameters (the pipelined [R, S, L, ...] tree is a reshape of the scanned [layers, ...] tree) and
the same batch give the same loss and gradients, float32, each gradient leaf within 1e-5 of its own largest value
(`max_relative_difference`); the pipeline sums microbatch gradients in another order, so bit equality is not
expected, while a schedule mistake (a wrong layer, microbatch or repeat) moves results by orders of magnitude more.
Batches are packed with a different document boundary in every row, so segment ids and positions that did not
travel with their microbatch would change the loss.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard import data
from maxshard.errors import ConfigError
from maxshard.spec import pipeline_schedule
from maxshard.model.layers import pipeline
from maxshard.model.layers.decoder import Decoder, DecoderLayer
from maxshard.parallel import sharding
from maxshard.parallel.mesh import device_slices
from maxshard.training.step import Trainer, TrainState, mesh_context
from tests.helpers import max_relative_difference, mesh_for, tiny_config
import cli_processes

SMALL = ("emb_dim=32", "num_heads=2", "num_kv_heads=2", "head_dim=16", "mlp_dim=64", "max_target_length=16",
         "num_layers=8")
TOLERANCE = 1e-5
# The CPU backend's LLVM optimisations off: half the compile time, which dominates these tests; the same HLO.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def small_config(*overrides: str, global_batch: int = 16):
    return tiny_config(*SMALL, *overrides, global_batch=global_batch)


def compile_fast(jitted, *args):
    """`jitted` compiled for `args` with FAST_COMPILE (call it under the mesh context for Linen constraints)."""
    return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)


def random_params(trainer: Trainer, seed: int = 0) -> dict:
    """Host parameters for `trainer`'s model drawn with numpy (no init to compile): N(0, 0.1^2), norm scales
    1 + N(0, 0.1^2), so a norm applied with another layer's scale shows."""
    rng = np.random.default_rng(seed)

    def draw(path: tuple, leaf: jax.ShapeDtypeStruct) -> np.ndarray:
        offset = 1.0 if sharding.path_name(path).endswith("scale") else 0.0
        return (offset + rng.normal(0.0, 0.1, leaf.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, nn.unbox(trainer.abstract_state.params))


def packed_batch(cfg, mesh) -> dict[str, np.ndarray]:
    """A synthetic batch whose row b holds two documents split at a row-dependent position."""
    batch = jax.device_get(next(data.make_input(cfg, mesh)))
    rows, length = batch["inputs"].shape
    t = np.arange(length)[None, :]
    split = (3 + 5 * np.arange(rows) % (length - 4))[:, None]
    batch["segment_ids"] = np.where(t < split, 1, 2).astype(np.int32)
    batch["positions"] = np.where(t < split, t, t - split).astype(np.int32)
    batch["loss_weights"] = np.where(t == split - 1, 0.0, 1.0).astype(np.float32)  # no target across documents
    return batch


def loss_and_grads(cfg, params, batch) -> tuple[float, dict]:
    sums, grads = sums_and_grads(cfg, params, batch)
    return float(sums["loss_sum"] / sums["weight_sum"]), grads


def one_device_run(*keys: str, adjust=lambda params: params) -> tuple:
    """(cfg, params, batch, loss, gradients) of the tiny model with `keys` on one device: parameters drawn on the
    host (`random_params`, then `adjust`), a packed batch: the reference a layout's run is held to."""
    cfg = tiny_config(*keys, num_devices=1)
    trainer = Trainer(cfg, mesh_for(cfg))
    params, batch = adjust(random_params(trainer)), packed_batch(cfg, trainer.mesh)
    return cfg, params, batch, *loss_and_grads(cfg, params, batch)


def sums_and_grads(cfg, params, batch) -> tuple[dict, dict]:
    """The step's loss sums (loss, weight, MoE statistics) and summed gradients, on the host."""
    trainer = Trainer(cfg, mesh_for(cfg))
    params = jax.device_put(params, trainer.state_shardings.params)
    with mesh_context(trainer.mesh, trainer.rules):
        grads, sums = compile_fast(jax.jit(trainer._grads), params, batch)(params, batch)
    return jax.device_get(sums), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference():
    """The non-pipelined model (fsdp=8): config, initial params, a packed batch, its loss and gradients."""
    cfg = small_config()
    trainer = Trainer(cfg, mesh_for(cfg))
    params, batch = random_params(trainer), packed_batch(cfg, trainer.mesh)
    loss, grads = loss_and_grads(cfg, params, batch)
    return cfg, params, batch, loss, grads


# S stages, L layers per stage, R repeats, M microbatches (8 layers = S x L x R). Together with the two-slice
# training test (S=4 R=2 M=4) these cover S in {2, 4, 8}, R in {1, 2}, M in {S, 2S}, fsdp=2, tensor=2, gradient
# accumulation and three remat policies, at one compilation each.
PARITY = {
    "S2_L2_R2_M4_tensor2_accumulate2": ["ici_pipeline_parallelism=2", "ici_tensor_parallelism=2",
                                        "ici_fsdp_parallelism=2", "num_layers_per_pipeline_stage=2",
                                        "num_pipeline_microbatches=4", "gradient_accumulation_steps=2"],
    "S4_L2_R1_M4_fsdp2_minimal": ["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2",
                                  "num_layers_per_pipeline_stage=2", "remat_policy=minimal"],
}
SLOW_PARITY = {
    "S8_L1_R1_M16_remat_none": ["ici_pipeline_parallelism=8", "ici_fsdp_parallelism=1",
                                "num_pipeline_microbatches=16", "remat_policy=none"],
}


def _check_parity(reference, overrides: list[str]) -> None:
    ref_cfg, params, batch, ref_loss, ref_grads = reference
    cfg = small_config(*overrides)
    shape = cfg.model.pipeline
    assert shape is not None and shape.stages * shape.layers_per_stage * shape.repeats == cfg.num_layers
    loss, grads = loss_and_grads(cfg, pipeline.from_scanned(params, cfg.model.pipeline), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(grads), ref_grads) < TOLERANCE


@pytest.mark.parametrize("name", list(PARITY))
def test_pipelined_loss_and_gradients_equal_the_scanned_model(reference, name):
    _check_parity(reference, PARITY[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_PARITY))
def test_eight_stage_pipeline_equals_the_scanned_model(reference, name):
    _check_parity(reference, SLOW_PARITY[name])


def test_two_training_steps_across_two_slices_equal_the_scanned_model(reference):
    """Stages over DCN (2 simulated slices x 2 stages each) and AdamW: the same losses and parameters after two steps.

    The second loss already depends on the first update, so the losses check the step at 1e-5. Parameters: 2e-3 of
    each leaf's largest value, because Adam divides by sqrt(v) and so turns the rounding of a near-zero gradient
    into a difference of up to learning_rate (1e-2) in that one element (see test_parity.py); a wrong layer,
    microbatch or repeat changes every element by orders of magnitude more.
    """
    ref_cfg, params, batch, _, _ = reference
    cfg = small_config("num_slices=2", "dcn_pipeline_parallelism=2", "dcn_data_parallelism=1",
                       "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2")
    devices = mesh_for(cfg).devices  # [data, stage, fsdp, ...]
    slice_of = {d: i for i, group in enumerate(device_slices(jax.devices(), 2)) for d in group}
    stage_slices = [{slice_of[d] for d in devices.take(s, axis=1).flat} for s in range(4)]
    assert stage_slices == [{0}, {0}, {1}, {1}]  # stages 0-1 on slice 0, stages 2-3 on slice 1
    finals = [_train_two_steps(c, p, batch) for c, p in ((ref_cfg, params), (cfg, pipeline.from_scanned(params, cfg.model.pipeline)))]
    (ref_losses, ref_params), (losses, pipelined) = finals
    np.testing.assert_allclose(losses, ref_losses, rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(pipelined), ref_params) < 2e-3
    assert max_relative_difference(ref_params, params) > 1e-3  # the steps did move the parameters


def _train_two_steps(cfg, params, batch) -> tuple[list[float], dict]:
    trainer = Trainer(cfg, mesh_for(cfg))
    sharding = data.batch_sharding(cfg, trainer.mesh)
    params = jax.device_put(params, trainer.state_shardings.params)
    state = TrainState(jnp.zeros((), jnp.int32), params, trainer.tx.init(params))  # no init to compile
    state = jax.device_put(state, trainer.state_shardings)
    batch = jax.device_put(batch, trainer.batch_shardings(sharding))
    step = compile_fast(trainer.jit_train_step(sharding), state, batch)
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params)


@pytest.mark.slow
@pytest.mark.parametrize("capacity_factor, impl", [("1.0", "auto"), ("-1", "auto"), ("-1", "ragged_dot")],
                         ids=["dropping", "dropless", "dropless_ragged_dot"])  # dropless: shard_map in the vmap
def test_moe_pipeline_equals_gradient_accumulation_over_its_microbatches(capacity_factor, impl):
    """MoE router statistics come out of the pipeline for every microbatch: losses, drop counts and gradients equal
    the non-pipelined model accumulating the same M=4 microbatches (every row carries the same loss weight, so
    per-microbatch router losses weigh the same in both). Expert load keeps one row per (microbatch, layer)."""
    moe = ("num_experts=4", "num_experts_per_tok=2", "moe_layer_interval=2", "capacity_factor=" + capacity_factor,
           "ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "moe_dropless_impl=" + impl)
    ref_cfg = tiny_config(*SMALL, *moe, "gradient_accumulation_steps=4", num_devices=4, global_batch=16)
    trainer = Trainer(ref_cfg, mesh_for(ref_cfg))
    params, batch = random_params(trainer), packed_batch(ref_cfg, trainer.mesh)
    cfg = small_config(*moe, "ici_pipeline_parallelism=2", "num_pipeline_microbatches=4")  # 4 blocks: R=2
    (ref_sums, ref_grads), (sums, grads) = [
        sums_and_grads(c, p, batch) for c, p in ((ref_cfg, params), (cfg, pipeline.from_scanned(params, cfg.model.pipeline)))
    ]
    for key in ("loss_sum", "weight_sum", "moe_lb_loss", "moe_z_loss", "moe_assigned", "moe_dropped"):
        np.testing.assert_allclose(sums[key], ref_sums[key], rtol=TOLERANCE, err_msg=key)
    assert sums["moe_load"].shape == (4 * 4, 4) and ref_sums["moe_load"].shape == (4, 4)  # [rows, experts]
    np.testing.assert_allclose(sums["moe_load"].sum(), ref_sums["moe_load"].sum(), rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(grads), ref_grads) < TOLERANCE


# --------------------------------------------------------------------------------------------- bubbles


def test_nan_in_bubble_slots_reaches_neither_outputs_nor_gradients(monkeypatch):
    """Bubble slots start as NaN; outputs and every gradient stay finite and equal the scanned decoder's.

    Without the bubble mask the same NaNs do reach the gradients (0 x NaN), which shows the test can fail.
    """
    flat_cfg = small_config("num_layers=4")
    cfg = small_config("num_layers=4", "ici_pipeline_parallelism=2", "num_pipeline_microbatches=4")  # R=2
    x = jax.random.normal(jax.random.key(1), (16, 16, 32))
    segment_ids, positions = jnp.ones((16, 16), jnp.int32), jnp.broadcast_to(jnp.arange(16), (16, 16))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    reference = Decoder(flat_cfg.model, jnp.float32, jnp.float32)
    params = nn.unbox(reference.init(jax.random.key(0), x, segment_ids, positions))["params"]
    piped = pipeline.Pipeline(cfg.model, DecoderLayer, jnp.float32, jnp.float32, bubble_fill=float("nan"))
    piped_params = pipeline.from_scanned({"decoder": params}, cfg.model.pipeline)["decoder"]["pipeline"]

    def grads(module, p, mesh_cfg):
        objective = lambda p, x: jnp.sum(module.apply({"params": p}, x, segment_ids, positions) * cotangent)
        with mesh_context(mesh_for(mesh_cfg), sharding.flax_rules(mesh_cfg)):
            return jax.device_get(compile_fast(jax.jit(jax.value_and_grad(objective, argnums=(0, 1))), p, x)(p, x))

    ref_value, (ref_params, ref_x) = grads(reference, params, flat_cfg)
    value, (param_grads, x_grads) = grads(piped, piped_params, cfg)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves((value, param_grads, x_grads)))
    np.testing.assert_allclose(value, ref_value, rtol=TOLERANCE)
    assert max_relative_difference(x_grads, ref_x) < TOLERANCE
    assert max_relative_difference(pipeline.to_scanned({"decoder": {"pipeline": param_grads}})["decoder"]["layers"],
                                   ref_params["layers"]) < TOLERANCE

    monkeypatch.setattr(pipeline, "_zero_bubbles", lambda x, valid: x)
    _, (param_grads, _) = grads(piped, piped_params, cfg)
    assert not all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(param_grads))


def test_bubble_fraction_follows_the_formula():
    assert small_config().model.pipeline is None
    cfg = small_config("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=8")
    shape = cfg.model.pipeline
    assert (shape.stages, shape.layers_per_stage, shape.repeats, shape.microbatches) == (4, 1, 2, 8)
    schedule = pipeline_schedule.of(shape)
    assert schedule.iterations == 8 * 2 + 4 - 1
    assert schedule.bubble_fraction == pytest.approx(3 / 19)


def test_without_stages_the_parameter_tree_is_unchanged():
    cfg = small_config("num_pipeline_repeats=2", "num_pipeline_microbatches=4")  # ignored: one stage
    params = Trainer(cfg, mesh_for(cfg)).abstract_state.params
    assert set(params["decoder"]) == {"layers"}
    assert params["decoder"]["layers"]["mlp"]["wo"]["kernel"].names == ("layers", "mlp", "embed")


def test_pipelined_weights_are_born_stage_sharded():
    cfg = small_config("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=8")
    trainer = Trainer(cfg, mesh_for(cfg))
    box = trainer.abstract_state.params["decoder"]["pipeline"]["layers"]["mlp"]["wo"]["kernel"]
    assert box.names == ("circular_repeats", "layers", "layers_per_stage", "mlp", "embed")
    assert box.value.shape == (2, 4, 1, 64, 32)
    spec = trainer.state_shardings.params["decoder"]["pipeline"]["layers"]["mlp"]["wo"]["kernel"].spec
    assert spec[:3] == (None, "stage", None)


# --------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["ici_pipeline_parallelism=4", "num_layers=6"], "num_layers=6 is not divisible by pipeline stages"),
        (["ici_pipeline_parallelism=2", "num_pipeline_repeats=3"], "must equal pipeline stages x"),
        (["ici_pipeline_parallelism=4", "num_pipeline_microbatches=6"], "must be a multiple of the 4 pipeline"),
        (["ici_pipeline_parallelism=2", "num_pipeline_microbatches=32"], "not divisible by num_pipeline_micro"),
        (["ici_pipeline_parallelism=2", "num_pipeline_microbatches=8", "gradient_accumulation_steps=4"],
         "gradient_accumulation_steps) is not divisible"),
        (["ici_pipeline_parallelism=2", "num_pipeline_microbatches=8"], "not divisible by the 4 batch shards"),
        (["ici_pipeline_parallelism=2", "scan_layers=false"], "needs scan_layers=true"),
        (["ici_pipeline_parallelism=2", "num_layers_per_pipeline_stage=0"], "must be >= 1"),
        (["ici_pipeline_parallelism=2", "num_pipeline_repeats=0"], "num_pipeline_repeats must be >= 1 or -1"),
    ],
)
def test_pipeline_mistakes_are_one_line_config_errors(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as error:  # when the run is loaded, before compiling
        small_config(*overrides)
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------------------------- the CLI


@pytest.mark.slow
def test_cli_trains_a_pipelined_model(tmp_path):
    command = [
        sys.executable, "-m", "maxshard.train", "configs/base.yml", "cpu_device_count=8", "dataset_type=synthetic",
        "ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_repeats=2",
        "num_pipeline_microbatches=8", "num_layers=8", "steps=6", "log_period=2", "eval_period=0",
        "emb_dim=64", "mlp_dim=128", "num_heads=2", "num_kv_heads=2", "max_target_length=32",
        "learning_rate=1e-2", "warmup_steps_fraction=0", "enable_checkpointing=false",
        f"base_output_directory={tmp_path}",
    ]
    result = cli_processes.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    losses = [float(v) for v in re.findall(r"^step \d+/6 .*?loss ([0-9.]+)", result.stdout, re.MULTILINE)]
    assert len(losses) >= 3 and all(np.isfinite(losses))
    assert losses[-1] < 0.95 * losses[0]  # 6.5 -> 5.7 in six steps on the synthetic task
