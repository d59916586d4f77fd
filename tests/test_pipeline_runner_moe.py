"""MoE models under the table pipeline schedules: the runner (model/layers/pipeline_runner.py) carries the router
statistics, so the step's loss, sums and gradients equal the circular pipeline's.

The reference is the circular schedule on the same parameters and batch with the router losses on: both compute
them per (layer, microbatch) (tests/test_pipeline.py compares that with gradient accumulation, tests/test_blocks.py
the circular pipeline with one device where they are off), so equality here checks that each stage's share of the
router losses gets its cotangent in the stage's own backward, and that the statistics (the load balance, z and
sequence losses, drops, per-layer loads, the selection biases' loads that `move_bias` reads) come back complete.
Gradients: each leaf within 1e-5 of its own largest value (tests/test_pipeline.py says why).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from maxshard.model import trainable
from maxshard.spec import blocks
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import max_relative_difference, mesh_for
from tests.test_pipeline import TOLERANCE, compile_fast, packed_batch, random_params, small_config

# DeepSeek-V3's options: a dense first layer before the pipeline, dropless experts behind a sigmoid router with a
# selection bias moved toward equal load, a shared expert, the sequence-wise balance loss; the router losses weighted
# well above their defaults, so that a missing cotangent moves the router's gradient past the tolerance
DEEPSEEK_LIKE = ("num_layers=3", "first_k_dense_replace=1", "num_experts=4", "num_experts_per_tok=2",
                 "capacity_factor=-1", "moe_dropless_impl=dense", "moe_router=sigmoid", "moe_router_bias=true",
                 "moe_bias_update_rate=0.01", "num_shared_experts=1", "load_balance_loss_weight=0.1",
                 "router_z_loss_weight=0.01", "moe_seq_balance_loss_weight=0.1", "num_layers_per_pipeline_stage=1",
                 "num_pipeline_microbatches=2")
# Mixtral's: a softmax router, experts of limited capacity that drop tokens
CAPACITY = ("num_layers=2", "num_experts=4", "num_experts_per_tok=2", "capacity_factor=0.5",
            "load_balance_loss_weight=0.1", "router_z_loss_weight=0.01", "num_layers_per_pipeline_stage=1",
            "num_pipeline_microbatches=2")
MODELS = {"deepseek_like": DEEPSEEK_LIKE, "capacity": CAPACITY}
P2_FSDP4 = ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4")
CASES = {  # name -> (model, schedule, layout)
    # the fused backward with expert parallelism inside a stage, there with the grouped dropless experts
    # (moe_grouped.py: their exchange is a shard_map over `expert` inside the runner's over `stage`; the same
    # function as the dense reference's, which compiles faster)
    "deepseek_like_1f1b_expert2": ("deepseek_like", "1f1b", ("ici_pipeline_parallelism=2", "ici_expert_parallelism=2",
                                                             "ici_fsdp_parallelism=2", "moe_dropless_impl=tiled")),
    "capacity_zero_bubble": ("capacity", "zero_bubble", P2_FSDP4),  # the split backward
}


def sums_and_grads(cfg, params, batch) -> tuple[dict, dict]:
    """The step's sums and summed gradients, with the parameters split as the train step splits them (the
    selection biases frozen: `move_bias` moves them, no gradient)."""
    trainer = Trainer(cfg, mesh_for(cfg))
    trained, frozen = trainable.split(jax.device_put(params, trainer.state_shardings.params), cfg.model)
    with mesh_context(trainer.mesh, trainer.rules):
        grads, sums = compile_fast(jax.jit(trainer._grads), trained, batch, frozen)(trained, batch, frozen)
    return jax.device_get(sums), jax.device_get(grads)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    """(the case's model and layout, parameters, a packed batch, the circular schedule's sums and gradients on
    pipeline=2 x fsdp=4)."""
    model, schedule, layout = CASES[request.param]
    cfg = small_config(*MODELS[model], *P2_FSDP4)
    trainer = Trainer(cfg, mesh_for(cfg))
    params, batch = random_params(trainer), packed_batch(cfg, trainer.mesh)
    return (MODELS[model], schedule, layout), params, batch, *sums_and_grads(cfg, params, batch)


def test_the_runner_carries_the_router_statistics_like_the_circular_pipeline(case):
    (model, schedule, layout), params, batch, ref_sums, ref_grads = case
    cfg = small_config(*model, *layout, f"pipeline_schedule={schedule}")
    assert cfg.model.pipeline.schedule == schedule
    sums, grads = sums_and_grads(cfg, params, batch)
    assert sorted(sums) == sorted(ref_sums)  # and below their shapes: the carry of gradient accumulation's scan
    for key in ("loss_sum", "weight_sum", "moe_lb_loss", "moe_z_loss", "moe_seq_loss", "moe_assigned",
                "moe_dropped"):
        np.testing.assert_allclose(sums[key], ref_sums[key], rtol=TOLERANCE, err_msg=key)
    assert ref_sums["moe_lb_loss"] > 0 and ref_sums["moe_z_loss"] > 0
    np.testing.assert_allclose(sums["moe_load"], ref_sums["moe_load"], rtol=TOLERANCE)  # per layer and microbatch
    if model is CAPACITY:
        assert ref_sums["moe_dropped"] > 0  # the capacity drops
    else:  # the sequence-wise loss, and what move_bias reads: each selection bias's load over every microbatch
        assert ref_sums["moe_seq_loss"] > 0
        assert sums["moe_bias_loads"].keys() == ref_sums["moe_bias_loads"].keys()
        assert max_relative_difference(sums["moe_bias_loads"], ref_sums["moe_bias_loads"]) < TOLERANCE
    assert max_relative_difference(grads, ref_grads) < TOLERANCE


def _padded(batch: dict) -> dict:
    """`batch` with padding (segment 0) at the ends of the first rows, more in the earlier ones, and one row all
    padding: the microbatches hold different numbers of real tokens and of sequences holding one."""
    batch = dict(batch)
    rows, length = batch["segment_ids"].shape
    t = np.arange(length)[None, :]
    real = t < np.where(np.arange(rows) < rows // 4, 4 + np.arange(rows), length)[:, None]
    real[rows // 2] = False
    batch["segment_ids"] = np.where(real, batch["segment_ids"], 0).astype(np.int32)
    batch["loss_weights"] = np.where(real, batch["loss_weights"], 0.0).astype(np.float32)
    return batch


def test_the_moe_layers_after_the_pipeline_run_in_the_last_part_as_in_the_circular_pipeline():
    """DeepSeek-V3's options on a [local, global] pattern that leaves a layer over after the pipeline, and a
    multi-token prediction module: both MoE layers, which the runner's last part runs per microbatch under 1f1b where
    the circular pipeline runs them on the whole batch after its stages. Their z-loss and sequence-wise loss are
    their microbatches' weighted by their share of the batch's real tokens and sequences (training/pipelined.py), so
    with padding that differs between microbatches the loss, the router statistics and the gradients equal the
    circular pipeline's within 1e-5; each layer's load is one more row of the per-layer loads, and their selection
    biases move with the whole batch's. The Switch balance loss is off (refused here: tests/test_pipeline_runner.py);
    its statistic, a metric, is the microbatches' mean."""
    model = (*DEEPSEEK_LIKE, "num_layers=6", "attention_pattern=local,global", "sliding_window=4", "mtp_depth=1",
             "mtp_loss_weight=0.5", "load_balance_loss_weight=0")
    ref_cfg = small_config(*model, *P2_FSDP4)
    assert [s.name for s in blocks.stacks(ref_cfg.model)] == ["dense_layers", "layers", "last_layers"]
    trainer = Trainer(ref_cfg, mesh_for(ref_cfg))
    params, batch = random_params(trainer), _padded(packed_batch(ref_cfg, trainer.mesh))
    ref_sums, ref_grads = sums_and_grads(ref_cfg, params, batch)
    sums, grads = sums_and_grads(small_config(*model, *P2_FSDP4, "pipeline_schedule=1f1b"), params, batch)
    assert sorted(sums) == sorted(ref_sums)
    for key in ("loss_sum", "weight_sum", "mtp_nll_sum", "moe_z_loss", "moe_seq_loss", "moe_assigned", "moe_dropped",
                "moe_load"):
        np.testing.assert_allclose(sums[key], ref_sums[key], rtol=TOLERANCE, err_msg=key)
    assert sums["moe_load"].shape[0] == 4 * 2 + 2  # 4 stage layers x 2 microbatches, the left-over, the module's
    after = {k for k in sums["moe_bias_loads"] if k.startswith(("decoder/last_layers/", "mtp_1/"))}
    assert sums["moe_bias_loads"].keys() == ref_sums["moe_bias_loads"].keys() and len(after) == 2
    assert max_relative_difference(sums["moe_bias_loads"], ref_sums["moe_bias_loads"]) < TOLERANCE
    assert max_relative_difference(grads, ref_grads) < TOLERANCE
