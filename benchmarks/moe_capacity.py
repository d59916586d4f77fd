"""Step time and dropped share of token assignments vs `capacity_factor` for a small MoE.

    python benchmarks/moe_capacity.py [--steps N] [--rounds R] [key=value ...]

Runs on 8 simulated CPU devices with expert=4 x fsdp=2 by default (any config key can be overridden). For each
capacity factor in {1.0, 1.25, 2.0, dropless} it builds the model, compiles and warms up; then the factors take
turns for `--rounds` rounds of `--steps` timed steps (so load from other processes hits them alike), and the
table shows the median step time and the mean of the metrics the train step reports.

Capacity trades work for drops: each expert processes C = ceil(length * k / experts * factor) slots per sequence
whether they are filled or not, and the dropless path computes every expert on every token (experts / k times the
expert FLOPs of top-k).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import jax
import numpy as np

from maxshard import config, data
from maxshard.model.layers import moe
from maxshard.parallel import mesh
from maxshard.training.step import Trainer

MODEL = (
    *common.STEP_ONLY, "emb_dim=128", "num_layers=4", "num_heads=4", "num_kv_heads=4", "head_dim=32",
    "mlp_dim=256", "max_target_length=128", "num_experts=8", "num_experts_per_tok=2", "moe_layer_interval=1",
    "per_device_batch_size=2", "enable_tensorboard=false",
)  # fmt: skip
LAYOUT = ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2")
FACTORS = (("1.0", 1.0), ("1.25", 1.25), ("2.0", 2.0), ("dropless", -1.0))


@dataclasses.dataclass
class Run:
    """One capacity factor, compiled and warmed up; `times` and `metrics` grow with every timed round."""

    name: str
    cfg: config.Config
    step: Callable[..., Any]
    state: Any
    batches: Iterator[Any]
    times: list[float] = dataclasses.field(default_factory=list)
    metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)


def prepare(name: str, overrides: Sequence[str], factor: float, warmup: int) -> Run:
    cfg = common.load([common.BASE, *overrides, f"capacity_factor={factor}"])
    trainer = Trainer(cfg, mesh.build(cfg))
    run = Run(name, cfg, trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh)), trainer.init_state(),
              data.make_input(cfg, trainer.mesh))
    for _ in range(warmup):
        run.state, metrics = run.step(run.state, next(run.batches))
    jax.block_until_ready(metrics)
    return run


def time_round(run: Run, steps: int) -> None:
    """Times `steps` steps; records the mean step time of the round and every step's metrics."""
    start, history = time.perf_counter(), []
    for _ in range(steps):
        run.state, metrics = run.step(run.state, next(run.batches))
        history.append(metrics)
    history = jax.device_get(history)
    run.times.append((time.perf_counter() - start) / steps)
    run.metrics.extend({k: float(v) for k, v in m.items()} for m in history)


def summary(run: Run) -> dict[str, float]:
    """Median step time over rounds (robust to other load on the machine) and mean metrics over all steps."""
    cfg, factor = run.cfg, run.cfg.capacity_factor
    slots = cfg.max_target_length if factor <= 0 else moe.capacity(
        cfg.max_target_length, cfg.num_experts_per_tok, cfg.num_experts, factor)
    step_time = float(np.median(run.times))
    mean = {k: float(np.mean([m[k] for m in run.metrics])) for k in run.metrics[0]}
    tokens = cfg.global_batch_size * cfg.max_target_length
    return {"step_time": step_time, "slots": slots, "tokens_per_s": tokens / step_time, **mean}


def table(rows: list[tuple[str, dict[str, float]]]) -> str:
    head = (f"{'capacity_factor':>15} {'slots/expert':>12} {'step ms':>8} {'tok/s':>8} {'dropped':>8} "
            f"{'load max':>8} {'load cv':>8}")
    lines = [head, "-" * len(head)]
    for name, r in rows:
        lines.append(
            f"{name:>15} {r['slots']:>12d} {r['step_time'] * 1e3:>8.1f} {r['tokens_per_s']:>8.0f} "
            f"{r['moe/dropped_fraction']:>8.2%} {r['moe/expert_load_max']:>8.2f} {r['moe/expert_load_cv']:>8.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per capacity factor and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; factors take turns so load hits all alike")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = parser.parse_args()
    overrides = [*MODEL, *LAYOUT, *args.overrides]
    runs = [prepare(name, overrides, factor, args.warmup) for name, factor in FACTORS]
    for _ in range(args.rounds):
        for run in runs:
            time_round(run, args.steps)
    rows = [(run.name, summary(run)) for run in runs]
    print(f"MoE capacity sweep: {' '.join(overrides)}")
    print(table(rows))


if __name__ == "__main__":
    main()
