"""`remat_policy: auto` decided by compiles, against every policy compiled: does auto take the policy with the least
recomputation whose compile fits?

    python benchmarks/auto_by_compile.py [--topology v5litepod-8] [--shapes pipeline,context,lora,fsdp,tensor]
                                         [--below 0.98] [--peaks FILE.json]

Each shape (the held-out grid of tests/test_plan_heldout_tpu.py, its remat policy replaced by auto, and two more
layouts of the same 125m model) is compiled for the target ahead of time under every policy auto chooses from
(`fit.by_preference`, XLA:TPU through libtpu: planning/tpu_compile.py). The usable memory is then set to --below x
the compiled peak of each policy in turn but the last (so that it and every policy auto prefers to it do not fit);
`run/auto_compile.choose` decides on the compiled peaks already in hand (what `maxshard.plan` and the trainer's
compile check run, the compiles looked up instead of repeated), and its answer is set beside the oracle: the first
policy in auto's order whose compiled peak fits. It prints one row a shape and usable memory: the oracle, auto's
choice, how many policies auto compiled of those there are, and the policies the estimate pruned (never compiled)
that would have fit. `--peaks` keeps the compiled peaks in a JSON file (by topology and shape) and reads them from
there when they are in it, so another --below costs no compile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # planning needs no accelerator (and an installed libtpu is not one)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxshard.launch import topologies  # noqa: E402
from maxshard.planning import fit  # noqa: E402
from maxshard.planning.tpu_compile import TpuOutOfMemory, abstract_devices, compile_step  # noqa: E402
from maxshard.run import auto_compile  # noqa: E402
from maxshard.run.target import load_for_target  # noqa: E402

BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")
MODEL = ("model_name=125m", "override_model_config=true", "loss_chunks=16", "remat_policy=auto")
SHAPES = {
    "pipeline": (*MODEL, "per_device_batch_size=4", "max_target_length=1024", "ici_pipeline_parallelism=2",
                 "num_pipeline_microbatches=4"),
    "context": (*MODEL, "per_device_batch_size=2", "max_target_length=1024", "ici_context_parallelism=4",
                "vocab_size=4096"),
    "lora": (*MODEL, "per_device_batch_size=4", "max_target_length=512", "lora_rank=8"),
    "fsdp": (*MODEL, "per_device_batch_size=2", "max_target_length=2048"),
    "tensor": (*MODEL, "per_device_batch_size=4", "max_target_length=1024", "ici_fsdp_parallelism=4",
               "ici_tensor_parallelism=2"),
}


def compiled_peaks(argv: list[str], target: topologies.Target, devices: list) -> tuple[dict[str, int | None], float]:
    """Every candidate policy's compiled train step peak (None: over the chip), in auto's order, and the seconds
    they took."""
    cfg = load_for_target(argv, target)
    peaks: dict[str, int | None] = {}
    started = time.perf_counter()
    for policy in fit.by_preference(cfg, fit.peaks_by_policy(cfg)):
        try:
            peaks[policy] = compile_step(auto_compile.with_policy(cfg, policy), target, devices)[0].peak
        except TpuOutOfMemory:
            peaks[policy] = None
        print(f"  {policy}: {peaks[policy]}", file=sys.stderr, flush=True)
    return peaks, time.perf_counter() - started


def rows(name: str, argv: list[str], target: topologies.Target, peaks: dict[str, int | None],
         below: float) -> list[str]:
    """One shape's lines of the table (module docstring), a line for each usable memory."""
    order = list(peaks)
    lines = []
    for under in order[:-1]:
        if peaks[under] is None:
            continue
        capacity = f"device_memory_gb={below * peaks[under] / 0.9 / 1e9:.12f}"  # its usable share: below x the peak
        cfg = load_for_target([*argv, capacity], target)
        usable = cfg.memory_fit.usable_bytes
        oracle = next((p for p in order if peaks[p] is not None and peaks[p] <= usable), None)
        chosen, tried = auto_compile.choose(cfg, usable, lambda policy: peaks[policy])
        compiled = {t.policy for t in tried}
        before = order if chosen is None else order[:order.index(chosen)]  # what auto would rather have taken
        missed = [p for p in before if p not in compiled and peaks[p] is not None and peaks[p] <= usable]
        cells = [name, f"{under} x {below:g}", f"{usable / 2**30:.3f}", oracle, chosen, f"{len(tried)} of {len(order)}",
                 ", ".join(missed) or "none"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _cached(path: str | None) -> dict:
    if path is None or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5litepod-8")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--below", type=float, default=0.98, help="usable = this x a policy's compiled peak")
    parser.add_argument("--peaks", default=None, help="a JSON file of compiled peaks, read and extended")
    args = parser.parse_args()
    target = topologies.parse(args.topology)
    cache = _cached(args.peaks)
    known = cache.setdefault(target.name, {})
    print("| shape | usable: a policy's peak x | usable (GiB) | least recompute that compiles within | auto chose | "
          "auto compiled | pruned that would fit |")
    print("|---|---|---:|---|---|---|---|")
    for name in args.shapes.split(","):
        argv = [BASE, *SHAPES[name]]
        if name not in known:
            peaks, seconds = compiled_peaks(argv, target, abstract_devices(target))
            print(f"{name}: compiled {len(peaks)} policies in {seconds:.0f}s", file=sys.stderr, flush=True)
            known[name] = peaks
            if args.peaks is not None:
                with open(args.peaks, "w", encoding="utf-8") as f:
                    json.dump(cache, f, indent=1)
        print("\n".join(rows(name, argv, target, known[name], args.below)), flush=True)


if __name__ == "__main__":
    main()
