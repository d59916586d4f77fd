"""Run a sweep of training configs: locally, one process per point, or as XPK submissions (printed, never run).

    python benchmarks/sweep.py benchmarks/sweeps/cpu_layouts.yml [--out DIR] [-v]
    python benchmarks/sweep.py benchmarks/sweeps/tpu_v5p.yml --xpk --cluster C --project P --zone Z \\
        --device-type v5p-128 --num-slices 1 --docker-image IMAGE

A sweep file:

    name: cpu-layouts                 # optional (default: the file's stem); run names start with it
    base_config: configs/base.yml     # the trainer's config, relative to the repository root
    fixed: {steps: 20, model_name: tiny}                     # overrides every point gets
    grid: {per_device_batch_size: [1, 2]}                    # cartesian product of the lists
    points:                                                  # each point: a name and any number of keys
      - {name: fsdp8, ici_fsdp_parallelism: 8}
      - {name: fsdp4xtp2, ici_fsdp_parallelism: 4, ici_tensor_parallelism: 2}
    xpk: {device_type: v5p-128, num_slices: 1}               # optional defaults of the --xpk flags

With both `grid` and `points`, every point is crossed with every grid combination; keys merge in the order
fixed < grid < point. Why one process per point: each point needs its own device count and JAX backend, and a
crash or a wrong config must cost only that point. A point whose config the trainer rejects (exit code 2) is
recorded as `skipped` with the trainer's one-line error; any other failure as `failed`.

Locally the runner owns `run_name`, `base_output_directory` (a temporary directory) and `log_period=1`, and writes
`results.csv`, `results.jsonl` and `<sweep>.png` (tokens/s/device per point) to `--out`. Figures per point:
- step time: the median over logged steps, leaving out the first logged one (step 2, often still warming up);
  tokens/s/device, TFLOP/s/device and MFU are those of the same (median) step, as the trainer computed them.
  With `--repeats N` every point runs N times (alternating the order) and the run with the median step time is kept.
- memory: `bytes_in_use` / `peak_bytes_in_use` where the backend reports them (not on CPU); `est_bytes_per_device`
  is the trainer's own estimate of parameters + optimizer + gradients from its start-up line, always present.
- compile: `startup_s` is launch -> the trainer's "batch: ..." start-up line (imports, config, mesh, layout report),
  from when its output lines arrive. `time_to_first_step_s` is that line -> the end of step 1 (state init,
  train-step compilation, one step): the arrival of the first "step N/M |" line, minus N-1 step times.
  `compile_s` is the trainer's own `compile_time` (loop start -> end of step 1, logged with step 1) minus one
  median step; a trainer that does not log it gets time_to_first_step_s minus one median step, which then also
  holds the state init. `compile_from` says which ("trainer" or "derived").
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_KEYS = {"name", "base_config", "fixed", "grid", "points", "xpk"}
XPK_FLAGS = ("cluster", "project", "zone", "device_type", "num_slices", "docker_image", "base_docker_image")
RUNNER_KEYS = ("run_name", "base_output_directory", "log_period")  # set by the local runner for every point
COLUMNS = (
    "index", "name", "status", "overrides", "devices", "steps", "step_time_s", "tokens_per_sec",
    "tokens_per_sec_per_device", "tflops_per_device", "mfu", "bytes_in_use", "peak_bytes_in_use",
    "est_bytes_per_device", "startup_s", "time_to_first_step_s", "compile_s", "compile_from", "final_loss", "wall_s",
    "repeats", "run_name", "error",
)  # fmt: skip
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class SweepError(ValueError):
    """A mistake in the sweep file or the flags: reported in one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class Point:
    index: int
    name: str
    overrides: dict[str, Any]  # point keys only (grid + point), without the fixed ones


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    base_config: str
    fixed: dict[str, Any]
    points: tuple[Point, ...]
    xpk: dict[str, Any]

    def merged(self, point: Point) -> dict[str, Any]:
        return {**self.fixed, **point.overrides}


# --------------------------------------------------------------------------------------------- sweep file


def _mapping(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, Mapping):
        raise SweepError(f"'{key}' must be a mapping of key: value, got {type(value).__name__}")
    return dict(value)


