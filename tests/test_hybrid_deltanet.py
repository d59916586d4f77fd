"""A 3:1 hybrid (Qwen3-Next's unit: three gated DeltaNet layers, then one full-attention layer) at the tiny preset's
widths, read from `layer_types` in Hugging Face's spelling: scanned as units of four, the same loss under fsdp x
tensor as on one device (float32, within 1e-5), the same gradients as closely as one device agrees with itself, and a
train step of the run's Trainer there moves both kinds' parameters.

Gradients: the hybrid's are far more sensitive to rounding than an attention model's (the chunked delta rule's
triangular solve and decays amplify it), so the 1e-5 a layout of attention layers is held to would fail on one
device against itself. The bound is measured instead, on the same compiled step: the gradients' change when every
parameter moves by a relative 1e-7 (float32 rounding) on one device. A layout mistake (a head group split across
devices, a document boundary lost) moves them by orders of magnitude more.

Batches are packed with a document boundary at a different place in every row, so a DeltaNet state or a conv window
that crossed a document, or segment ids sharded apart from their tokens, would change the loss.
"""

from __future__ import annotations

import jax
import flax.linen as nn
import numpy as np
import pytest

from maxshard import data
from maxshard.spec import blocks
from maxshard.spec.blocks import Layer, Stack
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import max_relative_difference, mesh_for, tiny_config
from tests.test_pipeline import TOLERANCE, compile_fast, loss_and_grads, packed_batch, random_params

# configs/models/tiny.yml's widths; DeltaNet's heads as wide as attention's, chunks shorter than the documents
HYBRID = ("emb_dim=64", "num_heads=4", "num_kv_heads=4", "head_dim=16", "mlp_dim=256", "num_layers=8",
          "layer_types=" + ",".join((["linear_attention"] * 3 + ["full_attention"]) * 2), "linear_num_key_heads=2",
          "linear_num_value_heads=4", "linear_key_head_dim=16", "linear_value_head_dim=16", "delta_chunk_size=8",
          "attention=dot_product")
LAYOUT = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")


def one_device_reference(*model: str) -> tuple:
    """`model` on one device: parameters drawn on the host, a packed batch, the loss and gradients, and how far the
    gradients move when every parameter moves by a relative 1e-7 (the same compiled step run twice): float32's
    rounding as this model amplifies it, the bound a layout's gradients are held to."""
    cfg = tiny_config(*model, num_devices=1)
    trainer = Trainer(cfg, mesh_for(cfg))
    params, batch = random_params(trainer), packed_batch(cfg, trainer.mesh)
    rng = np.random.default_rng(1)
    nudged = jax.tree.map(lambda p: (p * (1 + 1e-7 * rng.standard_normal(p.shape))).astype(p.dtype), params)
    placed = [jax.device_put(p, trainer.state_shardings.params) for p in (params, nudged)]
    with mesh_context(trainer.mesh, trainer.rules):
        grads_fn = compile_fast(jax.jit(trainer._grads), placed[0], batch)
        (grads, sums), (nudged_grads, _) = (jax.device_get(grads_fn(p, batch)) for p in placed)
    noise = max_relative_difference(nudged_grads, grads)
    assert 0 < noise < 1e-2  # float32 rounding, not a broken step
    return params, batch, float(sums["loss_sum"] / sums["weight_sum"]), grads, noise


@pytest.fixture(scope="module")
def one_device():
    return one_device_reference(*HYBRID)


def test_the_hybrid_scans_units_of_three_deltanet_layers_and_one_attention_layer() -> None:
    cfg = tiny_config(*HYBRID, num_devices=1).model
    delta, full = Layer("gated_deltanet", "dense"), Layer("gqa", "dense")
    assert blocks.stacks(cfg) == (Stack("layers", (delta,) * 3 + (full,), 2),)


def test_fsdp_x_tensor_gives_one_devices_loss_and_gradients(one_device) -> None:
    params, batch, ref_loss, ref_grads, noise = one_device
    loss, grads = loss_and_grads(tiny_config(*HYBRID, *LAYOUT), params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert 0 < noise < 1e-2  # the one-device bound itself: float32 rounding, not a broken step
    assert max_relative_difference(grads, ref_grads) < max(TOLERANCE, 2 * noise)
    unit = ref_grads["decoder"]["layers"]
    for layer, scope in (("layer_0", "linear_attention"), ("layer_3", "attention")):  # both kinds are trained
        assert all(np.any(g) for g in jax.tree.leaves(unit[layer][scope])), scope


def test_a_train_step_under_fsdp_x_tensor_has_one_devices_loss_and_moves_both_kinds(one_device) -> None:
    params, batch, ref_loss, _, _ = one_device
    cfg = tiny_config(*HYBRID, *LAYOUT)
    trainer = Trainer(cfg, mesh_for(cfg))
    state = trainer.state_from(jax.device_put(params, trainer.state_shardings.params))
    before = jax.device_get(nn.unbox(state.params))["decoder"]["layers"]  # the step donates the state
    new, metrics = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=TOLERANCE)
    after = jax.device_get(nn.unbox(new.params))["decoder"]["layers"]
    for layer, scope in (("layer_0", "linear_attention"), ("layer_3", "attention")):
        moved = jax.tree.map(lambda a, b: not np.allclose(a, b), after[layer][scope], before[layer][scope])
        assert all(jax.tree.leaves(moved)), (layer, moved)
