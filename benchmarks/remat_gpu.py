"""Remat policies on one accelerator: the planner's peak against XLA's and the allocator's, and what each costs.

    python benchmarks/remat_gpu.py [--model 1b] [--policies auto,none,...,full] [--steps 10] [key=value ...]

The planner's memory model (maxshard/planning/memory.py) is calibrated on XLA:CPU, whose buffer assignment differs
from a GPU's; this script checks it where it matters. For the 1b preset (bfloat16, 8k tokens, batch 2 by default)
and each remat policy, in a fresh process each (so the allocator's peak is that policy's alone):

- planned: `Plan.peak_bytes` under the policy, what `remat_policy: auto` compares with the device's memory;
- compiled: `memory_analysis()` of the very program that is timed (arguments + temporaries + outputs - aliases);
- allocator: `memory_stats()['peak_bytes_in_use']` after the timed steps (state, batch, step and all);
- step time (median of --steps after a warm-up), tokens/s and MFU (model FLOPs, recompute not counted).

`auto` shows which policy the run would choose against this device's allocator limit. A policy the planner says
does not fit is reported as such (the run would refuse it), and an out-of-memory is a result, not a failure.
Runs on CPU too (for the script's own check; the figures there mean nothing for a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

MODEL = ("override_model_config=true", "dataset_type=synthetic", "dtype=bfloat16", "max_target_length=8192",
         "per_device_batch_size=2", "eval_period=0", "enable_tensorboard=false")
POLICIES = ("auto", "none", "minimal", "save_qkv_out_proj", "save_qkv_proj", "save_out_proj", "full")
MARK = "RESULT "


def measure(policy: str, preset: str, steps: int, overrides: Sequence[str]) -> dict:
    """One policy in this process: plan, compile, run (`steps` 0: compile only); the figures as a dict."""
    import accelerator  # benchmarks/ is the script's directory; imported here so that the parent starts no JAX
    import jax

    from maxshard.errors import ConfigError

    try:
        cfg = accelerator.load([f"model_name={preset}", *MODEL, f"remat_policy={policy}"], overrides)
    except ConfigError as e:
        return {"policy": policy, "error": str(e)}
    row = planned(cfg, policy)
    try:
        compiled_step = accelerator.compile_step(cfg)
        row.update(compiled_figures(compiled_step.step))
        if steps == 0:
            return row
        seconds = accelerator.median_seconds(compiled_step.run, steps)
    except Exception as e:  # noqa: BLE001 - an out-of-memory is a result
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return row
    row["allocator"] = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    row.update(accelerator.throughput(cfg, seconds))
    return row


def planned(cfg, policy: str) -> dict:
    """What the planner says: the fit decision and the plan's state and activation terms."""
    from maxshard.planning import estimate

    fit, plan = cfg.memory_fit, estimate.make_plan(cfg)
    return {"policy": policy, "chosen": fit.policy, "planned": fit.planned_bytes, "usable": fit.usable_bytes,
            "capacity_source": fit.capacity_source, "attention": cfg.model.attention, "device": cfg.device_kind,
            "plan_state": plan.params + plan.optimizer + plan.gradients,
            "plan_terms": plan.activation_terms.as_json()}


def compiled_figures(step) -> dict:
    """The compiled step's peak per device and the parts of its memory analysis."""
    from maxshard.planning import compiled

    stats = step.memory_analysis()
    parts = {k: getattr(stats, f"{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
    return {"compiled": compiled.peak_bytes(stats), "compiled_parts": parts}


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


COLUMNS = ("policy", "planned GiB", "compiled GiB", "planned / compiled", "allocator peak GiB", "step ms",
           "tokens/s", "MFU")


def row_cells(r: dict, full_ms: float | None) -> list[str]:
    """One policy's cells; what a policy did not reach (refused, out of memory, compile only) says why instead."""
    name = r["policy"] if r.get("chosen") in (None, r["policy"]) else f"{r['policy']} -> {r['chosen']}"
    cells = [name, _gib(r.get("planned"))]
    if "compiled" not in r:
        return cells + [r.get("error", "")]
    cells += [_gib(r["compiled"]), f"{r['planned'] / r['compiled']:.2f}"]
    if "step_ms" not in r:
        return cells + [r.get("error", "compile only")]
    speed = f" ({full_ms / r['step_ms']:.2f}x full)" if full_ms else ""
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return cells + [_gib(r["allocator"]), f"{r['step_ms']:.1f}{speed}", f"{r['tokens_per_sec']:,.0f}", mfu]


def table(rows: list[dict]) -> str:
    full_ms = next((r["step_ms"] for r in rows if r.get("policy") == "full" and "step_ms" in r), None)
    lines = [f"| {' | '.join(COLUMNS)} |", "|---|" + "---:|" * (len(COLUMNS) - 1)]
    for r in rows:
        cells = row_cells(r, full_ms)
        lines.append(f"| {' | '.join(cells + [''] * (len(COLUMNS) - len(cells)))} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", default="1b", help="model preset (configs/models/NAME.yml)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this policy in this process
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the model and layout")
    args = parser.parse_args(argv)
    if args.one:
        print(MARK + json.dumps(measure(args.one, args.model, args.steps, args.overrides)), flush=True)
        return 0
    rows = []
    for policy in args.policies.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", policy, "--steps", str(args.steps),
               "--model", args.model, *args.overrides]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = [line[len(MARK):] for line in done.stdout.splitlines() if line.startswith(MARK)]
        row = json.loads(found[-1]) if found else {"policy": policy, "error": f"exit {done.returncode}: "
                                                   + (done.stderr.strip().splitlines() or [""])[-1][:120]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    first = next((r for r in rows if "capacity_source" in r), {})
    print(f"\n{first.get('device', '')}: usable {_gib(first.get('usable'))} GiB ({first.get('capacity_source', '')})")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