def short_name(key: str, value: Any) -> str:
    """A readable name part: 'ici_fsdp_parallelism', 8 -> 'fsdp8'; 'dcn_data_parallelism', 2 -> 'dcn_data2';
    any other key by its initials: 'per_device_batch_size', 4 -> 'pdbs=4'; 'remat_policy', 'full' -> 'rp=full'."""
    match = re.fullmatch(r"(ici_|dcn_)(\w+)_parallelism", key)
    if match:
        return f"{'' if match[1] == 'ici_' else 'dcn_'}{match[2]}{value}"
    initials = "".join(word[0] for word in key.split("_") if word)
    return f"{initials}={format_value(value)}"


def expand_points(grid: Mapping[str, Sequence[Any]], points: Sequence[Mapping[str, Any]]) -> tuple[Point, ...]:
    """Every point crossed with every grid combination (either may be absent), numbered from 0."""
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"grid key {key!r} must map to a non-empty list, got {values!r}")
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else [{}]
    out = []
    for point in points or [{}]:
        if not isinstance(point, Mapping):
            raise SweepError(f"each entry of 'points' must be a mapping, got {point!r}")
        keys = {k: v for k, v in point.items() if k != "name"}
        for combo in combos:
            parts = [str(point["name"])] if "name" in point else [short_name(k, v) for k, v in keys.items()]
            name = "-".join(parts + [short_name(k, v) for k, v in combo.items()]) or "default"
            out.append(Point(len(out), name, {**combo, **keys}))
    return tuple(out)


def load_sweep(path: str) -> Sweep:
    """Reads and checks a sweep file; SweepError on any mistake."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"cannot read sweep file {path}: {e}") from None
    if not isinstance(data, Mapping):
        raise SweepError(f"sweep file {path} must hold a mapping")
    unknown = set(data) - SWEEP_KEYS
    if unknown:
        raise SweepError(f"unknown key(s) {sorted(unknown)} in {path}; allowed: {sorted(SWEEP_KEYS)}")
    if not data.get("base_config"):
        raise SweepError(f"{path} needs base_config (e.g. configs/base.yml)")
    points = data.get("points") or []
    if not isinstance(points, list):
        raise SweepError(f"'points' in {path} must be a list of mappings")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = str(data.get("name") or stem)
    return Sweep(name, str(data["base_config"]), _mapping(data, "fixed"),
                 expand_points(_mapping(data, "grid"), points), _mapping(data, "xpk"))  # fmt: skip


def format_value(value: Any) -> str:
    """A YAML value as the trainer's key=value parser reads it back (true/false, flow lists)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)  # JSON is YAML flow syntax
    return str(value)


def overrides_argv(values: Mapping[str, Any]) -> list[str]:
    return [f"{k}={format_value(v)}" for k, v in values.items()]


def run_name(sweep: Sweep, point: Point) -> str:
    """'cpu-layouts-03-fsdp4xtp2': lowercase, digits and '-', so it also makes a valid XPK workload name."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{sweep.name}-{point.index:02d}-{point.name}".lower()).strip("-")
    return slug[:60].rstrip("-")


# --------------------------------------------------------------------------------------------- local runs


@dataclasses.dataclass
class Launch:
    """A finished trainer process: exit code and each output line with its arrival time after launch (s)."""

    returncode: int
    lines: list[tuple[float, str]]
    wall_s: float


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


def error_line(lines: Sequence[tuple[float, str]]) -> str:
    """The trainer's one-line error, or the last non-empty line (e.g. a traceback's last line)."""
    texts = [text for _, text in lines if text.strip()]
    errors = [t for t in texts if t.startswith("maxshard: error:")]
    return (errors or texts or ["(no output)"])[-1].strip()


def first_line(lines: Sequence[tuple[float, str]], pattern: str) -> tuple[float, re.Match[str]] | None:
    for t, text in lines:
        match = re.match(pattern, text)
        if match:
            return t, match
    return None


def parse_bytes(text: str) -> int | None:
    """'357.0 KiB' -> 365568 (rounded as printed)."""
    match = re.fullmatch(r"\s*([\d.]+) (B|KiB|MiB|GiB|TiB)\s*", text)
    return round(float(match[1]) * _UNITS[match[2]]) if match else None


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


def step_figures(lines: Sequence[tuple[float, str]], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput of the median step, memory, device count and final loss of a run that logged steps."""
    mid = median_record(records)
    row: dict[str, Any] = {"step_time_s": mid["step_time"], "final_loss": records[-1].get("loss")}
    for key in ("tokens_per_sec_per_device", "tflops_per_device", "mfu"):
        row[key] = mid.get(key)
    for key in ("bytes_in_use", "peak_bytes_in_use"):
        row[key] = max((r[key] for r in records if key in r), default=None)
    devices = first_line(lines, r"mesh: .*\((\d+) devices\)")
    if devices:
        row["devices"] = int(devices[1][1])
        row["tokens_per_sec"] = row["tokens_per_sec_per_device"] * row["devices"]
    estimate = first_line(lines, r"per-device memory estimate: .*= (.+)$")
    row["est_bytes_per_device"] = parse_bytes(estimate[1][1]) if estimate else None
    return row


