"""What recording metrics every step costs the training loop: metrics on (as train.py does it) vs off, 8 CPU devices.

    python benchmarks/metrics_overhead.py [--steps 10] [--rounds 5] [key=value ...]

"on" is train.py's loop at its most talkative, log_period=1: every step's metrics are pushed to `DeferredMetrics`
(step N is fetched to the host after step N+1 is dispatched), and `StepLogger` prints a line and has
`MetricsWriter` write a JSON line and the TensorBoard scalars of every step (into a temporary directory; the
console lines go to /dev/null). "off" dispatches the same steps with no fetch at all and waits on the state once
at the end. Both reuse the same four synthetic batches and the small model of `layouts.py` with fsdp=8. Rounds
alternate on, off, on, off, ... in one process so the drift of a shared machine hits both alike; each figure is
the median over rounds of (round time / steps).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

import common  # noqa: F401  (first: 8 simulated CPU devices before any device query)
import jax
from layouts import LAYOUTS, Runner, layout_argv

from maxshard.observe import metrics
from maxshard.observe.console import StepLogger


class MetricsRun:
    """The train.py loop body with metrics on: push every step, log (print + JSONL + TensorBoard) every step."""

    def __init__(self, runner: Runner, out_dir: str) -> None:
        self.runner = runner
        self.cfg = dataclasses.replace(
            runner.cfg, log_period=1, steps=10**9, enable_tensorboard=True, run_dir=out_dir,
            tensorboard_dir=os.path.join(out_dir, "tensorboard"),
        )  # fmt: skip
        self.writer = metrics.MetricsWriter.from_config(self.cfg, is_primary=True)
        self.log = StepLogger(self.cfg, self.writer)
        self.step = 0

    def run(self, steps: int) -> float:
        r, deferred = self.runner, metrics.DeferredMetrics()
        self.log.restart()  # the time since the last round (spent in "off") is not step time
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            start = time.perf_counter()
            for _ in range(steps):
                r.state, step_metrics = r.step_fn(r.state, r.batches[r.calls % len(r.batches)])
                r.calls += 1
                self.log(deferred.push(self.step, step_metrics))
                self.step += 1
            self.log(deferred.flush())
            return (time.perf_counter() - start) / steps


def run_off(runner: Runner, steps: int) -> float:
    """Same steps, nothing fetched: the host only dispatches, then waits on the state once."""
    start = time.perf_counter()
    for _ in range(steps):
        runner.state, _ = runner.step_fn(runner.state, runner.batches[runner.calls % len(runner.batches)])
        runner.calls += 1
    jax.block_until_ready(runner.state)
    return (time.perf_counter() - start) / steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median is reported)")
    args = parser.parse_args(argv)
    runner = Runner(layout_argv(LAYOUTS["fsdp8"], args.overrides))
    cfg = runner.cfg
    with tempfile.TemporaryDirectory() as out_dir:
        on = MetricsRun(runner, out_dir)
        run_off(runner, 1)  # compile
        on.run(3)  # warm up both paths (first StepLogger call is its "compile" record)
        run_off(runner, 3)
        print(
            f"model: emb {cfg.emb_dim}, {cfg.num_layers} layers, mlp {cfg.mlp_dim}, vocab {cfg.vocab_size}; batch "
            f"{cfg.global_batch_size} x {cfg.max_target_length}; fsdp=8 on 8 CPU devices; {args.rounds} rounds x "
            f"{args.steps} steps; {os.cpu_count()} cores",
            flush=True,
        )
        times: dict[str, list[float]] = {"on": [], "off": []}
        for r in range(args.rounds):
            times["on"].append(on.run(args.steps))
            times["off"].append(run_off(runner, args.steps))
            print(f"round {r + 1}/{args.rounds}: on {times['on'][-1] * 1e3:.1f} ms, "
                  f"off {times['off'][-1] * 1e3:.1f} ms", flush=True)
        on.writer.close()
        lines = sum(1 for _ in open(os.path.join(out_dir, metrics.METRICS_FILE)))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"({lines} JSON lines and their TensorBoard scalars written)")
    print("| metrics | what the loop does per step | median step ms | tokens/s |")
    print("|---|---|---:|---:|")
    tokens = runner.tokens_per_step
    print(f"| on | push + fetch previous step, print, JSONL + TensorBoard (log_period=1) | {med['on'] * 1e3:.1f} | "
          f"{tokens / med['on']:,.0f} |")
    print(f"| off | dispatch only; one block_until_ready at the end | {med['off'] * 1e3:.1f} | "
          f"{tokens / med['off']:,.0f} |")
    print(f"\nratio on/off: {med['on'] / med['off']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
