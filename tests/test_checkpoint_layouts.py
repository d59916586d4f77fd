"""A checkpoint written under one layout restores under any other and continues the same run.

One run directory, two layouts taking turns: a pipelined run (stage=4 x fsdp=2, 2 repeats, 8 microbatches) trains
and saves at step 2; a scanned fsdp=8 run resumes it, trains one step and saves at step 3; the pipeline resumes that
and trains step 4. The losses equal an uninterrupted pipelined run's to float32 rounding, and the data position
travels with the checkpoint. Cheaper restore-only checks cover MoE expert parallelism, another device count and
`load_parameters_path`.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from maxshard import data
from maxshard.checkpoint import manager as checkpoint
from maxshard.model.layers import pipeline
from maxshard.training.step import Trainer
from tests.helpers import mesh_for, tiny_config

SMALL = ("emb_dim=32", "num_heads=4", "num_kv_heads=2", "head_dim=8", "mlp_dim=64", "max_target_length=16",
         "num_layers=8", "dataset_type=synthetic", "log_period=1")
PIPELINE = ("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_repeats=2",
            "num_pipeline_microbatches=8")
FSDP8 = ("ici_fsdp_parallelism=8",)


class Run:
    """One layout of the run in `base`: its trainer, jitted step and checkpoints."""

    def __init__(self, base, *layout: str, num_devices: int = 8, run_name: str = "r") -> None:
        self.cfg = tiny_config(*SMALL, *layout, f"base_output_directory={base}", f"run_name={run_name}",
                               num_devices=num_devices)
        self.trainer = Trainer(self.cfg, mesh_for(self.cfg))

    def start(self):
        with checkpoint.Checkpoints(self.cfg, self.trainer) as ckpt:
            state, data_state = ckpt.restore_or_init()
        batches = data.make_input(self.cfg, self.trainer.mesh)
        if data_state is not None:
            batches.set_state(data_state)
        return state, batches

    def train(self, state, batches, steps: int, save_at: int | None = None):
        step_fn = self.trainer.jit_train_step(data.batch_sharding(self.cfg, self.trainer.mesh))
        losses = []
        for _ in range(steps):
            state, metrics = step_fn(state, next(batches))
            losses.append(float(metrics["loss"]))
            if int(state.step) == save_at:
                with checkpoint.Checkpoints(self.cfg, self.trainer) as ckpt:
                    ckpt.save(save_at, state, batches.get_state())
        return state, losses


def scanned_params(state) -> dict:
    params = jax.device_get(state.params)
    return pipeline.to_scanned(params) if "pipeline" in params["decoder"] else params


@pytest.mark.slow
def test_resume_across_layouts_continues_the_same_run(tmp_path):
    piped = Run(tmp_path / "reference", *PIPELINE)
    _, reference = piped.train(*piped.start(), steps=4)

    first = Run(tmp_path / "turns", *PIPELINE)
    _, losses = first.train(*first.start(), steps=2, save_at=2)
    scanned = Run(tmp_path / "turns", *FSDP8)
    state, batches = scanned.start()
    assert int(state.step) == 2
    _, more = scanned.train(state, batches, steps=1, save_at=3)
    back = Run(tmp_path / "turns", *PIPELINE)
    state, batches = back.start()
    assert int(state.step) == 3
    _, last = back.train(state, batches, steps=1)
    np.testing.assert_allclose(losses + more + last, reference, rtol=1e-5)


def assert_same_params(a, b) -> None:
    for x, y in zip(jax.tree.leaves(scanned_params(a)), jax.tree.leaves(scanned_params(b))):
        np.testing.assert_array_equal(x, y)


def save_fresh(run: Run):
    state, batches = run.start()
    with checkpoint.Checkpoints(run.cfg, run.trainer) as ckpt:
        ckpt.save(1, state, batches.get_state())
    return state


@pytest.mark.parametrize(
    "written, read, devices",
    [(("num_experts=4", "num_experts_per_tok=2", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"),
      ("num_experts=4", "num_experts_per_tok=2", *FSDP8), 8),
     (FSDP8, ("ici_fsdp_parallelism=2", "ici_pipeline_parallelism=2", "num_pipeline_microbatches=2"), 4)],
    ids=["expert4xfsdp2_to_fsdp8", "fsdp8_to_4_devices_stage2"],
)
def test_a_checkpoint_restores_under_another_mesh(tmp_path, written, read, devices):
    saved = save_fresh(Run(tmp_path, *written))
    restored, _ = Run(tmp_path, *read, "seed=7", num_devices=devices).start()  # a fresh init would differ
    assert int(restored.step) == int(saved.step)  # the saved state, not a fresh init (the seed is the same)
    assert_same_params(restored, saved)


def test_load_parameters_path_across_layouts(tmp_path):
    saved = save_fresh(Run(tmp_path, *PIPELINE, run_name="piped"))
    seeded = Run(tmp_path, *FSDP8, f"load_parameters_path={tmp_path}/piped/checkpoints/1", "seed=7", run_name="new")
    state, _ = seeded.start()
    assert int(state.step) == 0
    assert_same_params(state, saved)