def summarize(point: Point, steps: Any, result: Launch, everything: list[dict[str, Any]]) -> dict[str, Any]:
    """One results row for a finished point, from its output lines and its metrics.jsonl records."""
    records = [r for r in everything if "step_time" in r]
    overrides = " ".join(overrides_argv(point.overrides))
    row = {"index": point.index, "name": point.name, "overrides": overrides, "steps": steps,
           "wall_s": round(result.wall_s, 2)}  # fmt: skip
    if result.returncode == 2:
        return {**row, "status": "skipped", "error": error_line(result.lines)}
    if result.returncode != 0 or not records:
        why = error_line(result.lines) if result.returncode else "no step was logged (steps < 2?)"
        return {**row, "status": "failed", "error": f"exit {result.returncode}: {why}"}
    figures = {**step_figures(result.lines, records), **timing_figures(result.lines, records, everything)}
    return {**row, "status": "ok", **figures}


def run_point(sweep: Sweep, point: Point, runs_dir: str, timeout_s: float, echo: bool) -> dict[str, Any]:
    """Trains one point in its own process and summarizes it."""
    merged = sweep.merged(point)
    name = run_name(sweep, point)
    owned = {"run_name": name, "base_output_directory": runs_dir, "log_period": 1}
    values = {**{k: v for k, v in merged.items() if k not in RUNNER_KEYS}, **owned}
    argv = [sys.executable, "-m", "maxshard.train", sweep.base_config, *overrides_argv(values)]
    result = launch(argv, timeout_s, echo)
    records = read_metrics(os.path.join(runs_dir, name, "metrics.jsonl"))
    return {**summarize(point, merged.get("steps"), result, records), "run_name": name}


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


# --------------------------------------------------------------------------------------------- outputs


def write_results(rows: Sequence[Mapping[str, Any]], out: str, sweep: Sweep) -> None:
    """results.csv (fixed columns, blanks where unknown) and results.jsonl (one JSON object per point)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.csv"), "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS} for row in rows)
    with open(os.path.join(out, "results.jsonl"), "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"sweep": sweep.name, **{k: row.get(k) for k in COLUMNS}}) + "\n")


def plot(rows: Sequence[Mapping[str, Any]], path: str, title: str) -> None:
    """Horizontal bars of tokens/s/device per point; skipped and failed points are labelled, without a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["name"] for row in rows]
    values = [row.get("tokens_per_sec_per_device") or 0.0 for row in rows]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    bars = ax.barh(range(len(rows)), values, color="tab:blue")
    for bar, row in zip(bars, rows):
        label = f"{row['tokens_per_sec_per_device']:,.0f}" if row["status"] == "ok" else row["status"]
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens / s / device (median step)")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell(value: Any, fmt: str) -> str:
    return "" if value is None or value == "" else format(value, fmt)


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The table for README.md: one row per point."""
    lines = ["| point | status | ms/step | tokens/s/device | TFLOP/s/device | compile s | final loss |",
             "|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in rows:
        ms = row["step_time_s"] * 1e3 if row.get("step_time_s") else None
        status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}"
        lines.append(
            f"| {row['name']} | {status.replace('|', '/')} | {_cell(ms, '.0f')} | "
            f"{_cell(row.get('tokens_per_sec_per_device'), ',.0f')} | {_cell(row.get('tflops_per_device'), '.4f')} | "
            f"{_cell(row.get('compile_s'), '.1f')} | {_cell(row.get('final_loss'), '.3f')} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- XPK


def xpk_settings(sweep: Sweep, args: argparse.Namespace) -> dict[str, Any]:
    """The sweep file's `xpk:` defaults overridden by the command line; SweepError if a required one is missing."""
    unknown = set(sweep.xpk) - set(XPK_FLAGS)
    if unknown:
        raise SweepError(f"unknown key(s) {sorted(unknown)} under xpk:; allowed: {', '.join(XPK_FLAGS)}")
    given = {k: getattr(args, k) for k in XPK_FLAGS if getattr(args, k) is not None}
    if "docker_image" in given or "base_docker_image" in given:
        given.setdefault("docker_image", None)
        given.setdefault("base_docker_image", None)
    settings = {**sweep.xpk, **given}
    missing = [k for k in ("cluster", "project", "zone", "device_type") if not settings.get(k)]
    if not (settings.get("docker_image") or settings.get("base_docker_image")):
        missing.append("docker_image (or base_docker_image)")
    if missing:
        raise SweepError("--xpk needs " + ", ".join("--" + m.replace("_", "-") for m in missing))
    return settings


