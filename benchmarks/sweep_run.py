"""Running a sweep's points locally, one trainer process each, and collecting every point's figures.

Why one process per point: each point needs its own device count and JAX backend, and a crash or a wrong config
must cost only that point. A point whose config the trainer rejects (exit code 2) is recorded as `skipped` with the
trainer's one-line error; any other failure as `failed`. The runner owns `run_name`, `base_output_directory` (a
temporary directory) and `log_period=1`.

Where each figure comes from:
- startup figures: the trainer's startup record, the `{"step": 0, "startup": {...}}` line of its metrics.jsonl (the
  last one, as a resumed run writes one per start). `devices` is its `devices`; `est_bytes_per_device` is the sum of
  its `memory_per_device` (the trainer's own estimate of parameters + optimizer state + gradients per device), so
  it is there on every backend, CPU included.
- step time: the median over logged steps, leaving out the first logged one (step 2, often still warming up);
  tokens/s/device, TFLOP/s/device and MFU are those of the same (median) step, as the trainer computed them, and
  tokens/s is tokens/s/device x devices. With `--repeats N` every point runs N times (alternating the order) and
  the run with the median step time is kept.
- memory: `bytes_in_use` / `peak_bytes_in_use` where the backend reports them (not on CPU).
- compile: the only figures taken from the console, because they are about when things happen, which only the
  arrival of the trainer's output lines tells. `startup_s` is launch -> the arrival of the "batch: ..." line that
  ends the startup summary (imports, config, mesh, layout report). `time_to_first_step_s` is that line -> the end
  of step 1 (state init, train-step compilation, one step): the arrival of the first "step N/M |" line, minus N-1
  step times. `compile_s` is the trainer's own `compile_time` (loop start -> end of step 1, logged with step 1)
  minus one median step; a trainer that does not log it gets time_to_first_step_s minus one median step, which
  then also holds the state init. `compile_from` says which ("trainer" or "derived").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.sweep_spec import REPO, Point, Sweep, overrides_argv, run_name

RUNNER_KEYS = ("run_name", "base_output_directory", "log_period")  # set by the local runner for every point


@dataclasses.dataclass
class Launch:
    """A finished trainer process: exit code and each output line with its arrival time after launch (s)."""

    returncode: int
    lines: list[tuple[float, str]]
    wall_s: float | None  # None for a point a batch system ran (sweep_slurm.py): its start is not seen from here


def launch(argv: Sequence[str], timeout_s: float, echo: bool) -> Launch:
    """Runs the trainer with stdout+stderr merged, timestamping lines as they arrive; kills it after `timeout_s`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))
            if echo:
                print("    " + line.rstrip("\n"), flush=True)
        returncode = proc.wait()
    finally:
        timer.cancel()
    return Launch(returncode, lines, time.perf_counter() - start)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl; [] if there is none."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def startup_record(everything: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The figures of the run's last start: a resumed run appends one startup record per start."""
    starts = [r["startup"] for r in everything if "startup" in r]
    return starts[-1] if starts else None


def error_line(lines: Sequence[tuple[float, str]]) -> str:
    """The trainer's one-line error, or the last non-empty line (e.g. a traceback's last line)."""
    texts = [text for _, text in lines if text.strip()]
    errors = [t for t in texts if t.startswith("maxshard: error:")]
    return (errors or texts or ["(no output)"])[-1].strip()


def first_line(lines: Sequence[tuple[float, str]], pattern: str) -> tuple[float, re.Match[str]] | None:
    """Arrival time and match of the first output line matching `pattern`, for the timing figures only."""
    for t, text in lines:
        match = re.match(pattern, text)
        if match:
            return t, match
    return None


