"""Issue 72's GPU measurements as one command: every run of one GPU, its tables, and what it ran on.

    python benchmarks/gpu_suite.py [--dry-run] [--only NAME ...] [--device-type h200-141gb-8] [--steps 3]

On a machine with an NVIDIA GPU it runs, each in its own process (so one run's out-of-memory or allocator peak is
its own), the existing scripts:

- the 1b preset at 8,192 tokens through the CLI (`python -m maxshard.train`), as a user runs it: step time,
  tokens/s and MFU from the run's metrics.jsonl (the steps after the first log period);
- `gpu_kernels.py` for the 1b preset (batch 2 x 8,192) and for Llama-3.1-8B's widths at 8,192 tokens at the largest
  depth whose planned peak fits one GPU of `--device-type` (the planner's own decision, `remat_policy: auto`):
  bf16, int8 and fp8, and the XLA:GPU options table (`xla_gpu_options=tuned`) against the default; each row its
  untraced step time, tokens/s, MFU and the step's device time by kernel kind;
- `attention_gpu.py --tokamax` (the attention kernels alone, 8k, and the 1b preset per attention);
- the 8B widths at that depth through the CLI for 200 steps in bf16, int8 and fp8: step time, tokens/s and the mean
  loss of the last quarter of the logged steps against bf16's (the 8-bit loss curves);
- `remat_gpu.py` for the 8B widths at that depth (planned vs compiled vs allocator peak per policy);

and prints the tables in the layout of benchmarks/README.md's "On one H200" section, headed by the device, the
driver (nvidia-smi) and the package versions. `--dry-run` prints the commands instead, on any machine: each is
also a run config that `tests/test_gpu_suite.py` loads. `--only` runs the measurements whose names start with one
of the given words (a lease too short for all of them).

`--hlo key=value ...` needs no GPU but JAX's CUDA plugin (`pip install -e ".[gpu-aot]"`): it compiles the run's train
step with XLA:GPU for one GPU of `--device-type` (planning/gpu_compile.py) and prints, as JSON, what the program
holds: its fusions, those that transpose, its copies and its GEMMs with 8-bit operands. That is compile-level
evidence of a program's structure (XLA:GPU without a device picks its GEMMs without autotuning), not of speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for path in (REPO, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)
# The measuring processes get this environment; this one plans on CPU and never opens the GPU (JAX would reserve
# 75% of its memory here, away from them).
CHILD_ENV = dict(os.environ)
os.environ["JAX_PLATFORMS"] = "cpu"

import gpu_kernels  # noqa: E402

MARK = gpu_kernels.MARK
ONE_B = gpu_kernels.MODEL  # the 1b preset, batch 2 x 8,192, bfloat16
EIGHT_B = ("model_name=8b", "override_model_config=true", "dataset_type=synthetic", "dtype=bfloat16",
           "max_target_length=8192", "per_device_batch_size=1", "eval_period=0", "enable_tensorboard=false")
CLI_STEPS = ("steps=12", "log_period=4", "enable_checkpointing=false")
LOSS_STEPS = ("steps=200", "log_period=10", "enable_checkpointing=false")  # the 8-bit loss curves against bf16's
DEPTHS = (32, 28, 24, 20, 16, 12, 8, 4)  # the 8B widths' depths tried, deepest first
VARIANTS = (("bf16", ()), ("int8", ("quantization=int8",)), ("fp8", ("quantization=fp8",)),
            ("bf16, xla_gpu_options=tuned", ("xla_gpu_options=tuned",)))
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
            "flax", "optax", "qwix", "tokamax", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13", "nvidia-cublas-cu12",
            "nvidia-cublas-cu13")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One process of the suite: its name (for `--only`), the table its figures go to, the command after the
    interpreter, and the run config it measures (configs/base.yml + `config`; empty for kernels alone)."""

    name: str
    table: str
    row: str
    command: tuple[str, ...]
    config: tuple[str, ...]

    def argv(self) -> list[str]:
        return [sys.executable, *self.command]


