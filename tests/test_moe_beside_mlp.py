"""Gemma 4's MoE block (`moe_beside_mlp`) at the model's seams: routed experts beside every MoE layer's dense MLP
(their numbers against transformers: tests/test_convert_gemma4.py, the gemma4_moe fixture).

A tiny model of 4 such layers has one device's loss and gradients under expert x fsdp x tensor, a circular pipeline
and the dropping path at a capacity that drops nothing, on a packed batch; both halves of the block, the router's
norm and the per-expert scale all take gradient; the FLOP inventory counts the dense MLP beside the experts; LoRA
adapts that MLP; the key refuses what it cannot mean in one line.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from maxshard.errors import ConfigError
from maxshard.model import flops as model_flops
from maxshard.model.layers import pipeline
from maxshard.spec import blocks
from maxshard.training import optim
from tests.helpers import max_relative_difference, tiny_config
from tests.test_pipeline import TOLERANCE, loss_and_grads, one_device_run

# The router losses are not linear in the batch (a pipeline's microbatches each see their own balance): off, so
# that every layout computes the one function
BLOCK = ("num_layers=4", "num_experts=4", "num_experts_per_tok=2", "moe_mlp_dim=32", "capacity_factor=-1",
         "moe_beside_mlp=true", "post_norms=true", "mlp_activation=gelu_tanh", "attention=dot_product",
         "load_balance_loss_weight=0", "router_z_loss_weight=0")


@pytest.fixture(scope="module")
def one_device():
    """The block's one-device reference; random_params draws every scale (the norms', the router norm's, the
    per-expert one) about 1."""
    return one_device_run(*BLOCK)


@pytest.mark.parametrize("layout", [
    ("ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=4"),
    ("capacity_factor=4",),  # the dropping path, 8-way data parallel, with slots for every choice
])
def test_the_block_under_a_layout_gives_one_devices_loss_and_gradients(one_device, layout) -> None:
    _, params, batch, ref_loss, ref_grads = one_device
    cfg = tiny_config(*BLOCK, *layout)
    staged = cfg.model.pipeline
    loss, grads = loss_and_grads(cfg, pipeline.from_scanned(params, staged) if staged else params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(grads) if staged else grads, ref_grads) < TOLERANCE


def test_both_halves_the_router_norm_and_the_expert_scale_are_trained(one_device) -> None:
    cfg, _, _, _, grads = one_device
    layer = grads["decoder"]["layers"]["layer_0"]
    for part in ("mlp", "moe", "moe_norm", "post_dense_norm", "post_moe_norm"):
        assert all(np.any(g) for g in jax.tree.leaves(layer[part])), part
    assert np.any(layer["moe"]["router_norm"]["scale"]) and np.any(layer["moe"]["expert_scale"])
    assert [layer.mlp for layer in blocks.layers(cfg.model)] == ["moe_beside_dense"] * 4
    decays = optim.decay_mask(grads)["decoder"]["layers"]["layer_0"]["moe"]  # a gain is not decayed toward 0
    assert decays["wi_0"] and not decays["expert_scale"] and not decays["router_norm"]["scale"]


def test_the_flop_inventory_counts_the_dense_mlp_beside_the_experts(one_device) -> None:
    cfg = one_device[0].model
    m = model_flops.matmuls(cfg)
    assert m.dense_mlp == 4 * 3 * cfg.emb_dim * cfg.mlp_dim
    assert m.routed_experts == 4 * 2 * 3 * cfg.emb_dim * 32 and m.router == 4 * cfg.emb_dim * 4


def test_lora_adapts_the_dense_mlp_beside_the_experts() -> None:
    cfg = tiny_config(*BLOCK, "lora_rank=4", "lora_targets=gate", num_devices=1).model
    assert model_flops.lora_matmul_params(cfg) == 4 * 4 * (cfg.emb_dim + cfg.mlp_dim)


@pytest.mark.parametrize("keys,message", [
    (("num_experts=1", "num_experts_per_tok=1"), "moe_beside_mlp runs routed experts .* needs num_experts > 1"),
    (("pre_norms=false",), r"needs num_experts > 1 \(got 4\) and pre_norms=true \(got false\)"),
])
def test_the_key_refuses_what_it_cannot_mean_in_one_line(keys, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(*BLOCK, *keys, num_devices=1)
