"""Steady-state tokens/s of one small model under each parallel layout of tests/test_parity.py, 8 CPU devices.

    python benchmarks/layouts.py [--steps 8] [--rounds 3] [key=value ...]

Why in one process and interleaved: the machine is shared, so its speed drifts by tens of percent over a minute.
Every layout is compiled and warmed up first; then `--rounds` rounds each time `--steps` steps of every layout in
turn, and a layout's figure is the median of its rounds. A drift then hits all layouts alike, and the ratios
between them are what this benchmark is for. On simulated CPU devices the "collectives" are memory copies
inside one process, so the numbers rank layouts by the work and copies they add, not by network cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import jax

from maxshard import data
from maxshard.parallel import mesh
from maxshard.training.step import Trainer

# The layouts of tests/test_parity.py; every other ici knob is pinned to 1 (base.yml fills fsdp with -1).
LAYOUTS: dict[str, tuple[str, ...]] = {
    "dp8": ("ici_data_parallelism=8",),
    "fsdp8": ("ici_fsdp_parallelism=8",),
    "tp8": ("ici_tensor_parallelism=8",),
    "fsdp4xtp2": ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
    "2x2x2": ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    "seq2xfsdp4": ("ici_sequence_parallelism=2", "ici_fsdp_parallelism=4"),
    "fsdpT2xfsdp4": ("ici_fsdp_transpose_parallelism=2", "ici_fsdp_parallelism=4"),
    "expert2xfsdp4": ("ici_expert_parallelism=2", "ici_fsdp_parallelism=4"),
}


def layout_argv(layout: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """base.yml + the small model (8 heads, so tensor=8 divides them) + the layout, fsdp pinned to 1 unless set."""
    pin = () if any(k.startswith("ici_fsdp_parallelism=") for k in layout) else ("ici_fsdp_parallelism=1",)
    return [common.BASE, *common.SMALL_MODEL, *extra, *layout, *pin]


class Runner:
    """One layout's trainer, state and batches, ready to step; `run(n)` returns seconds per step."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.cfg = common.load(argv)
        trainer = Trainer(self.cfg, mesh.build(self.cfg))
        self.step_fn = trainer.jit_train_step(data.batch_sharding(self.cfg, trainer.mesh))
        self.state = trainer.init_state()
        batches = data.make_input(self.cfg, trainer.mesh)
        self.batches = [next(batches) for _ in range(4)]  # reused: data loading is not what is measured
        self.calls = 0

    def run(self, steps: int) -> float:
        """Seconds per step over `steps` steps, waiting for the last one (steps run back to back, as in training)."""
        start = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.step_fn(self.state, self.batches[self.calls % len(self.batches)])
            self.calls += 1
        jax.block_until_ready((self.state, metrics))
        return (time.perf_counter() - start) / steps

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.global_batch_size * self.cfg.max_target_length


def interleaved(runners: dict[str, Runner], steps: int, rounds: int, log: Callable[[str], None]) -> dict[str, float]:
    """Median seconds per step of each runner over `rounds` rounds, every round visiting every runner once."""
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(rounds):
        for name, runner in runners.items():
            times[name].append(runner.run(steps))
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {t[-1] * 1e3:.0f} ms" for n, t in times.items()))
    return {name: statistics.median(t) for name, t in times.items()}


def format_table(runners: dict[str, Runner], seconds: dict[str, float], compile_s: dict[str, float]) -> str:
    """Markdown table, fastest layout = 1.00."""
    best = min(seconds.values())
    lines = [
        "| layout | mesh (non-1 axes) | first step s | step ms | tokens/s | tokens/s/device | vs fastest |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, runner in runners.items():
        s = seconds[name]
        tps = runner.tokens_per_step / s
        axes = mesh.describe(mesh.build(runner.cfg))
        lines.append(
            f"| {name} | {axes} | {compile_s[name]:.1f} | {s * 1e3:.0f} | {tps:,.0f} | {tps / 8:,.0f} | "
            f"{best / s:.2f} |"
        )
    return "\n".join(lines)


def build_all(names: Sequence[str], extra: Sequence[str]) -> tuple[dict[str, Runner], dict[str, float]]:
    """Runners for each layout plus the seconds of their first step (compilation + one step)."""
    runners: dict[str, Runner] = {}
    first: dict[str, float] = {}
    for name in names:
        runner = Runner(layout_argv(LAYOUTS[name], extra))
        first[name] = runner.run(1)
        runner.run(2)  # warm-up beyond the first call
        runners[name] = runner
        print(f"compiled {name}: first step {first[name]:.1f} s", flush=True)
    return runners, first


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every layout")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per layout per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median is reported)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ",".join(LAYOUTS))
    args = parser.parse_args(argv)
    runners, first = build_all(args.layouts.split(","), args.overrides)
    cfg = next(iter(runners.values())).cfg
    print(
        f"model: emb {cfg.emb_dim}, {cfg.num_layers} layers, {cfg.num_heads} heads x {cfg.head_dim}, mlp "
        f"{cfg.mlp_dim}; batch {cfg.global_batch_size} x {cfg.max_target_length}; {args.rounds} rounds x "
        f"{args.steps} steps; {os.cpu_count()} cores",
        flush=True,
    )
    seconds = interleaved(runners, args.steps, args.rounds, lambda line: print(line, flush=True))
    print(format_table(runners, seconds, first))
    return 0


if __name__ == "__main__":
    sys.exit(main())
