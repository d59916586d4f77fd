"""The layout search's suggestions against what XLA compiles: planned peak vs compiled peak per device.

    python benchmarks/plan_search.py [--topology h100-80gb-8] [--top 3] [key=value ...]

Searches the 8B preset (plus any key=value) on the target as `python -m maxshard.plan --search` does, then compiles
the top layouts, the best of each kind not among them (tensor, sequence, context, data, pipeline, another remat
policy) and the one planned closest to the capacity, for the 8 simulated CPU devices: the train step is lowered from
abstract sharded arguments and compiled, nothing is allocated (~15-40 s per 8B layout on 2 cores). Compiled peak =
arguments + temporaries + outputs - aliased (`memory_analysis()`), per device. A target of more than 8 devices is not
compiled: its layouts need its count.

What differs between the plan and the compile: the compile runs on XLA:CPU, with attention=blockwise where an H100
plan has cudnn (the planner counts cudnn as blockwise plus its mask) and dtype=float32, the CPU's own dtype: XLA:CPU
emulates bfloat16 through float32 temporaries (tests/test_plan_memory.py), so a bfloat16 compile there over-states
what the GPU holds. The table shows the target's plan (bfloat16), the plan of the float32 CPU config, its compiled
peak, their ratio, and whether the compiled peak scaled to bfloat16 by the plan's own ratio (target plan / CPU
plan) fits the capacity. XLA:CPU's buffer assignment is not XLA:GPU's.
"""

from __future__ import annotations

import argparse
import sys
import time

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import jax

from maxshard import config
from maxshard.launch import topologies
from maxshard.parallel import mesh
from maxshard.planning import compiled, estimate
from maxshard.run import loading, search

CPU_KEYS = ("dtype=float32", "attention=blockwise")  # the CPU's own dtype; no cuDNN or splash on CPU
GIB = 2**30
KINDS = {  # the best layout of each kind is compiled too, when not among the top
    "tensor": lambda c: c.layout.sizes["tensor"] > 1,
    "sequence": lambda c: c.layout.sizes["sequence"] > 1,
    "context": lambda c: c.layout.sizes["context"] > 1,
    "data": lambda c: c.layout.sizes["data"] > 1,
    "pipeline": lambda c: c.layout.microbatches > 0,
    "remat": lambda c: c.layout.remat_policy != "full",
}


def compiled_peak(cfg: config.Config) -> int:
    """Per-device peak of the compiled train step (maxshard/planning/compiled.py)."""
    step = compiled.compile_train_step(cfg, mesh.build(cfg, jax.devices()[: cfg.num_devices]))
    return compiled.peak_bytes(step.memory_analysis())


def chosen(result: search.SearchResult, top: int) -> list[tuple[int, search.Candidate]]:
    """(rank, candidate): the top ones, the best of each kind in `KINDS` not already chosen, and the one planned
    closest to the capacity (where an under-count would matter)."""
    ranked = list(enumerate(result.fitting, 1))
    picks = ranked[:top]
    for test in KINDS.values():
        best = next(((r, c) for r, c in ranked if test(c)), None)
        if best is not None and best not in picks:
            picks.append(best)
    tightest = max(ranked, key=lambda rc: rc[1].peak, default=None)
    if tightest is not None and tightest not in picks:
        picks.append(tightest)
    return picks


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="key=value for configs/base.yml model_name=8b")
    parser.add_argument("--topology", default="h100-80gb-8")
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args(argv)
    target = topologies.parse(args.topology)
    if target.num_devices != common.DEVICES:
        parser.error(f"{args.topology} has {target.num_devices} devices; the compile has {common.DEVICES}")
    user = [common.BASE, "model_name=8b", *args.overrides]
    result = search.search(user, target, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"{result.considered} layouts, {result.planned} valid, {len(result.fitting)} fit in "
          f"{result.capacity / GIB:.1f} GiB per device; searched in {result.seconds:.1f} s\n")
    columns = ("rank", "layout", "planned (target, bf16)", "planned (CPU, f32)", "compiled (CPU, f32)",
               "planned / compiled", "fits (scaled)", "compile s")
    print(f"| {' | '.join(columns)} |\n|{'---|' * len(columns)}")
    for rank, c in chosen(result, args.top):
        cfg = loading.complete(config.finalize(config.parse([*user, *CPU_KEYS, *c.overrides]), common.DEVICES))
        start = time.perf_counter()
        peak = compiled_peak(cfg)
        seconds = time.perf_counter() - start
        cpu_plan = estimate.make_plan(cfg).peak_bytes
        fits = "yes" if peak * c.peak / cpu_plan <= result.capacity else "**no**"
        print(f"| {rank} | {c.layout.label} | {c.peak / GIB:.1f} GiB | {cpu_plan / GIB:.1f} GiB | "
              f"{peak / GIB:.1f} GiB | {cpu_plan / peak:.2f} | {fits} | {seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
