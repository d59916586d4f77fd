"""The CLI end to end: a short run on the learnable synthetic task lowers the loss and records its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_cli_trains_and_loss_falls(tmp_path):
    cmd = [
        sys.executable, "-m", "maxshard.train", "configs/base.yml", "model_name=tiny", "dataset_type=synthetic",
        "cpu_device_count=8", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "steps=40", "log_period=5",
        "eval_period=20", "learning_rate=1e-2", f"base_output_directory={tmp_path}", "run_name=cli",
        "enable_checkpointing=false",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "fsdp=4" in result.stdout and "tensor=2" in result.stdout  # the startup summary names the mesh
    records = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert losses[-1] < 0.5 * losses[0], losses
    assert len(evals) == 2 and evals[1] < evals[0]
    assert any("tokens_per_sec_per_device" in r and "tflops_per_device" in r for r in records)
    assert os.listdir(tmp_path / "cli" / "tensorboard")