def merged(defaults: Sequence[str], overrides: Sequence[str]) -> tuple[str, ...]:
    """`defaults` with an override replacing the default of the same key (as `accelerator.load` merges them)."""
    given = {o.split("=", 1)[0] for o in overrides}
    return (*(o for o in defaults if o.split("=", 1)[0] not in given), *overrides)


def gpu_target(device_type: str):
    """One GPU of the node type `device_type`, as the planner describes it (the suite measures one GPU)."""
    from maxshard.launch.topologies import Target, parse

    node = parse(device_type, 1)
    return Target(node.name, "gpu", node.device_kind, 1, 1, 1)


def largest_depth(device_type: str) -> int:
    """The deepest of `DEPTHS` whose 8B-width run the planner fits on one GPU of `device_type` (`remat_policy:
    auto` finds a policy that fits); the shallowest when none does."""
    from maxshard.run.target import load_for_target

    target = gpu_target(device_type)
    for depth in DEPTHS:
        cfg = load_for_target(["configs/base.yml", *EIGHT_B, f"num_layers={depth}"], target)
        if cfg.memory_fit is not None and cfg.memory_fit.fits:
            return depth
    return DEPTHS[-1]


def measurements(depth: int, steps: int) -> list[Measurement]:
    """Every run of the suite, in the order they run (the 8B widths at `depth` layers)."""
    kernels = ("benchmarks/gpu_kernels.py", "--steps", str(steps), "--top", "10")
    eight_b = (*EIGHT_B, f"num_layers={depth}")
    out = [Measurement("cli", "cli", "1b preset, 8,192 x 2 tokens, attention auto",
                       ("-m", "maxshard.train", "configs/base.yml", *ONE_B, *CLI_STEPS), (*ONE_B, *CLI_STEPS)),
           Measurement("kernels-1b-cudnn", "kernels-1b", "bf16, attention=cudnn",
                       (*kernels, "attention=cudnn"), merged(ONE_B, ["attention=cudnn"]))]
    for label, extra in VARIANTS:
        name = label.split(",")[0] if not extra else extra[0].split("=")[1]
        out.append(Measurement(f"kernels-1b-{name}", "kernels-1b", f"{label}, attention auto", (*kernels, *extra),
                               merged(ONE_B, extra)))
    for label, extra in VARIANTS:
        name = label.split(",")[0] if not extra else extra[0].split("=")[1]
        overrides = (*eight_b, *extra)
        out.append(Measurement(f"kernels-8b-{name}", "kernels-8b", label, (*kernels, *overrides),
                               merged(ONE_B, overrides)))
    out.append(Measurement("attention", "verbatim", "attention kernels and the 1b preset per attention",
                           ("benchmarks/attention_gpu.py", "--lengths", "8192", "--steps", "5", "--tokamax"),
                           merged(("model_name=1b", "override_model_config=true", "dataset_type=synthetic",
                                   "dtype=bfloat16", "per_device_batch_size=1", "eval_period=0"),
                                  ["max_target_length=8192", "attention=tokamax"])))
    for label, extra in VARIANTS[:3]:
        out.append(Measurement(f"loss-8b-{label}", "cli", f"8B widths, {depth} layers, {label}, 200 steps",
                               ("-m", "maxshard.train", "configs/base.yml", *eight_b, *extra, *LOSS_STEPS),
                               (*eight_b, *extra, *LOSS_STEPS)))
    remat = ("auto", "minimal", "full")
    out.append(Measurement("remat-8b", "verbatim", f"8B widths, {depth} layers: remat policies",
                           ("benchmarks/remat_gpu.py", "--model", "8b", "--policies", ",".join(remat), "--steps",
                            str(max(steps, 3)), *eight_b[1:]),
                           (*eight_b, "remat_policy=auto")))
    return out


