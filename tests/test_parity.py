"""Every parallel layout trains exactly like one device: same losses and parameters after three steps (float32).

Tolerances (each leaf's error relative to its own largest value): losses 1e-5; first-step gradients 1e-5;
parameters after three AdamW steps 5e-4, because Adam divides by sqrt(v) and so magnifies the rounding of
near-zero gradients into differences of order learning_rate x 1e-2. Parallel runs sum the same numbers in another
order, so bit equality is not expected; a sharding mistake (a missing all-reduce, a wrong shard) moves results by
orders of magnitude more.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from maxshard import data
from maxshard.training.step import Trainer
from tests.helpers import layout_overrides, loss_and_grads, max_relative_difference, mesh_for, tiny_config

# Combinations of axes; every axis alone is tests/test_layouts_cli.py's (a fresh run through the CLI, losses 1e-5).
LAYOUTS = {
    "fsdp4_tp2": ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
    "data2_fsdp2_tp2": ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
    "seq2_fsdp4": ["ici_sequence_parallelism=2", "ici_fsdp_parallelism=4"],
    "fsdpT2_fsdp4": ["ici_fsdp_transpose_parallelism=2", "ici_fsdp_parallelism=4"],
    "expert2_fsdp4": ["ici_expert_parallelism=2", "ici_fsdp_parallelism=4"],
    "tseq2_fsdp4": ["ici_tensor_sequence_parallelism=2", "ici_fsdp_parallelism=4"],
}
STEPS = 3


def _batches(cfg, trainer) -> list[dict[str, np.ndarray]]:
    it = data.make_input(cfg, trainer.mesh)
    return [jax.device_get(next(it)) for _ in range(STEPS)]


def _train(cfg, initial_params, batches) -> tuple[list[float], dict, dict]:
    """(losses of each step, first-step gradients, final parameters)."""
    trainer = Trainer(cfg, mesh_for(cfg))
    params = jax.device_put(initial_params, trainer.state_shardings.params)
    state = trainer.init_state().replace(params=params)
    batch_shardings = trainer.batch_shardings(data.batch_sharding(cfg, trainer.mesh))
    batches = [jax.device_put(b, batch_shardings) for b in batches]
    grads = loss_and_grads(trainer, params, batches[0])[1]
    step = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, grads, jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_config("ici_fsdp_parallelism=1", num_devices=1)
    trainer = Trainer(cfg, mesh_for(cfg))
    params = jax.device_get(trainer.init_state().params)
    batches = _batches(cfg, trainer)
    losses, grads, final = _train(cfg, params, batches)
    return params, batches, losses, grads, final


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_device(name, reference):
    params, batches, ref_losses, ref_grads, ref_final = reference
    cfg = tiny_config(*layout_overrides(LAYOUTS[name]))
    losses, grads, final = _train(cfg, params, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_relative_difference(grads, ref_grads) < 1e-5
    assert max_relative_difference(final, ref_final) < 5e-4
    assert ref_losses[-1] < ref_losses[0]  # the steps really changed something


def test_init_is_layout_independent(reference):
    """The same seed gives the same parameters whether they are born on one device or sharded 4x2."""
    params = reference[0]
    cfg = tiny_config("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    sharded = jax.device_get(Trainer(cfg, mesh_for(cfg)).init_state().params)
    assert max_relative_difference(sharded, params) < 1e-6


def test_gradient_accumulation_equals_one_big_batch(reference):
    params, batches = reference[:2]
    one_step = batches[:1]
    cfg1 = tiny_config("ici_fsdp_parallelism=8")
    cfg4 = tiny_config("ici_fsdp_parallelism=8", "gradient_accumulation_steps=4")
    losses1, grads1, final1 = _train(cfg1, params, one_step)
    losses4, grads4, final4 = _train(cfg4, params, one_step)
    np.testing.assert_allclose(losses4, losses1, rtol=1e-5)
    assert max_relative_difference(grads4, grads1) < 1e-5
    assert max_relative_difference(final4, final1) < 5e-4
    assert max_relative_difference(final1, params) > 1e-3  # one step moved the parameters


def test_tensor_sequence_shards_the_norms_length():
    """`tensor_sequence` splits heads like `tensor` and also the length of the residual stream and its RMSNorms
    (activation_norm_length)."""
    import jax.numpy as jnp

    from maxshard.model.layers.decoder import norm
    from maxshard.model.layers.norms import RMSNorm
    from maxshard.parallel import sharding
    from maxshard.training.step import mesh_context

    cfg = tiny_config(*layout_overrides(LAYOUTS["tseq2_fsdp4"]))
    layer, x = RMSNorm(), jnp.ones((8, cfg.max_target_length, cfg.emb_dim))
    params = layer.init(jax.random.key(0), x)
    with mesh_context(mesh_for(cfg), sharding.flax_rules(cfg)):
        out = jax.jit(lambda p, x: norm(layer.bind(p), x))(params, x)
    length_axes = out.sharding.spec[1]
    assert "tensor_sequence" in ((length_axes,) if isinstance(length_axes, str) else length_axes)
