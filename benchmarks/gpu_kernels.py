"""Where one train step's device time goes: its kernels from a profiler trace, grouped by kind and by name.

    python benchmarks/gpu_kernels.py [--steps 3] [--top 25] [key=value ...]

Builds the run's config like the trainer (configs/base.yml + the overrides; the 1b preset at 8k tokens, bfloat16,
by default), compiles and warms up the train step, then traces `--steps` steps with `jax.profiler.trace(...,
create_perfetto_trace=True)` and reads the trace's complete events ("ph": "X") on the device's streams. Each kernel
is put in one kind by its name (matmul, attention, collective, copy, other fusion) and the table gives each kind's
share of the summed kernel time, then the `--top` kernels by time. The per-step device time is compared with the
wall time of the same steps: a gap means the device waited (host, launch or input). The last line, `RESULT {...}`,
holds the same figures as JSON for `gpu_suite.py`, which collects the runs into one table.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence

import accelerator  # benchmarks/ is the script's directory
import jax

from maxshard.model import quantization

MODEL = ("model_name=1b", "override_model_config=true", "dataset_type=synthetic", "dtype=bfloat16",
         "max_target_length=8192", "per_device_batch_size=2", "eval_period=0", "enable_tensorboard=false")

# First match wins; names as XLA:GPU and cuDNN/cuBLAS/NCCL call their kernels.
KINDS = (
    # mosaic_gpu: tokamax's kernels, its attention forward (flash_attention_sm90_mosaic_gpu_kernel) and backward
    # (batched_body_mosaic_gpu_kernel), the only Mosaic GPU kernels a model with dense or tiled-MoE MLPs runs
    ("attention", r"cudnn|flash|fmha|attention|sdpa|mosaic_gpu"),
    ("collective", r"nccl|all-?reduce|all-?gather|reduce-?scatter|all-?to-?all|collective"),
    ("matmul", r"gemm|nvjet|cublas|cutlass|sm\d+_xmma|dot|wgmma|matmul"),  # nvjet: cuBLAS's Hopper GEMMs
    ("copy", r"memcpy|memset|copy|transpose"),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, lowered)), "other fusion")


def device_kernels(trace: dict, device_pattern: str) -> list[tuple[str, float]]:
    """(name, microseconds) of every complete event on the kernel streams of a process whose name matches
    `device_pattern`. A device's process also has derived lines ("XLA Ops", "XLA Modules", "Steps") that repeat the
    same time; where threads named "Stream ..." exist only those are read."""
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    processes = {e["pid"]: e.get("args", {}).get("name", "") for e in meta if e.get("name") == "process_name"}
    devices = {pid for pid, name in processes.items() if re.search(device_pattern, name, re.IGNORECASE)}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in meta
               if e.get("name") == "thread_name" and e["pid"] in devices}
    streams = {key for key, name in threads.items() if name.lower().startswith("stream")}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("pid") in devices]
    if streams:
        events = [e for e in events if (e["pid"], e.get("tid")) in streams]
    print(f"device lines read: {sorted({threads.get(k, '?') for k in (streams or threads)})[:8]}", file=sys.stderr)
    return [(e["name"], float(e.get("dur", 0))) for e in events]


MARK = "RESULT "  # the prefix of the JSON line gpu_suite.py reads


def kinds_ms(kernels: list[tuple[str, float]], steps: int) -> dict[str, float]:
    """Milliseconds per step of each kind (only the kinds present)."""
    by_kind: dict[str, float] = collections.Counter()
    for name, dur in kernels:
        by_kind[kind_of(name)] += dur
    return {kind: dur / steps / 1e3 for kind, dur in by_kind.items()}


def report(kernels: list[tuple[str, float]], steps: int, wall_s: float, top: int) -> str:
    total = sum(d for _, d in kernels) or 1.0
    by_kind: dict[str, float] = collections.Counter()
    by_name: dict[str, float] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    for name, dur in kernels:
        by_kind[kind_of(name)] += dur
        by_name[name] += dur
        calls[name] += 1
    lines = [f"device kernel time per step {total / steps / 1e3:.1f} ms, wall time per step "
             f"{wall_s / steps * 1e3:.1f} ms ({len(kernels) // max(steps, 1)} kernels per step)", "",
             "| kind | ms per step | share |", "|---|---:|---:|"]
    for kind, dur in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {dur / steps / 1e3:.1f} | {100 * dur / total:.1f}% |")
    lines += ["", "| kernel | kind | calls per step | ms per step | share |", "|---|---|---:|---:|---:|"]
    for name, dur in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name[:90]} | {kind_of(name)} | {calls[name] / steps:g} | {dur / steps / 1e3:.2f} | "
                     f"{100 * dur / total:.1f}% |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device-pattern", default=r"/device:(GPU|TPU)",
                        help="regex of the trace's process names that are device streams")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    cfg = accelerator.load(MODEL, args.overrides)
    print(f"{cfg.device_kind}: remat {cfg.remat_policy}, attention {cfg.model.attention}, "
          f"{cfg.global_batch_size} x {cfg.max_target_length} tokens per step", flush=True)
    compiled_step = accelerator.compile_step(cfg)
    for _ in range(2):  # warm up
        jax.block_until_ready(compiled_step.run())
    # Untraced first: the profiler's own cost is in the traced wall time below, not in these figures.
    figures = accelerator.throughput(cfg, accelerator.median_seconds(compiled_step.run, max(args.steps, 3)))
    mfu = "n/a" if figures["mfu"] is None else f"{100 * figures['mfu']:.1f}%"
    print(f"untraced: {figures['step_ms']:.1f} ms per step, {figures['tokens_per_sec']:,.0f} tokens/s per device, "
          f"MFU {mfu} (peak: {quantization.peak_precision(cfg)})", flush=True)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        with jax.profiler.trace(out, create_perfetto_trace=True):
            for _ in range(args.steps):
                loss = compiled_step.run()
            jax.block_until_ready(loss)
        wall = time.perf_counter() - start
        found = glob.glob(os.path.join(out, "**", "perfetto_trace.json.gz"), recursive=True)
        if not found:
            print(f"no perfetto trace written under {out}", file=sys.stderr)
            return 1
        with gzip.open(found[0], "rt") as f:
            trace = json.load(f)
    kernels = device_kernels(trace, args.device_pattern)
    if not kernels:
        processes = sorted({e.get("args", {}).get("name", "") for e in trace["traceEvents"] if e.get("ph") == "M"})
        print(f"no events on processes matching {args.device_pattern!r}; processes: {processes}", file=sys.stderr)
        return 1
    print(report(kernels, args.steps, wall, args.top))
    result = {"device": cfg.device_kind, "attention": cfg.model.attention, "remat": cfg.remat_policy,
              "quantization": cfg.quantization, "peak": quantization.peak_precision(cfg), **figures,
              "kernel_ms": sum(d for _, d in kernels) / args.steps / 1e3, "kinds_ms": kinds_ms(kernels, args.steps)}
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
