"""A local sweep's outputs: results.csv and results.jsonl (one row per point), the README table and a PNG.

The CSV has fixed columns (blank where a figure is unknown, e.g. a skipped point's step time) so that sweeps run at
different times, or with a trainer that records less, can be compared column by column.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.sweep_spec import Sweep

COLUMNS = (
    "index", "name", "status", "overrides", "devices", "steps", "step_time_s", "tokens_per_sec",
    "tokens_per_sec_per_device", "tflops_per_device", "mfu", "bytes_in_use", "peak_bytes_in_use",
    "est_bytes_per_device", "startup_s", "time_to_first_step_s", "compile_s", "compile_from", "final_loss", "wall_s",
    "repeats", "run_name", "error",
)  # fmt: skip


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
    import matplotlib  # deferred: only a local sweep draws, and matplotlib is slow to import

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
