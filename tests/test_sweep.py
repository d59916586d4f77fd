"""benchmarks/sweep.py end to end: a 3-point tiny sweep (one point invalid) locally, and the same sweep as XPK commands.

The local sweep really trains (two 1-layer runs of 3 steps on 2 simulated devices, each in its own process), so
the rows hold figures read back from the trainer's own metrics.jsonl, not values the test planted.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import sweep, sweep_report, sweep_run, sweep_spec
import cli_processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP = """
name: tiny-test
base_config: configs/base.yml
fixed:
  model_name: tiny
  override_model_config: true
  num_layers: 1
  max_target_length: 16
  dataset_type: synthetic
  cpu_device_count: 2
  per_device_batch_size: 1
  steps: 3
  eval_period: 0
  enable_checkpointing: false
  enable_tensorboard: false
points:
  - {name: fsdp, ici_fsdp_parallelism: -1}
  - {name: tp2, ici_tensor_parallelism: 2}
  - {name: bad, ici_fsdp_parallelism: 3}
"""


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sweep") / "tiny_test.yml"
    path.write_text(SWEEP)
    return str(path)


@pytest.fixture(scope="module")
def local_results(sweep_file, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("out"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = cli_processes.run([sys.executable, "benchmarks/sweep.py", sweep_file, "--out", out], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_points_cross_the_grid_and_merge_keys_in_order():
    grid = {"per_device_batch_size": [1, 2]}
    points = sweep_spec.expand_points(grid, [{"name": "a", "steps": 5}, {"ici_tensor_parallelism": 2}])
    assert [p.name for p in points] == ["a-pdbs=1", "a-pdbs=2", "tensor2-pdbs=1", "tensor2-pdbs=2"]
    assert points[1].overrides == {"per_device_batch_size": 2, "steps": 5}
    assert [p.index for p in points] == [0, 1, 2, 3]


def test_repeats_keep_the_run_with_the_median_step_time():
    runs = [{"status": "ok", "step_time_s": t, "run": i} for i, t in enumerate((0.3, 0.1, 0.2))]
    assert sweep_run.pick_median(runs) == {"status": "ok", "step_time_s": 0.2, "run": 2, "repeats": 3}
    skipped = [{"status": "skipped", "error": "maxshard: error: x"}]
    assert sweep_run.pick_median(skipped)["status"] == "skipped"


def startup(devices: int, memory: dict[str, int]) -> dict:
    """A startup record as the trainer writes it (only the keys the sweep reads carry meaning here)."""
    figures = {"run_dir": "/tmp/run", "devices": devices, "processes": 1, "mesh": {"fsdp": devices},
               "param_count": 1000, "memory_per_device": memory, "device_kind": "cpu", "peak_flops": None,
               "pipeline": None, "global_batch_size": 2, "max_target_length": 16, "steps": 3}  # fmt: skip
    return {"step": 0, "time": 0.0, "startup": figures}


def test_startup_figures_come_from_the_startup_record_not_the_console():
    steps = [{"step": s, "step_time": 0.1, "loss": 5.0, "tokens_per_sec_per_device": 100.0} for s in (2, 3)]
    first = startup(8, {"params": 1, "opt_state": 2, "grads": 3})
    last = startup(2, {"params": 100, "opt_state": 200, "grads": 100})  # a resumed run: its last start counts
    everything = [first, {"step": 1, "loss": 5.5, "compile_time": 4.0}, *steps, last]
    point = sweep_spec.Point(0, "p", {})
    row = sweep_run.summarize(point, 3, sweep_run.Launch(0, [], 1.0), everything)  # no console line at all
    assert row["status"] == "ok"
    assert row["devices"] == 2 and row["est_bytes_per_device"] == 400
    assert row["tokens_per_sec"] == 200.0
    assert row["compile_s"] == pytest.approx(3.9) and row["compile_from"] == "trainer"
    assert row["startup_s"] is None  # a timing: only the console lines' arrival says when startup ended


@pytest.mark.slow
def test_local_sweep_writes_rows_for_every_point(local_results):
    with open(os.path.join(local_results, "results.csv"), newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == sweep_report.COLUMNS
        rows = {row["name"]: row for row in reader}
    assert list(rows) == ["fsdp", "tp2", "bad"]
    for name in ("fsdp", "tp2"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["devices"] == "2" and row["steps"] == "3"
        assert float(row["step_time_s"]) > 0 and float(row["tokens_per_sec_per_device"]) > 0
        assert math.isfinite(float(row["final_loss"]))
        assert float(row["compile_s"]) > 0 and float(row["startup_s"]) > 0
        assert int(row["est_bytes_per_device"]) > 0
    assert "ici_tensor_parallelism=2" in rows["tp2"]["overrides"]


@pytest.mark.slow
def test_invalid_point_is_skipped_with_the_trainer_error(local_results):
    with open(os.path.join(local_results, "results.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["name"] for r in records] == ["fsdp", "tp2", "bad"]
    bad = records[2]
    assert bad["status"] == "skipped"
    assert bad["error"].startswith("maxshard: error:") and "ici_fsdp_parallelism=3" in bad["error"]
    assert bad["step_time_s"] is None


@pytest.mark.slow
def test_summary_png_is_written(local_results):
    with open(os.path.join(local_results, "tiny_test.png"), "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(os.path.join(local_results, "tiny_test.png")) > 1000


def test_xpk_mode_prints_one_launcher_command_per_point(sweep_file, tmp_path, capsys):
    flags = ["--xpk", "--cluster", "c", "--project", "p", "--zone", "z", "--device-type", "v5litepod-4",
             "--docker-image", "img", "--out", str(tmp_path)]  # fmt: skip
    assert sweep.main([sweep_file, *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [line for line in lines if line.startswith("python -m maxshard.launch xpk ")]
    skipped = [line for line in lines if line.startswith("# skipped")]
    assert len(commands) == 2 and len(skipped) == 1
    assert "ici_fsdp_parallelism=-1" in commands[0] and "run_name=tiny-test-00-fsdp" in commands[0]
    assert "ici_tensor_parallelism=2" in commands[1] and "run_name=tiny-test-01-tp2" in commands[1]
    assert all("--device-type v5litepod-4" in c and " -- configs/base.yml " in c for c in commands)
    assert "bad" in skipped[0] and "ici_fsdp_parallelism=3" in skipped[0]
    assert "--execute" not in "\n".join(commands)
    with open(tmp_path / "xpk.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["status"] for r in records] == ["ok", "ok", "skipped"]
    assert records[1]["xpk_command"].startswith("xpk workload create ")


def test_xpk_mode_needs_the_cluster_flags(sweep_file, capsys):
    assert sweep.main([sweep_file, "--xpk", "--project", "p"]) == 2
    assert "--cluster" in capsys.readouterr().err
