"""A sweep as one SLURM job array: one sbatch script, array index i trains point i; then every point's figures.

    python benchmarks/sweep_slurm.py benchmarks/sweeps/cpu_layouts.yml --nodes 1 [--partition P --time T] [--submit]

Each point's trainer argv is what the local runner gives it (sweep_run.point_argv: its keys, `run_name`,
`base_output_directory` = OUT/runs, `log_period=1`), checked by the trainer's config parser first: a point it rejects
is left out of the array and recorded as `skipped` with the one-line error, as the XPK printout does. The script is
maxshard.launch.slurm's (wiring, quoting, preemption and requeue as for one job), written to OUT/slurm/. With
`--submit`, it submits and waits until every index ended, then the rows are collected from each index's exit
status, log files and metrics.jsonl (sweep_run.collect_point) and written as for a local sweep (results.csv,
results.jsonl). The runs and the results directory must be on a file system the nodes share.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python benchmarks/sweep_slurm.py`
    sys.path.insert(0, REPO)

from benchmarks.sweep_report import write_results  # noqa: E402
from benchmarks.sweep_run import collect_point, describe, point_argv  # noqa: E402
from benchmarks.sweep_spec import Point, Sweep, SweepError, load_sweep, overrides_argv, run_name  # noqa: E402
from maxshard.errors import ConfigError  # noqa: E402
from maxshard.launch import slurm  # noqa: E402


def array_points(sweep: Sweep, runs_dir: str, nodes: int, python: str) -> tuple[list[tuple[Point, tuple]], list]:
    """(point, full trainer command line) for every point the config parser accepts; skipped rows for the others."""
    valid, skipped = [], []
    for point in sweep.points:
        try:
            argv, _ = slurm.prepare_trainer_argv(point_argv(sweep, point, runs_dir), nodes, run_name(sweep, point))
        except ConfigError as e:
            skipped.append({"index": point.index, "name": point.name, "status": "skipped", "error": str(e),
                            "overrides": " ".join(overrides_argv(point.overrides))})  # fmt: skip
            continue
        valid.append((point, (python, "-m", "maxshard.train", *argv)))
    return valid, skipped


def array_job(sweep: Sweep, out: str, args: argparse.Namespace) -> tuple[slurm.Job, list[Point], list]:
    """The job array over the valid points, the points in index order, and the rows of the skipped ones."""
    resources = slurm.check_resources(slurm.Resources(args.nodes, args.tasks_per_node, args.gpus_per_node,
                                                      args.partition, args.time, args.account, args.signal_lead))
    runs_dir = os.path.join(out, "runs")
    valid, skipped = array_points(sweep, runs_dir, resources.nodes, args.python)
    if not valid:
        raise SweepError("no point of the sweep has a config the trainer accepts: " +
                         "; ".join(f"{r['name']}: {r['error']}" for r in skipped))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", sweep.name).strip("-") or "sweep"
    job = slurm.Job(name, resources, tuple(argv for _, argv in valid), os.path.join(out, "slurm"), REPO,
                    slurm.check_env(args.env))  # fmt: skip
    return job, [point for point, _ in valid], skipped


def _read_lines(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().splitlines()


def collect(sweep: Sweep, out: str, job: slurm.Job, points: Sequence[Point], job_id: str) -> list[dict[str, Any]]:
    """One row per array index, from `slurm-<job>_<index>.{exit,out,err}` and the point's metrics.jsonl."""
    rows = []
    for index, point in enumerate(points):
        stem = os.path.join(job.log_dir, f"slurm-{job_id}_{index}")
        status = _read_lines(stem + ".exit")
        returncode = int(status[0]) if status and status[0].strip().lstrip("-").isdigit() else -1
        lines = _read_lines(stem + ".out") + _read_lines(stem + ".err")
        rows.append(collect_point(sweep, point, os.path.join(out, "runs"), returncode, lines))
    return rows


def wait_for(job_id: str, run: Callable[..., subprocess.CompletedProcess], poll_s: float = 1.0,
             failures: int = 60) -> None:
    """Until no index of the array is in the queue (pending, running or requeued); SweepError after `failures`
    squeue calls in a row that could not ask the controller. Not `sbatch --wait`: it polls ever more rarely, and
    lags a short job by tens of seconds."""
    failed = 0
    while True:
        done = run(["squeue", "-h", "-j", job_id, "-o", "%i"], capture_output=True, text=True, check=False)
        if (done.returncode == 0 and not done.stdout.strip()) or "Invalid job id" in done.stderr:
            return  # ended (an ended job is forgotten after the cluster's MinJobAge)
        failed = 0 if done.returncode == 0 else failed + 1
        if failed >= failures:
            raise SweepError(f"squeue failed {failed} times in a row: {done.stderr.strip()}")
        time.sleep(poll_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", help="sweep YAML (benchmarks/sweep.py describes it)")
    parser.add_argument("--out", help="results directory, shared with the nodes (default: benchmarks/results/<stem>)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--tasks-per-node", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=0)
    parser.add_argument("--partition", default="")
    parser.add_argument("--time", default="")
    parser.add_argument("--account", default="")
    parser.add_argument("--signal-lead", type=int, default=slurm.DEFAULT_SIGNAL_LEAD_S)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--python", default=sys.executable, help="the interpreter on the nodes (default: this one)")
    parser.add_argument("--submit", action="store_true", help="submit, wait for every index, collect the results")
    return parser


def main(argv: Sequence[str] | None = None, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> int:
    """0 when every point ran or was skipped as invalid; 1 if a point (or sbatch) failed; 2 for a bad file or flag."""
    args = build_parser().parse_args(argv)
    stem = os.path.splitext(os.path.basename(args.sweep))[0]
    out = os.path.abspath(args.out or os.path.join(REPO, "benchmarks", "results", stem))
    try:
        sweep = load_sweep(args.sweep)
        with contextlib.chdir(REPO):  # base_config is relative to the repository, where the job runs too
            job, points, skipped = array_job(sweep, out, args)
        script = slurm.write_script(job, os.path.join(job.log_dir, f"{job.name}.sbatch"))
    except (SweepError, ConfigError) as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    for row in skipped:
        print(f"# skipped {row['name']}: {row['error']}")
    if not args.submit:
        print(f"wrote {script} ({len(points)} array indices); submit it with: sbatch {script}")
        return 0
    done = run(slurm.sbatch_argv(script), capture_output=True, text=True, check=False, cwd=REPO)
    try:
        job_id = slurm.job_id_of(done.stdout)
    except ConfigError as e:
        print(f"sweep: error: {e} {done.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"submitted job array {job_id} ({len(points)} indices); waiting for all of them", flush=True)
    try:
        wait_for(job_id, run)
    except SweepError as e:
        print(f"sweep: error: {e}; job array {job_id} may still be running", file=sys.stderr)
        return 1
    rows = sorted(collect(sweep, out, job, points, job_id) + skipped, key=lambda r: r["index"])
    for row in rows:
        print(describe(row), flush=True)
    write_results(rows, out, sweep)
    return 1 if any(row["status"] == "failed" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
