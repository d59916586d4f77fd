"""Plot loss and throughput of one or more runs from their `metrics.jsonl`.

    python tools/plot_metrics.py runs/a runs/b --out compare.png

Reads only the JSON lines `maxshard.observe.metrics.MetricsWriter` writes, so it needs neither TensorBoard nor JAX.
matplotlib is the optional `plot` extra (`pip install maxshard[plot]`); without it the tool says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

METRICS_FILE = "metrics.jsonl"
PANELS = (("loss", "loss"), ("tokens_per_sec_per_device", "tokens/s/device"))


def read_run(run_dir: str) -> list[dict[str, Any]]:
    """Every record of a run, in file order; a torn last line (a crash mid-write) is skipped."""
    records = []
    with open(os.path.join(run_dir, METRICS_FILE), encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a finite value for `key` (null marks a NaN loss)."""
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def figure(runs: dict[str, list[dict[str, Any]]]) -> Any:
    """One panel per entry of PANELS, one line per run. Points carry markers: a run that logged throughput once
    (a short run logs it at its last step only) would otherwise draw an invisible one-point line."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on training machines
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4))
    for ax, (key, label) in zip(axes, PANELS):
        for name, records in runs.items():
            steps, values = series(records, key)
            ax.plot(steps, values, label=name, marker="o", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def plot(runs: dict[str, list[dict[str, Any]]], out: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(runs)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def run_labels(run_dirs: list[str]) -> list[str]:
    """Legend names: the directory's base name, or the whole path where two runs share a base name."""
    names = [os.path.basename(os.path.normpath(d)) or d for d in run_dirs]
    return [name if names.count(name) == 1 else d for name, d in zip(names, run_dirs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", default="metrics.png", help="PNG file to write (default: metrics.png)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_metrics needs matplotlib: pip install 'maxshard[plot]' (or pip install matplotlib)",
              file=sys.stderr)
        return 2
    missing = [d for d in args.run_dirs if not os.path.isfile(os.path.join(d, METRICS_FILE))]
    if missing:
        print(f"no {METRICS_FILE} in {', '.join(missing)}", file=sys.stderr)
        return 1
    runs = {label: read_run(d) for label, d in zip(run_labels(args.run_dirs), args.run_dirs)}
    plot(runs, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
