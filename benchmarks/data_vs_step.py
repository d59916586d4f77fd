"""Tokens/s the text input pipeline delivers next to tokens/s the default model's train step consumes, 8 CPU devices.

    python benchmarks/data_vs_step.py [--batch-sizes 2,8] [--batches 50] [--steps 4] [--rounds 3] [key=value ...]

For each per_device_batch_size: the pipeline row is `make_input(cfg, mesh, "train")` on configs/base.yml's default
corpus (stdlib text, byte tokenizer, packing, its default grain_worker_count), timed as in `data_throughput.py`
(first batch apart, then `--batches` batches, global jax.Arrays ready); the step row is the train step of the same
default model (base.yml, fsdp over all 8 devices) on synthetic batches, timed as in `layouts.py`. The two are
measured apart (never competing with each other), and step rounds are interleaved between batch sizes. A ratio
pipeline/step above 1 means the pipeline produces tokens faster than the step eats them: it is not the bottleneck.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
from data_throughput import measure
from layouts import Runner

from maxshard.parallel import mesh as mesh_lib


def step_seconds(argvs: dict[str, Sequence[str]], steps: int, rounds: int, warmup: int = 2
                 ) -> tuple[dict[str, Runner], dict[str, float]]:
    """Train-step seconds (median of `rounds`) per named config (synthetic batches), compiled and warmed up first.

    Rounds are interleaved between the configs so a drift of a shared machine hits all alike. Returns the runners
    (for their configs and tokens per step) and {name: median seconds per step}.
    """
    runners: dict[str, Runner] = {}
    for name, argv in argvs.items():
        runners[name] = Runner([*argv, *common.STEP_ONLY])
        runners[name].run(1)  # compile
        if warmup:
            runners[name].run(warmup)
    times: dict[str, list[float]] = {name: [] for name in argvs}
    for r in range(rounds):
        for name, runner in runners.items():
            times[name].append(runner.run(steps))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {t[-1] * 1e3:.0f} ms" for n, t in times.items()),
              flush=True)
    return runners, {name: statistics.median(t) for name, t in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both")
    parser.add_argument("--batch-sizes", default="2,8", help="comma-separated per_device_batch_size values")
    parser.add_argument("--batches", type=int, default=50, help="timed pipeline batches per batch size")
    parser.add_argument("--steps", type=int, default=4, help="timed train steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved step rounds (median is reported)")
    args = parser.parse_args(argv)
    sizes = args.batch_sizes.split(",")
    pipeline: dict[str, dict[str, float]] = {}
    for pdbs in sizes:
        cfg = common.load([common.BASE, *args.overrides, f"per_device_batch_size={pdbs}"])
        pipeline[pdbs] = measure(cfg, mesh_lib.build(cfg), args.batches)
        print(f"pipeline pdbs={pdbs}: {pipeline[pdbs]['tokens_per_s']:,.0f} tokens/s", flush=True)
    runners, seconds_of = step_seconds(
        {p: [common.BASE, *args.overrides, f"per_device_batch_size={p}"] for p in sizes}, args.steps, args.rounds)
    step_cfgs = {p: runners[p].cfg for p in sizes}
    c = step_cfgs[sizes[0]]
    print(f"model (base.yml): emb {c.emb_dim}, {c.num_layers} layers, {c.num_heads} heads, mlp {c.mlp_dim}, vocab "
          f"{c.vocab_size}; mesh " + mesh_lib.describe(mesh_lib.build(c))
          + f"; {os.cpu_count()} cores")
    print("| per_device_batch_size | global batch | pipeline tokens/s | step ms | step tokens/s | pipeline / step |")
    print("|---:|---|---:|---:|---:|---:|")
    for pdbs in sizes:
        cfg, seconds = step_cfgs[pdbs], seconds_of[pdbs]
        step_tps = runners[pdbs].tokens_per_step / seconds
        pipe_tps = pipeline[pdbs]["tokens_per_s"]
        print(f"| {pdbs} | {cfg.global_batch_size} x {cfg.max_target_length} | {pipe_tps:,.0f} | {seconds * 1e3:.0f} | "
              f"{step_tps:,.0f} | {pipe_tps / step_tps:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