def median_record(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The record with the median step time, leaving out the first (warm-up) one when there are others."""
    steady = list(records[1:]) if len(records) > 1 else list(records)
    return sorted(steady, key=lambda r: r["step_time"])[(len(steady) - 1) // 2]


def timing_figures(
    lines: Sequence[tuple[float, str]], records: Sequence[dict[str, Any]], everything: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """startup_s, time_to_first_step_s, compile_s and where compile_s came from (see the module docstring).

    `records` are the step records (with step_time); `everything` may also hold the step-1 `compile_time` record.
    """
    ready = first_line(lines, r"batch: ")
    progress = first_line(lines, r"step (\d+)/\d+ \|")
    startup = ready[0] if ready else None
    steady = median_record(records)["step_time"]
    first = None
    if progress:  # the first step line; from step 2 on its own step time is left out
        first = progress[0] - (startup or 0.0) - (int(progress[1][1]) - 1) * records[0]["step_time"]
    logged = [r["compile_time"] for r in everything if "compile_time" in r]
    if logged:
        compile_s, source = float(logged[0]) - steady, "trainer"
    else:
        compile_s, source = (None if first is None else first - steady), "derived"
    return {"startup_s": startup, "time_to_first_step_s": first, "compile_s": compile_s, "compile_from": source}


def step_figures(startup: Mapping[str, Any] | None, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput of the median step, memory, device count and final loss of a run that logged steps.

    `startup` is the run's startup record (None from a trainer that writes none: devices and estimate stay blank)."""
    mid = median_record(records)
    row: dict[str, Any] = {"step_time_s": mid["step_time"], "final_loss": records[-1].get("loss")}
    for key in ("tokens_per_sec_per_device", "tflops_per_device", "mfu"):
        row[key] = mid.get(key)
    for key in ("bytes_in_use", "peak_bytes_in_use"):
        row[key] = max((r[key] for r in records if key in r), default=None)
    row["devices"] = startup["devices"] if startup else None
    row["est_bytes_per_device"] = sum(startup["memory_per_device"].values()) if startup else None
    if row["devices"] is not None and row["tokens_per_sec_per_device"] is not None:
        row["tokens_per_sec"] = row["tokens_per_sec_per_device"] * row["devices"]
    return row


def trainer_timings(records: Sequence[dict[str, Any]], everything: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The timing figures of a point whose output was read from a log file afterwards (a SLURM job array), where no
    line has an arrival time: only compile_s, from the trainer's own `compile_time`; the console timings stay blank."""
    logged = [r["compile_time"] for r in everything if "compile_time" in r]
    compile_s = float(logged[0]) - median_record(records)["step_time"] if logged else None
    return {"startup_s": None, "time_to_first_step_s": None, "compile_s": compile_s,
            "compile_from": "trainer" if logged else None}  # fmt: skip


def summarize(
    point: Point, steps: Any, result: Launch, everything: list[dict[str, Any]], timed: bool = True
) -> dict[str, Any]:
    """One results row for a finished point, from its metrics.jsonl records (and its output lines' arrival times,
    when `timed`: a local run; a SLURM array's log files have none)."""
    records = [r for r in everything if "step_time" in r]
    overrides = " ".join(overrides_argv(point.overrides))
    row = {"index": point.index, "name": point.name, "overrides": overrides, "steps": steps,
           "wall_s": None if result.wall_s is None else round(result.wall_s, 2)}  # fmt: skip
    if result.returncode == 2:
        return {**row, "status": "skipped", "error": error_line(result.lines)}
    if result.returncode != 0 or not records:
        why = error_line(result.lines) if result.returncode else "no step was logged (steps < 2?)"
        return {**row, "status": "failed", "error": f"exit {result.returncode}: {why}"}
    timings = timing_figures(result.lines, records, everything) if timed else trainer_timings(records, everything)
    figures = {**step_figures(startup_record(everything), records), **timings}
    return {**row, "status": "ok", **figures}


def point_argv(sweep: Sweep, point: Point, runs_dir: str) -> list[str]:
    """The trainer's argv for a point (config file first): its keys, with the runner's own (RUNNER_KEYS) set."""
    owned = {"run_name": run_name(sweep, point), "base_output_directory": runs_dir, "log_period": 1}
    values = {**{k: v for k, v in sweep.merged(point).items() if k not in RUNNER_KEYS}, **owned}
    return [sweep.base_config, *overrides_argv(values)]


def run_point(sweep: Sweep, point: Point, runs_dir: str, timeout_s: float, echo: bool) -> dict[str, Any]:
    """Trains one point in its own process and summarizes it."""
    name = run_name(sweep, point)
    result = launch([sys.executable, "-m", "maxshard.train", *point_argv(sweep, point, runs_dir)], timeout_s, echo)
    records = read_metrics(os.path.join(runs_dir, name, "metrics.jsonl"))
    return {**summarize(point, sweep.merged(point).get("steps"), result, records), "run_name": name}


def collect_point(sweep: Sweep, point: Point, runs_dir: str, returncode: int, lines: Sequence[str]) -> dict[str, Any]:
    """The row of a point a batch system ran (a SLURM array task, sweep_slurm.py): from its exit status, the lines
    of its log files and its metrics.jsonl, as for a local point but without the console timings."""
    name = run_name(sweep, point)
    records = read_metrics(os.path.join(runs_dir, name, "metrics.jsonl"))
    result = Launch(returncode, [(0.0, line) for line in lines], None)
    return {**summarize(point, sweep.merged(point).get("steps"), result, records, timed=False), "run_name": name}


def describe(row: Mapping[str, Any]) -> str:
    """One console line per finished point."""
    head = f"[{row['index']}] {row['name']}: {row['status']}"
    if row["status"] != "ok":
        return f"{head} ({row['error']})"
    compile_s = f", compile ~{row['compile_s']:.1f} s" if row.get("compile_s") is not None else ""
    return (f"{head}, {row['step_time_s'] * 1e3:.0f} ms/step, {row['tokens_per_sec_per_device']:,.0f} tok/s/dev"
            f"{compile_s}, loss {row['final_loss']:.3f}")  # fmt: skip


def pick_median(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Of one point's repeats, the run with the median step time; all its figures come from that one run."""
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["step_time_s"])
    chosen = ok[(len(ok) - 1) // 2] if ok else rows[-1]
    return {**chosen, "repeats": len(rows)}


def run_local(
    sweep: Sweep, out: str, timeout_s: float, echo: bool, keep_runs: bool, repeats: int = 1
) -> list[dict[str, Any]]:
    """Runs every point `repeats` times, in order then in reverse order, so a slow spell of a shared machine does not
    fall on the same points; an invalid point is tried once. The runs' own outputs go to a temporary directory."""
    runs_dir = tempfile.mkdtemp(prefix=f"sweep-{sweep.name}-")
    runs: dict[int, list[dict[str, Any]]] = {p.index: [] for p in sweep.points}
    for rep in range(repeats):
        for point in sweep.points if rep % 2 == 0 else sweep.points[::-1]:
            if runs[point.index] and runs[point.index][0]["status"] == "skipped":
                continue
            runs[point.index].append(run_point(sweep, point, os.path.join(runs_dir, f"r{rep}"), timeout_s, echo))
            print(f"repeat {rep + 1}/{repeats} " + describe(runs[point.index][-1]), flush=True)
    if keep_runs:
        print(f"runs kept in {runs_dir}")
    else:
        shutil.rmtree(runs_dir, ignore_errors=True)
    return [pick_median(runs[p.index]) for p in sweep.points]
