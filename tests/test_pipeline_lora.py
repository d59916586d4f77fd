"""LoRA under a table pipeline schedule: the runner differentiates the adapters alone, inside each stage.

With `lora_rank` > 0 the trained tree is the adapters and the frozen one the base (`model/trainable.py`); the runner
(`model/layers/pipeline_runner.py`) gets both for the stack and for the parts around it, takes each stage's
backward with respect to the adapters only and leaves the base without a gradient. The step's loss sums and adapter
gradients under 1F1B (pipeline=2 x fsdp=4) must equal one device's within 1e-5 (each leaf relative to its own
largest value, as tests/test_pipeline.py bounds them). Every parameter, adapters' B included, is drawn at random so
that every adapter gradient is non-zero (a fresh B is zero, and with it A's gradient).
"""

from __future__ import annotations

import jax
import numpy as np

from maxshard.model import trainable
from maxshard.model.layers import pipeline
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import max_relative_difference, mesh_for, tiny_config
from tests.test_pipeline import SMALL, TOLERANCE, compile_fast, packed_batch, random_params, small_config

LORA = ("lora_rank=4", "lora_alpha=8", "lora_targets=q,k,v,o,gate,up,down", "num_layers=2")


def _lora_sums_and_grads(cfg, params, batch) -> tuple[dict, dict]:
    """The step's loss sums and the gradients of the trained (adapter) tree, from `Trainer._grads` as the step asks."""
    trainer = Trainer(cfg, mesh_for(cfg))
    params = jax.device_put(params, trainer.state_shardings.params)
    trained, frozen = trainable.split(params, cfg.model)
    with mesh_context(trainer.mesh, trainer.rules):
        grads, sums = compile_fast(jax.jit(trainer._grads), trained, batch, frozen)(trained, batch, frozen)
    return jax.device_get(sums), jax.device_get(grads)


def test_lora_under_1f1b_has_one_device_s_loss_and_adapter_gradients():
    ref_cfg = tiny_config(*SMALL, *LORA, "ici_fsdp_parallelism=1", num_devices=1, global_batch=8)
    ref_trainer = Trainer(ref_cfg, mesh_for(ref_cfg))
    params, batch = random_params(ref_trainer), packed_batch(ref_cfg, ref_trainer.mesh)
    ref_sums, ref_grads = _lora_sums_and_grads(ref_cfg, params, batch)

    cfg = small_config(*LORA, "pipeline_schedule=1f1b", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
                       "num_layers_per_pipeline_stage=1", "num_pipeline_microbatches=2", global_batch=8)
    assert cfg.model.pipeline.schedule == "1f1b"
    sums, grads = _lora_sums_and_grads(cfg, pipeline.from_scanned(params, cfg.model.pipeline), batch)
    for key in ("loss_sum", "weight_sum"):
        np.testing.assert_allclose(sums[key], ref_sums[key], rtol=TOLERANCE, err_msg=key)
    grads = pipeline.to_scanned(grads)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)  # the adapters alone: no base gradient
    assert all(np.any(g) for g in jax.tree.leaves(ref_grads))
    assert max_relative_difference(grads, ref_grads) < TOLERANCE
