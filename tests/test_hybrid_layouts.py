"""A 3:1 gated DeltaNet / attention hybrid (Qwen3-Next's unit, from `layer_types`) through the layouts beyond
fsdp x tensor (tests/test_hybrid_deltanet.py): the circular pipeline and a table schedule over hybrid units (and
DeltaNet layers left over after 1f1b's stages), and a Qwen3.5-MoE-like hybrid (every layer MoE, a sigmoid-gated
shared expert) under expert x fsdp. Each equals one device: the loss within 1e-5, the gradients within the bound
tests/test_hybrid_deltanet.py measures (how far float32 rounding of the parameters moves them on one device, on the
same compiled step), or 1e-5 where larger.

A pipeline stage holds whole units (parallel/stages.py counts `pattern_length`), so a stage that split a unit, or
a repeat that ran another unit's DeltaNet weights, would change the loss by orders of magnitude more. Batches are
packed with a document boundary at a different place in every row (tests/test_pipeline.py `packed_batch`), so a
DeltaNet state or segment ids that did not travel with their microbatch would change it too.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from maxshard.errors import ConfigError
from maxshard.model.layers import pipeline
from maxshard.spec import blocks
from tests.helpers import max_relative_difference, tiny_config
from tests.test_hybrid_deltanet import HYBRID, one_device_reference as _reference
from tests.test_pipeline import TOLERANCE, loss_and_grads, packed_batch

# Qwen3.5-MoE's options on the hybrid: every layer an MoE (dropless, top-2 of 4) with one sigmoid-gated shared expert
MOE = ("num_experts=4", "num_experts_per_tok=2", "capacity_factor=-1", "num_shared_experts=1",
       "shared_expert_gate=true", "moe_layer_interval=1", "num_layers=4",
       "layer_types=" + ",".join(["linear_attention"] * 3 + ["full_attention"]))
# 8 layers = 2 hybrid units; one unit per stage
PIPELINES = {
    "circular_pipeline2_fsdp4": ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
                                 "num_pipeline_microbatches=4"),
    "1f1b_pipeline2_fsdp2_tensor2": ("pipeline_schedule=1f1b", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2",
                                     "ici_tensor_parallelism=2", "num_pipeline_microbatches=2"),
}


@pytest.fixture(scope="module")
def dense():
    return _reference(*HYBRID)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_a_pipeline_over_hybrid_units_gives_one_devices_loss_and_gradients(dense, name):
    params, batch, ref_loss, ref_grads, noise = dense
    cfg = tiny_config(*HYBRID, *PIPELINES[name])
    shape = cfg.model.pipeline
    assert (shape.stages, shape.layers_per_stage, shape.repeats) == (2, 1, 1)  # one unit of 4 layers a stage
    loss, grads = loss_and_grads(cfg, pipeline.from_scanned(params, shape), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    grads = pipeline.to_scanned(grads)
    assert max_relative_difference(grads, ref_grads) < max(TOLERANCE, 2 * noise)
    unit = grads["decoder"]["layers"]
    for layer, scope in (("layer_0", "linear_attention"), ("layer_3", "attention")):  # both kinds are trained
        assert all(np.any(g) for g in jax.tree.leaves(unit[layer][scope])), scope


def test_the_deltanet_layers_a_hybrid_leaves_after_1f1b_s_stages_give_one_devices_loss_and_gradients():
    """10 layers: two units through the stages and two DeltaNet layers left over, which the runner's last part runs
    per microbatch on the last stage (training/pipelined.py), where the circular pipeline runs them on the
    whole batch."""
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * 2 + ["linear_attention"] * 2
    model = (*HYBRID, "num_layers=10", "layer_types=" + ",".join(layer_types))
    params, batch, ref_loss, ref_grads, noise = _reference(*model)
    cfg = tiny_config(*model, "pipeline_schedule=1f1b", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
                      "num_pipeline_microbatches=2")
    assert [s.name for s in blocks.stacks(cfg.model)] == ["layers", "last_layers"]
    loss, grads = loss_and_grads(cfg, pipeline.from_scanned(params, cfg.model.pipeline), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(grads), ref_grads) < max(TOLERANCE, 2 * noise)
    assert all(np.any(g) for g in jax.tree.leaves(grads["decoder"]["last_layers"]))


def test_a_gated_shared_expert_hybrid_moe_under_expert_x_fsdp_gives_one_devices_loss_and_gradients():
    params, batch, ref_loss, ref_grads, noise = _reference(*HYBRID, *MOE)
    cfg = tiny_config(*HYBRID, *MOE, "ici_expert_parallelism=4", "ici_fsdp_parallelism=2")
    loss, grads = loss_and_grads(cfg, params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(grads, ref_grads) < max(TOLERANCE, 2 * noise)
    unit = ref_grads["decoder"]["layers"]
    for layer in ("layer_0", "layer_3"):  # every layer routes, and its shared expert's gate is trained
        moe = unit[layer]["moe"]
        assert all(np.any(g) for g in jax.tree.leaves(moe)), (layer, jax.tree.map(np.any, moe))


@pytest.mark.parametrize("overrides, fragment", [
    (("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2"),
     "2 blocks of 4 layers (layer_types' period 4) is not divisible by pipeline stages"),
    (("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_repeats=2"),
     "2 blocks of 4 layers (layer_types' period 4) must equal pipeline stages x"),
])
def test_a_pipeline_that_would_split_a_hybrid_unit_is_a_one_line_error(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as error:
        tiny_config(*HYBRID, *overrides)
    assert "\n" not in str(error.value)
