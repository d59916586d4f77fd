"""Observability: the metric sinks, throughput arithmetic, deferred fetch, console lines, profiler, plot tool."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from maxshard import config, devices, units
from maxshard.observe import console, metrics
from maxshard import perf
from maxshard.observe.profiling import Profiler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOT_TOOL = os.path.join(REPO, "tools", "plot_metrics.py")


def read_events(tensorboard_dir: str) -> list[event_pb2.Event]:
    """Every event of every file, parsed from the TFRecord framing: u64 length, u32 crc, data, u32 crc."""
    events = []
    for path in sorted(glob.glob(os.path.join(tensorboard_dir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            events.append(event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length]))
            pos += 12 + length + 4
    return events


def scalars(events: list[event_pb2.Event]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for event in events:
        for value in event.summary.value:
            if value.WhichOneof("value") == "simple_value":
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def strict_json(line: str) -> dict:
    def reject(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=reject)


# --------------------------------------------------------------------------------------------- perf arithmetic


@pytest.mark.parametrize(
    "kind, peak",
    [
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5e", 197e12),
        ("TPU v5p", 459e12),
        ("TPU v5", 459e12),
        ("TPU v6 lite", 918e12),
        ("TPU v6e", 918e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-SXM4-40GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("cpu", None),
        ("TPU v3", None),
        ("TPU v4 lite", None),
    ],
)
def test_peak_flops_table(kind, peak):
    assert devices.peak_flops(kind) == peak


def test_throughput_matches_hand_computation():
    # 8 devices, global batch 16 x 128 tokens = 2048 tokens, 8e12 model FLOPs per step, 0.5 s per step.
    assert perf.tokens_per_sec_per_device(2048, 0.5, 8) == pytest.approx(512.0)  # 2048 / 0.5 / 8
    assert perf.tflops_per_device(8e12, 0.5, 8) == pytest.approx(2.0)  # 8e12 / 0.5 / 8 / 1e12
    assert perf.mfu(1e12, 0.5, 275e12) == pytest.approx(2e12 / 275e12)  # 0.00727...
    assert perf.mfu(1e12, 0.5, None) is None
    figures = perf.step_perf(2048, 8e12, 0.5, 8, devices.peak_flops("TPU v4"))
    assert figures == pytest.approx({"tokens_per_sec_per_device": 512.0, "tflops_per_device": 2.0,
                                     "mfu": 2e12 / 275e12})
    assert perf.step_perf(2048, 8e12, 0.5, 8, devices.peak_flops("cpu"))["mfu"] is None


def test_zero_step_time_is_an_error():
    with pytest.raises(ValueError, match="step_time"):
        perf.tokens_per_sec_per_device(2048, 0.0, 8)


# --------------------------------------------------------------------------------------------- writer


def test_writer_writes_jsonl_and_tensorboard(tmp_path):
    run_dir, tb_dir = str(tmp_path / "run"), str(tmp_path / "run" / "tensorboard")
    steps = {
        10: {"loss": 2.5, "learning_rate": 1e-3, "grad_norm": 0.75, "step_time": 0.25,
             "tokens_per_sec_per_device": 1024.0, "tflops_per_device": 3.5, "mfu": None,
             "moe/dropped_fraction": 0.125, "moe/expert_load": [0.5, 0.25, 0.25]},
        20: {"loss": 2.0, "step_time": 0.5, "tokens_per_sec_per_device": 512.0, "tflops_per_device": 1.75,
             "mfu": 0.25, "bytes_in_use": 4096, "eval_loss": 2.25},
    }
    with metrics.MetricsWriter(run_dir, tb_dir, is_primary=True) as writer:
        writer.write_config({"run_name": "unit", "logical_axis_rules": (("embed", ("fsdp",)),)})
        for step, values in steps.items():
            writer.write(step, values)

    lines = open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8").read().splitlines()
    records = [strict_json(line) for line in lines]
    assert [r["step"] for r in records] == [10, 20]
    for record, (step, values) in zip(records, steps.items()):
        expected = {k: v for k, v in values.items() if v is not None}
        assert {k: v for k, v in record.items() if k not in ("step", "time")} == expected
    assert "mfu" not in records[0]  # unknown MFU is left out, never written as a number

    events = read_events(tb_dir)
    got = scalars(events)
    assert got["learning/loss"] == [(10, 2.5), (20, 2.0)]
    assert got["learning/grad_norm"] == [(10, 0.75)]
    assert got["perf/step_time"] == [(10, 0.25), (20, 0.5)]
    assert got["perf/tflops_per_device"] == [(10, 3.5), (20, 1.75)]
    assert got["perf/mfu"] == [(20, 0.25)]
    assert got["memory/bytes_in_use"] == [(20, 4096.0)]
    assert got["eval/loss"] == [(20, 2.25)]
    assert got["moe/dropped_fraction"] == [(10, 0.125)]
    assert got["moe/expert_load/0"] == [(10, 0.5)] and got["moe/expert_load/2"] == [(10, 0.25)]
    texts = [v.tensor.string_val[0].decode() for e in events for v in e.summary.value if v.tag.startswith("config")]
    assert len(texts) == 1 and "run_name: unit" in texts[0] and "fsdp" in texts[0]


def test_nan_loss_is_strict_json_null(tmp_path):
    with metrics.MetricsWriter(str(tmp_path), str(tmp_path / "tb"), True, enable_tensorboard=False) as writer:
        writer.write(3, {"loss": float("nan"), "step_time": np.float32(0.5)})
    (line,) = open(tmp_path / "metrics.jsonl", encoding="utf-8").read().splitlines()
    assert strict_json(line)["loss"] is None and strict_json(line)["step_time"] == 0.5
    assert not (tmp_path / "tb").exists()  # TensorBoard disabled: no event files


def test_writer_reaches_disk_before_close(tmp_path):
    """A killed process must not lose what was written: the JSON line at once, the event within seconds."""
    writer = metrics.MetricsWriter(str(tmp_path), str(tmp_path / "tb"), is_primary=True)
    writer.write(1, {"loss": 1.0})
    assert strict_json(open(tmp_path / "metrics.jsonl", encoding="utf-8").readline())["loss"] == 1.0
    deadline = time.monotonic() + 4 * metrics.TB_FLUSH_SECS + 2
    while "learning/loss" not in scalars(read_events(str(tmp_path / "tb"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scalars(read_events(str(tmp_path / "tb"))).get("learning/loss") == [(1, 1.0)]
    writer.close()


def test_non_primary_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    with metrics.MetricsWriter(str(run_dir), str(run_dir / "tb"), is_primary=False) as writer:
        writer.write_config({"run_name": "x"})
        writer.write(1, {"loss": 1.0, "step_time": 0.1})
    assert not run_dir.exists()


def test_writer_and_profiler_from_config(tmp_path):
    argv = [os.path.join(REPO, "configs", "base.yml"), f"base_output_directory={tmp_path}", "run_name=r",
            "profiler=xplane"]
    cfg = config.load(argv, num_devices=8)
    with metrics.MetricsWriter.from_config(cfg, is_primary=True) as writer:
        writer.write_config(cfg)
        writer.write(0, {"loss": 1.0})
    assert os.path.isfile(os.path.join(cfg.run_dir, "metrics.jsonl"))
    texts = [v.tensor.string_val[0].decode() for e in read_events(cfg.tensorboard_dir) for v in e.summary.value
             if v.tag.startswith("config")]
    assert "profiler: xplane" in texts[0]
    profiler = Profiler.from_config(cfg)
    assert profiler.enabled and profiler.profile_dir == os.path.join(cfg.run_dir, "profile")
    assert not Profiler.from_config(cfg, is_primary=False).enabled


# --------------------------------------------------------------------------------------------- deferred fetch


def test_deferred_metrics_come_out_one_step_late_and_in_order():
    step_fn = jax.jit(lambda x: {"loss": jnp.sum(x), "tokens": jnp.int32(7), "load": x[:2] * 2})
    deferred = metrics.DeferredMetrics()
    out = []
    for step in range(1, 4):
        done = deferred.push(step, step_fn(jnp.full((4,), float(step))))
        out.append(done)
    assert out[0] is None  # nothing is fetched before the next step is dispatched
    last = deferred.flush()
    fetched = [s for s in out[1:]] + [last]
    assert [s.step for s in fetched] == [1, 2, 3]
    assert [s.values["loss"] for s in fetched] == [4.0, 8.0, 12.0]
    assert all(isinstance(s.values["tokens"], int) and s.values["tokens"] == 7 for s in fetched)
    assert fetched[2].values["load"] == [6.0, 6.0]
    assert all(isinstance(v, float) for v in fetched[0].values["load"])
    assert fetched[0].ready_time <= fetched[1].ready_time <= fetched[2].ready_time
    assert deferred.flush() is None


def test_the_step_after_an_evaluation_keeps_its_record(tmp_path, capsys):
    """train.py restarts the step clock after an evaluation (its time is not a step's). The first step after it has
    no time to divide by, but its loss record must still be written when it is a log step: it was dropped."""
    from maxshard.run import loading

    argv = [os.path.join(REPO, "configs", "base.yml"), f"base_output_directory={tmp_path}", "model_name=tiny",
            "log_period=1", "steps=4"]
    cfg = loading.complete(config.load(argv, num_devices=1))
    writer = metrics.MetricsWriter(str(tmp_path), str(tmp_path), is_primary=True, enable_tensorboard=False)
    log = console.StepLogger(cfg, writer)
    for step in range(4):
        log(metrics.StepValues(step, {"loss": float(step)}, ready_time=time.perf_counter() + step))
        if step == 1:  # an evaluation after step 2
            log.restart()
    writer.close()
    records = [json.loads(line) for line in (tmp_path / metrics.METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and [r["loss"] for r in records] == [0.0, 1.0, 2.0, 3.0]
    assert "step_time" not in records[2] and records[3]["step_time"] > 0
    assert "step 3/4 | loss 2.000 | timed from the next step" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------- memory


class FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_memory_stats():
    stats = {"bytes_in_use": 10, "peak_bytes_in_use": 20, "bytes_limit": 100, "num_allocs": 3}
    assert metrics.memory_stats(FakeDevice(stats)) == {"bytes_in_use": 10, "peak_bytes_in_use": 20,
                                                       "bytes_limit": 100}
    assert metrics.memory_stats(FakeDevice(None)) is None
    assert metrics.memory_stats(FakeDevice({})) is None
    real = metrics.memory_stats()  # CPU reports nothing today; if it ever does, the figures must be there
    assert real is None or "bytes_in_use" in real


# --------------------------------------------------------------------------------------------- console


def test_format_progress():
    line = console.format_progress(120, 300, 2.3141, 0.2913, 14100.0, 0.4123, 52.4, flops_per_sec=3.21e12)
    assert line == "step 120/300 | loss 2.314 | 0.291 s/step | 14.1k tok/s/dev | 3.21 TFLOP/s/dev | MFU 41.2% | ETA 52s"
    line = console.format_progress(5, 300, 9.0, 1.5, 950.0, None, 3725.0)
    assert line == "step 5/300 | loss 9.000 | 1.500 s/step | 950 tok/s/dev | ETA 1h02m"


def test_a_cpu_flop_rate_shows_in_a_unit_that_shows_it():
    line = console.format_progress(10, 300, 3.2, 0.982, 261.0, None, 285.0, flops_per_sec=4.12e9)
    assert "4.12 GFLOP/s/dev" in line  # was "0.00 TFLOP/s/dev"
    assert [units.format_flops(v) for v in (9.89e14, 1.5e15, 512.0)] == ["989 TFLOP/s", "1.50 PFLOP/s", "512 FLOP/s"]


@pytest.mark.parametrize("value, text", [(999.96, "1000"), (1234.0, "1.23k"), (2.5e6, "2.50M"), (12.0, "12.0")])
def test_format_count(value, text):
    assert units.format_count(value) == text


def test_format_duration():
    assert [units.format_duration(s) for s in (0, 59.6, 185, 3720)] == ["0s", "1m00s", "3m05s", "1h02m"]


def _figures(**changes):
    figures = {
        "run_dir": "/abs/runs/default", "devices": 8, "processes": 1, "mesh": {"data": 2, "fsdp": 4, "tensor": 1},
        "param_count": 3_407_872, "memory_per_device": {"params": 3 * 2**20, "opt_state": 6 * 2**20,
                                                        "grads": 3 * 2**20},
        "device_kind": "TPU v4", "peak_flops": 275e12, "pipeline": None, "global_batch_size": 16,
        "max_target_length": 128, "steps": 300,
    }
    return {**figures, **changes}


def test_startup_summary():
    text = console.format_startup_summary(_figures())
    assert text.splitlines() == [
        "run: /abs/runs/default",
        "mesh: data=2 fsdp=4 (8 devices)",  # axes of size 1 are left out
        "parameters: 3.41M (3,407,872)",
        "per-device memory estimate: params 3.0 MiB + opt_state 6.0 MiB + grads 3.0 MiB = 12.0 MiB",
        "device: TPU v4, peak 275 TFLOP/s bf16",
        "batch: 16 x 128 tokens, 300 steps",
    ]
    cpu = console.format_startup_summary(_figures(device_kind="cpu", peak_flops=None))
    assert cpu.splitlines()[-2] == "device: cpu, peak unknown: MFU not reported"
    gpu = console.format_startup_summary(_figures(device_kind="NVIDIA H200", peak_flops=989e12,
                                                  attention={"requested": "auto", "kernel": "tokamax"}))
    assert gpu.splitlines()[-2] == "device: NVIDIA H200, peak 989 TFLOP/s bf16; attention auto -> tokamax"
    lora = {"rank": 8, "alpha": 16.0, "targets": ["q", "v"]}
    text = console.format_startup_summary(_figures(trainable_param_count=65_536, lora=lora))
    assert text.splitlines()[2] == ("parameters: 3.41M (3,407,872), 65.5k trainable (65,536, 1.92%: LoRA rank 8 on "
                                    "q, v; the rest frozen)")


def test_startup_summary_says_which_remat_policy_runs_and_why():
    fit = {"requested": "auto", "policy": "minimal", "planned_bytes": 3 * 2**30, "usable_bytes": 9 * 2**30,
           "capacity_bytes": 10 * 2**30, "capacity_source": "host available memory 80.0 GiB / 8 devices",
           "fits": True}
    line = console.format_startup_summary(_figures(memory_fit=fit)).splitlines()[5]
    assert line == ("remat: auto -> minimal, the least recompute that fits: planned peak 3.0 GiB per device of "
                    "9.0 GiB usable (host available memory 80.0 GiB / 8 devices, 10% headroom)")
    explicit = console.format_startup_summary(_figures(memory_fit={**fit, "requested": "full", "policy": "full"}))
    assert "remat: full (as set), fits: planned peak 3.0 GiB" in explicit


def test_startup_figures_are_the_first_metrics_record(tmp_path):
    with metrics.MetricsWriter(str(tmp_path), str(tmp_path / "tb"), is_primary=True, enable_tensorboard=False) as w:
        console.print_startup(_figures(), w)
        w.write(1, {"loss": 2.0})
    first, second = [json.loads(line) for line in (tmp_path / metrics.METRICS_FILE).read_text().splitlines()]
    assert first["step"] == 0 and first["startup"] == _figures()
    assert second["loss"] == 2.0


# --------------------------------------------------------------------------------------------- profiler


def test_profiler_traces_only_its_window(tmp_path):
    profile_dir = str(tmp_path / "profile")
    profiler = Profiler(profile_dir, start=1, num_steps=2, enabled=True)
    f = jax.jit(lambda x: x @ x)
    x = jnp.ones((32, 32))
    active = []
    for step in range(4):
        with profiler.step(step):
            x = f(x)
            active.append(profiler.active)
    profiler.close()
    assert active == [False, True, True, False]
    assert glob.glob(os.path.join(profile_dir, "plugins", "profile", "*", "*.xplane.pb"))

    disabled = Profiler(str(tmp_path / "off"), start=0, num_steps=1, enabled=False)
    with disabled.step(0):
        f(x)
    assert not (tmp_path / "off").exists()


# --------------------------------------------------------------------------------------------- plot tool


def _fake_run(path, scale: float) -> str:
    path.mkdir()
    with metrics.MetricsWriter(str(path), str(path / "tb"), True, enable_tensorboard=False) as writer:
        for step in range(0, 50, 10):
            writer.write(step, {"loss": scale / (step + 1), "tokens_per_sec_per_device": 1000.0 * scale})
    return str(path)


def test_plot_tool_draws_two_runs(tmp_path):
    runs = [_fake_run(tmp_path / "a", 1.0), _fake_run(tmp_path / "b", 2.0)]
    out = tmp_path / "plot.png"
    result = subprocess.run([sys.executable, PLOT_TOOL, *runs, "--out", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 1000


def test_plot_tool_without_matplotlib_exits_2(tmp_path):
    run = _fake_run(tmp_path / "a", 1.0)
    code = ("import sys, runpy; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['plot_metrics.py', {run!r}]; runpy.run_path({PLOT_TOOL!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "matplotlib" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_plot_tool_reports_missing_run(tmp_path):
    result = subprocess.run([sys.executable, PLOT_TOOL, str(tmp_path / "nope")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "metrics.jsonl" in result.stderr


def test_plot_series_skips_null_loss():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import plot_metrics
    finally:
        sys.path.pop(0)
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": None}, {"step": 3}, {"step": 4, "loss": 1.0}]
    assert plot_metrics.series(records, "loss") == ([1, 4], [2.0, 1.0])
    assert plot_metrics.run_labels(["x/a", "y/a", "z/b"]) == ["x/a", "y/a", "b"]


def test_plot_shows_a_run_that_logged_throughput_once():
    """A short run logs tokens/s at one step only: its point must still be drawn (a marker, not a bare line)."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import plot_metrics
    finally:
        sys.path.pop(0)
    records = [{"step": 0, "startup": {"devices": 8}}, {"step": 1, "loss": 6.8, "compile_time": 20.0},
               {"step": 2, "loss": 5.1, "tokens_per_sec_per_device": 180.0}]
    fig = plot_metrics.figure({"short": records})
    throughput = fig.axes[1].get_lines()[0]
    assert list(throughput.get_xdata()) == [2] and list(throughput.get_ydata()) == [180.0]
    assert throughput.get_marker() not in (None, "None", "", " ")
