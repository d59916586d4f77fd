"""Run a sweep of training configs: locally, one process per point, or as XPK submissions (printed, never run).

    python benchmarks/sweep.py benchmarks/sweeps/cpu_layouts.yml [--out DIR] [--repeats N] [-v]
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
fixed < grid < point. Locally every point is its own trainer process; the runner writes `results.csv`,
`results.jsonl` and `<sweep>.png` (tokens/s/device per point) to `--out`. What each figure is and where it comes
from (the trainer's metrics.jsonl, its startup record included; only the start-up and compile timings from when
its output lines arrive) is written down in `benchmarks/sweep_run.py`.

The planner writes sweep files of its suggestions: `python -m maxshard.plan CONFIG key=value --search --topology T
[--num-slices N] --sweep-out FILE.yml` puts the user's overrides under `fixed`, each of the `--top` layouts that fit
as a point named by its layout (`fsdp4-tensor2-full`), and the target under `xpk:`; run it with `--xpk` on that
target (or locally, when this machine is the target).

The parts: `sweep_spec.py` reads the sweep file and names the points' runs, `sweep_run.py` runs them locally and
collects their figures, `sweep_report.py` writes the results, `sweep_xpk.py` prints the XPK submissions.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python benchmarks/sweep.py`: `benchmarks.*` and `maxshard` import from the repo
    sys.path.insert(0, REPO)

from benchmarks.sweep_report import markdown_table, plot, write_results  # noqa: E402
from benchmarks.sweep_run import run_local  # noqa: E402
from benchmarks.sweep_spec import SweepError, load_sweep  # noqa: E402
from benchmarks.sweep_xpk import XPK_FLAGS, run_xpk, xpk_settings  # noqa: E402


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