def versions() -> list[str]:
    """The device (nvidia-smi), driver and package versions the figures were taken with."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        smi = "nvidia-smi not found"
    found = []
    for package in PACKAGES:
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return [f"device: {smi or 'none'} (name, memory, driver)",
            f"Python {platform.python_version()}; {', '.join(found)}; maxshard {commit.stdout.strip() or '?'}"]


def has_gpu() -> bool:
    try:
        return "GPU" in subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_one(m: Measurement, out_dir: str) -> dict:
    """Runs `m`; what its table needs (gpu_kernels' RESULT line, the CLI run's metrics, or the script's tables)."""
    command = m.argv()
    if m.table == "cli":
        command += [f"base_output_directory={out_dir}", f"run_name={m.name}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=CHILD_ENV)
    failed = {"error": f"exit {done.returncode}: " + ((done.stderr.strip().splitlines() or [""])[-1][:160])}
    if m.table == "cli":
        return cli_figures(out_dir, m.name) if done.returncode == 0 else failed
    if m.table == "verbatim":
        lines = [line for line in done.stdout.splitlines() if not line.startswith("{")]
        return {"text": "\n".join(lines)} if done.returncode == 0 else failed
    found = [line[len(MARK):] for line in done.stdout.splitlines() if line.startswith(MARK)]
    return json.loads(found[-1]) if found else failed


def cli_figures(out_dir: str, name: str) -> dict:
    """The CLI run's medians over the logged steps after the first log period, and its startup choices."""
    files = glob.glob(os.path.join(out_dir, "**", name, "**", "metrics.jsonl"), recursive=True)
    if not files:
        return {"error": f"no metrics.jsonl under {out_dir}"}
    with open(files[0], encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    startup = next((r["startup"] for r in reversed(records) if "startup" in r), {})
    steps = [r for r in records if "step_time" in r][1:]  # the first logged period holds the compile
    if not steps:
        return {"error": "no step records"}
    median = {key: statistics.median(r[key] for r in steps if key in r) if any(key in r for r in steps) else None
              for key in ("step_time", "tokens_per_sec_per_device", "mfu")}
    losses = [r["loss"] for r in records if "loss" in r]
    tail = losses[-max(1, len(losses) // 4):]  # the last quarter of the logged losses
    return {"step_ms": median["step_time"] * 1e3, "tokens_per_sec": median["tokens_per_sec_per_device"],
            "mfu": median["mfu"], "loss_tail": statistics.mean(tail) if losses else None, "startup": startup}


def hlo_counts(text: str) -> dict[str, int]:
    """What a compiled program (`compiled.as_text()`) holds: fusion instructions, those whose fused computation
    transposes, copy instructions, and GEMMs (XLA's gemm fusions and cuBLAS calls) with an 8-bit operand.
    Each is counted once in the text: a scanned layer's body once, however many layers run it."""
    computations = {m.group(1): m.group(0) for m in re.finditer(r"^(%\S+) \(.*?\n}", text, re.M | re.S)}
    fusions = re.findall(r"^\s*(?:ROOT )?%\S+ = .*? fusion\(.*?calls=(%[\w.\-]+)", text, re.M)
    gemms = [computations.get(c, "") for c in fusions if "gemm" in c]
    cublas = re.findall(r'custom_call_target="__cublas\$lt\$matmul(\$f8)?"', text)
    eight_bit = re.compile(r"\b(f8e\w+|s8)\[")
    return {"fusions": len(fusions),
            "transposing fusions": sum(" transpose(" in computations.get(c, "") for c in fusions),
            "copies": len(re.findall(r"^\s*(?:ROOT )?%\S+ = \S+ copy\(", text, re.M)),
            "GEMMs": len(gemms) + len(cublas),
            "8-bit GEMMs": sum(bool(eight_bit.search(g.split("\n", 1)[0])) for g in gemms) + sum(map(bool, cublas))}


def compile_hlo(device_type: str, overrides: Sequence[str]) -> dict[str, int]:
    """`hlo_counts` of the train step of configs/base.yml + `overrides`, compiled for one GPU of `device_type`
    without one."""
    from maxshard.parallel import mesh
    from maxshard.planning import gpu_compile
    from maxshard.planning.compiled import compile_train_step
    from maxshard.run.target import load_for_target

    target = gpu_target(device_type)
    cfg = load_for_target(["configs/base.yml", *overrides], target)
    return hlo_counts(compile_train_step(cfg, mesh.build(cfg, gpu_compile.abstract_devices(target))).as_text())


def _mfu(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def kernel_table(rows: list[tuple[Measurement, dict]]) -> str:
    """The "On one H200" table: step (and its speed against the table's first row), tokens/s, MFU, the device time
    by kind."""
    lines = ["| run | step | tokens/s/device | MFU | attention | matmul | other fusions | copies |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    first = next((r["step_ms"] for _, r in rows if "step_ms" in r), None)
    for m, r in rows:
        if "step_ms" not in r:
            lines.append(f"| {m.row} | {r.get('error', '')} | | | | | | |")
            continue
        kinds, total = r.get("kinds_ms", {}), r.get("kernel_ms") or 1.0
        attention = kinds.get("attention", 0.0)
        cells = [f"{m.row} ({r['attention']}, remat {r['remat']})",
                 f"{r['step_ms']:.1f} ms ({first / r['step_ms']:.2f}x)",
                 f"{r['tokens_per_sec']:,.0f}", f"{_mfu(r['mfu'])} ({r['peak'].split(' (')[0]})",
                 f"{attention:.1f} ms ({100 * attention / total:.1f}%)",
                 *(f"{kinds.get(kind, 0.0):.1f}" for kind in ("matmul", "other fusion", "copy"))]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def report(results: list[tuple[Measurement, dict]], depth: int) -> str:
    """Every table of the suite, in the README's layout."""
    parts = []
    reference = next((r.get("loss_tail") for m, r in results if m.name == "loss-8b-bf16"), None)
    for m, r in results:
        if m.table == "cli":
            loss = "" if r.get("loss_tail") is None else f", loss (last quarter) {r['loss_tail']:.4f}" + (
                f" ({r['loss_tail'] / reference:.4f} of bf16's)" if reference else "")
            parts.append(f"Through the CLI, {m.row}: " + (r["error"] if "error" in r else
                         f"{r['step_ms']:.1f} ms per step, {r['tokens_per_sec']:,.0f} tokens/s per device, MFU "
                         f"{_mfu(r['mfu'])}{loss}; startup {json.dumps(r['startup'])[:300]}"))
    for table, title in (("kernels-1b", "1b preset, 8,192 x 2 tokens"),
                         ("kernels-8b", f"Llama-3.1-8B widths, {depth} layers, 8,192 tokens")):
        rows = [(m, r) for m, r in results if m.table == table]
        if rows:
            parts.append(f"{title}:\n\n{kernel_table(rows)}")
    parts += [f"{m.row}:\n\n{r.get('text', r.get('error', ''))}" for m, r in results if m.table == "verbatim"]
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--only", nargs="+", default=(), help="the measurements whose names start with these")
    parser.add_argument("--device-type", default="h200-141gb-8", help="the GPU node type the 8B depth is planned for")
    parser.add_argument("--steps", type=int, default=3, help="traced steps of each gpu_kernels.py run")
    parser.add_argument("--hlo", nargs="*", metavar="KEY=VALUE", help="compile without a GPU and count (see above)")
    args = parser.parse_args(argv)
    if args.hlo is not None:
        from maxshard.errors import ConfigError

        try:
            print(json.dumps(compile_hlo(args.device_type, args.hlo)))
        except ConfigError as e:  # no CUDA plugin, or a bad key: one line
            print(f"gpu_suite.py: error: {e}", file=sys.stderr)
            return 2
        return 0
    depth = largest_depth(args.device_type)
    chosen = [m for m in measurements(depth, args.steps) if not args.only or m.name.startswith(tuple(args.only))]
    if args.dry_run:
        print(f"# the 8B widths at {depth} layers: the deepest the planner fits on one GPU of {args.device_type}")
        for m in chosen:
            print(f"{m.name}: {shlex.join(['python', *m.command])}")
        return 0
    if not has_gpu():
        print("gpu_suite.py needs an NVIDIA GPU (`nvidia-smi -L` lists none); --dry-run prints the commands",
              file=sys.stderr)
        return 2
    header = versions()
    print("\n".join(header), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as out_dir:
        for m in chosen:
            print(f"running {m.name}: {shlex.join(['python', *m.command])}", flush=True)
            results.append((m, run_one(m, out_dir)))
            print(json.dumps(results[-1][1])[:400], flush=True)
    print("\n" + "\n".join(header) + "\n\n" + report(results, depth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