def launcher_argv(settings: Mapping[str, Any], trainer_argv: Sequence[str]) -> list[str]:
    """`python -m maxshard.launch xpk` flags (dry run: no --execute) then `--` and the trainer's argv."""
    image = ("--docker-image", settings["docker_image"]) if settings.get("docker_image") else (
        "--base-docker-image", settings["base_docker_image"])  # fmt: skip
    flags = ["--cluster", settings["cluster"], "--project", settings["project"], "--zone", settings["zone"],
             "--device-type", settings["device_type"], "--num-slices", str(settings.get("num_slices") or 1),
             *image]  # fmt: skip
    return ["xpk", *map(str, flags), "--", *trainer_argv]


def xpk_point(sweep: Sweep, point: Point, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Validates one point through the launcher's dry run (in process, nothing executed)."""
    from maxshard.launch.__main__ import main as launch_main

    trainer = [sweep.base_config, *overrides_argv(sweep.merged(point)), f"run_name={run_name(sweep, point)}"]
    argv = launcher_argv(settings, trainer)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = launch_main(argv)
    row = {"index": point.index, "name": point.name, "overrides": " ".join(overrides_argv(point.overrides)),
           "command": shlex.join(["python", "-m", "maxshard.launch", *argv])}  # fmt: skip
    if code != 0:
        return {**row, "status": "skipped", "error": (stderr.getvalue().strip().splitlines() or ["?"])[-1]}
    return {**row, "status": "ok", "xpk_command": stdout.getvalue().strip()}


def run_xpk(sweep: Sweep, settings: Mapping[str, Any], out: str) -> list[dict[str, Any]]:
    """Prints one launcher command per valid point (a `# skipped` comment for the others) and saves them."""
    rows = [xpk_point(sweep, point, settings) for point in sweep.points]
    lines = [f"# sweep {sweep.name}: {len(rows)} points; each command validates and prints `xpk workload create`,"
             " add --execute (after xpk) to submit"]  # fmt: skip
    for row in rows:
        if row["status"] == "ok":
            lines.append(row["command"])
        else:
            lines.append(f"# skipped {row['name']}: {row['error']}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "xpk_commands.sh"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(out, "xpk.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"sweep": sweep.name, **row}) + "\n" for row in rows)
    return rows


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", help="sweep YAML (see the module docstring)")
    parser.add_argument("--out", help="results directory (default: benchmarks/results/<sweep file stem>)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per local point before it is killed")
    parser.add_argument("--repeats", type=int, default=1, help="runs per point (median step time is kept)")
    parser.add_argument("--keep-runs", action="store_true", help="keep each point's run directory")
    parser.add_argument("-v", "--verbose", action="store_true", help="echo every trainer line")
    xpk = parser.add_argument_group("XPK (print one submission per point instead of running locally)")
    xpk.add_argument("--xpk", action="store_true")
    for flag in XPK_FLAGS:
        xpk.add_argument("--" + flag.replace("_", "-"), type=int if flag == "num_slices" else str, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every point ran or was skipped as invalid; 1 if a point failed; 2 for a bad sweep file or flag."""
    args = build_parser().parse_args(argv)
    stem = os.path.splitext(os.path.basename(args.sweep))[0]
    out = args.out or os.path.join(REPO, "benchmarks", "results", stem)
    try:
        sweep = load_sweep(args.sweep)
        if args.xpk:
            run_xpk(sweep, xpk_settings(sweep, args), out)
            return 0
    except SweepError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    rows = run_local(sweep, out, args.timeout, args.verbose, args.keep_runs, max(1, args.repeats))
    write_results(rows, out, sweep)
    plot(rows, os.path.join(out, f"{stem}.png"), f"sweep {sweep.name}: tokens/s/device per point")
    print(markdown_table(rows))
    print(f"results: {os.path.join(out, 'results.csv')}, results.jsonl, {stem}.png")
    return 1 if any(row["status"] == "failed" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
