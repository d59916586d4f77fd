"""The table pipeline schedules (gpipe, 1f1b, interleaved_1f1b, zero_bubble) train like one device.

Through the CLI: a fresh run of `maxshard.train.main` (8 simulated devices) per schedule, whose four losses must equal
the same command on one device within 1e-5 (every loss after the first depends on the gradients and the AdamW
update); the layouts alternate pipeline=2 x fsdp=4 and pipeline=4 x fsdp=2 (interleaved: 2 virtual stages per
device). Gradients: the step's summed gradients (`Trainer._grads`, which takes them from the runner) against the
scanned model's, for the runner's fused backward (1f1b, with gradient accumulation and the minimal remat policy) and
its split one (zero_bubble, with tensor=2 inside a stage); each leaf within 1e-5 of its own largest value
(tests/test_pipeline.py says why). The parts around the stages (a scaled embedding, left-over layers, multi-token
prediction) likewise; MoE models: tests/test_pipeline_runner_moe.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from maxshard import train
from maxshard.errors import ConfigError
from maxshard.spec import blocks
from maxshard.model.layers import pipeline
from maxshard.training import loss as loss_module
from maxshard.training.step import Trainer
from tests.helpers import max_relative_difference, mesh_for, run_losses
from tests.test_pipeline import (TOLERANCE, loss_and_grads, packed_batch, random_params, small_config,
                                 sums_and_grads)
import cli_processes

REPO = Path(__file__).resolve().parent.parent
BASE = str(REPO / "configs" / "base.yml")
STEPS = 4
RUN = ("dataset_type=synthetic", f"steps={STEPS}", "log_period=1", "eval_period=0", "enable_checkpointing=false",
       "enable_tensorboard=false", "warmup_steps_fraction=0", "learning_rate=1e-2", "max_target_length=16",
       "emb_dim=32", "num_heads=2", "num_kv_heads=2", "head_dim=16", "mlp_dim=64", "num_layers=4",
       "remat_policy=full", "max_replicated_fraction=1")
P2_FSDP4 = ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4")
P4_FSDP2 = ("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2")
CLI = {  # schedule -> layout; 4 layers
    "gpipe": (*P2_FSDP4, "num_layers_per_pipeline_stage=2", "num_pipeline_microbatches=2"),
    "1f1b": (*P4_FSDP2, "num_pipeline_microbatches=4"),
    "interleaved_1f1b": (*P2_FSDP4, "num_pipeline_repeats=2", "num_pipeline_microbatches=2"),
    "zero_bubble": (*P4_FSDP2, "num_pipeline_microbatches=4"),
}
# schedule -> the other layout, 8 layers (tests/test_pipeline.py's reference): the two runner paths, the fused
# backward (1f1b, as gpipe and interleaved_1f1b run it) and the split one (zero_bubble); the CLI runs above check
# gpipe's and interleaved's gradients through their losses after the first step.
GRADS = {
    "1f1b": (*P2_FSDP4, "num_layers_per_pipeline_stage=4", "num_pipeline_microbatches=2",
             "gradient_accumulation_steps=2", "remat_policy=minimal", "loss_chunks=2"),
    "zero_bubble": ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                    "num_layers_per_pipeline_stage=4", "num_pipeline_microbatches=4"),
}


MTP = ("mtp_depth=1", "mtp_loss_weight=0.5")
AROUND = ("num_layers=5", "attention_pattern=local,global", "sliding_window=3", "embed_scale=true")


def _keys(base: Path, name: str, devices: int, *layout: str) -> list[str]:
    items = [*RUN, f"cpu_device_count={devices}", f"per_device_batch_size={8 // devices}",
             f"base_output_directory={base}", f"run_name={name}", "ici_fsdp_parallelism=1", *layout]
    return list({item.split("=")[0]: item for item in items}.values())


def _losses(base: Path, name: str) -> list[float]:
    return run_losses(base / name, STEPS)


@pytest.fixture(scope="module")
def one_device(env, tmp_path_factory) -> list[float]:
    base = tmp_path_factory.mktemp("one_device")
    out = cli_processes.run([sys.executable, "-m", "maxshard.train", BASE, *_keys(base, "one", 1)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = _losses(base, "one")
    assert losses[-1] < losses[0], losses  # the steps really trained
    return losses


@pytest.mark.parametrize("schedule", list(CLI))
def test_a_fresh_run_through_the_cli_trains_like_one_device(schedule, one_device, tmp_path, capsys):
    assert train.main([BASE, *_keys(tmp_path, "run", 8, f"pipeline_schedule={schedule}", *CLI[schedule])]) == 0
    assert "starting from step 0" in capsys.readouterr().out
    np.testing.assert_allclose(_losses(tmp_path, "run"), one_device, rtol=TOLERANCE)


@pytest.fixture(scope="module")
def scanned():
    """The non-pipelined model (fsdp=8, 8 layers): config, parameters, a packed batch, its loss and gradients."""
    cfg = small_config()
    trainer = Trainer(cfg, mesh_for(cfg))
    params, batch = random_params(trainer), packed_batch(cfg, trainer.mesh)
    return params, batch, *loss_and_grads(cfg, params, batch)


@pytest.mark.parametrize("schedule", list(GRADS))
def test_the_runner_gives_the_scanned_model_s_gradients(schedule, scanned, monkeypatch):
    """1f1b's loss in 2 pieces takes the head grouped over each microbatch's 4 fsdp shards on the last stage
    (training/pipelined.py `_last_stage_groups`: gathered once a microbatch, not at every piece)."""
    params, batch, ref_loss, ref_grads = scanned
    cfg = small_config(f"pipeline_schedule={schedule}", *GRADS[schedule])
    assert cfg.model.pipeline.schedule == schedule
    grouped, real = [], loss_module.grouped_token_logps
    monkeypatch.setattr(loss_module, "grouped_token_logps",
                        lambda *a, **k: grouped.append(a[0].groups.size) or real(*a, **k))
    loss, grads = loss_and_grads(cfg, pipeline.from_scanned(params, cfg.model.pipeline), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(grads), ref_grads) < TOLERANCE
    # the runner's groups: the 4 fsdp shards, its stage axis manual (Trainer._grads' eval_shape of the whole step's
    # loss, for the accumulation's sums, groups over stage x fsdp = 8)
    assert (4 in grouped) == (cfg.loss_chunks > 1)


def test_what_the_runner_does_not_run_is_one_line():
    with pytest.raises(ConfigError, match="load_balance_loss_weight=0.01 with an MoE layer after the pipeline .* "
                                          "runs with pipeline_schedule=circular only"):
        small_config("pipeline_schedule=1f1b", *P2_FSDP4, "num_layers=5", "num_layers_per_pipeline_stage=1",
                     "num_experts=4", "num_experts_per_tok=2", "attention_pattern=local,global", "sliding_window=4")
    with pytest.raises(ConfigError, match="load_balance_loss_weight=0.01 with mtp_depth=1 on an MoE model runs "
                                          "with pipeline_schedule=circular only"):
        small_config("pipeline_schedule=1f1b", *P2_FSDP4, "num_layers_per_pipeline_stage=4", "num_experts=4",
                     "num_experts_per_tok=2", *MTP)
    with pytest.raises(ConfigError, match="num_pipeline_repeats must be 1"):
        small_config("pipeline_schedule=zero_bubble", *P2_FSDP4)  # 8 layers, 1 per stage: 4 repeats
    for schedule in ("1f1b", "circular"):  # ring attention runs under no pipeline schedule
        with pytest.raises(ConfigError, match="context parallelism does not combine with pipeline parallelism"):
            small_config(f"pipeline_schedule={schedule}", "ici_pipeline_parallelism=2", "ici_context_parallelism=2",
                         "ici_fsdp_parallelism=2")


@pytest.fixture(scope="module")
def around():
    """The scanned model with the parts around a pipeline (AROUND, MTP): parameters, a packed batch, its sums and
    gradients."""
    ref_cfg = small_config(*AROUND, *MTP)
    trainer = Trainer(ref_cfg, mesh_for(ref_cfg))
    assert trainer.trains_mtp
    params, batch = random_params(trainer), packed_batch(ref_cfg, trainer.mesh)
    return params, batch, *sums_and_grads(ref_cfg, params, batch)


AROUND_1F1B = (*P2_FSDP4, "num_layers_per_pipeline_stage=1", "pipeline_schedule=1f1b")


def test_the_layers_around_the_pipeline_run_in_the_runner_s_first_and_last_parts(around):
    """Gemma's scaled embedding on stage 0, the layer a [local, global] pattern leaves over after the pipeline on the
    last stage, and a multi-token prediction module after it (its loss beside the main head's), within 1e-5 of the
    scanned model (the dense layers before the pipeline: tests/test_pipeline_runner_moe.py)."""
    params, batch, ref_sums, ref_grads = around
    cfg = small_config(*AROUND, *MTP, *AROUND_1F1B)
    assert [s.name for s in blocks.stacks(cfg.model)] == ["layers", "last_layers"] and cfg.model.embed_scale
    sums, grads = sums_and_grads(cfg, pipeline.from_scanned(params, cfg.model.pipeline), batch)
    for key in ("loss_sum", "weight_sum", "mtp_nll_sum", "mtp_weight_sum"):
        np.testing.assert_allclose(sums[key], ref_sums[key], rtol=TOLERANCE, err_msg=key)
    assert max_relative_difference(pipeline.to_scanned(grads), ref_grads) < TOLERANCE
    assert np.any(grads["mtp_1"]["eh_proj"]["kernel"])  # the module trained


def test_a_quantized_runner_computes_the_scanned_model_s_quantized_step(around):
    """quantization=int8 under 1f1b: the stages, the layer left over after the pipeline and the prediction module
    (each applied by the runner as its own root, training/pipelined.py) run their matmuls through qwix as the scanned
    model's do. The forward is the same function: the loss and the prediction module's loss equal the scanned
    quantized model's within 1e-5, where quantizing moved them by ~1e-4 (one layer left unquantized would move them
    by about as much). The gradients' 8-bit rounding is per microbatch in the pipeline and over the whole batch in the
    scanned step: their cosine to the scanned quantized gradients is > 0.9999 and above their cosine to the unquantized
    ones (measured 0.999978 and 0.999840)."""
    params, batch, plain_sums, plain_grads = around
    scanned_cfg = small_config(*AROUND, *MTP, "quantization=int8")
    ref_sums, ref_grads = sums_and_grads(scanned_cfg, params, batch)
    cfg = small_config(*AROUND, *MTP, *AROUND_1F1B, "quantization=int8")
    sums, grads = sums_and_grads(cfg, pipeline.from_scanned(params, cfg.model.pipeline), batch)
    for key in ("loss_sum", "mtp_nll_sum"):
        np.testing.assert_allclose(sums[key], ref_sums[key], rtol=TOLERANCE, err_msg=key)
        assert abs(np.sum(ref_sums[key]) / np.sum(plain_sums[key]) - 1) > 5e-5, key  # quantization is on
    flat = [np.concatenate([np.ravel(g) for g in jax.tree.leaves(tree)]) for tree in (pipeline.to_scanned(grads),
                                                                                      ref_grads, plain_grads)]
    cos = lambda a, b: a @ b / np.linalg.norm(a) / np.linalg.norm(b)  # noqa: E731
    print(f"\ncosine to the scanned quantized gradients {cos(flat[0], flat[1]):.6f}, to the unquantized ones "
          f"{cos(flat[0], flat[2]):.6f}")
    assert cos(flat[0], flat[1]) > max(0.9999, cos(flat[0], flat[2]))
