"""Loss of int8 and fp8 quantized training (`quantization`, through qwix) against the unquantized run.

    python benchmarks/quantization.py [--steps N] [--tail T] [--modes none,int8,fp8] [key=value ...]

Defaults: the 125m preset, 200 steps on the default corpus (the Python standard library, byte tokens) with
bfloat16 compute, on 8 simulated CPU devices: the acceptance check of issue #31 ("the 125m preset's loss after 200
CPU steps within 2% of bf16's"). Any config key can be overridden, e.g. `model_name=tiny` or no model_name for
base.yml's 1.15M model.

Every mode trains the same model from the same seed on the same batches. The table shows, per mode: the mean
training loss of the last `--tail` steps (the quantized forward), the eval loss of the final parameters run
*unquantized* (how generation uses them, on the same `eval_steps` batches for every mode), both as ratios to the
unquantized run, and the median step time (on CPU the 8-bit dots are emulated, so it says nothing about a TPU or
GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import jax
import numpy as np

from maxshard import data
from maxshard.config import Config
from maxshard.parallel import mesh
from maxshard.train import evaluate
from maxshard.training.step import Trainer

DEFAULTS = ("model_name=125m", "dtype=bfloat16", "eval_period=0", "enable_checkpointing=false",
            "enable_tensorboard=false", "per_device_batch_size=1")


@dataclasses.dataclass
class Result:
    mode: str
    losses: list[float]
    eval_loss: float
    step_times: list[float]


def train(cfg: Config) -> tuple[Trainer, object, list[float], list[float]]:
    """`cfg.steps` steps from a fresh state: (trainer, final state, loss per step, seconds per step)."""
    trainer = Trainer(cfg, mesh.build(cfg))
    step = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))
    state, batches = trainer.init_state(), data.make_input(cfg, trainer.mesh)
    losses, times = [], []
    for _ in range(cfg.steps):
        start = time.perf_counter()
        state, metrics = step(state, next(batches))
        losses.append(float(metrics["loss"]))  # waits for the step: the time is the step's own
        times.append(time.perf_counter() - start)
    return trainer, state, losses, times


def run(mode: str, overrides: Sequence[str], steps: int) -> Result:
    cfg = common.load([common.BASE, *overrides, f"steps={steps}", f"quantization={mode}"])
    trainer, state, losses, times = train(cfg)
    plain = Trainer(common.load([common.BASE, *overrides, f"steps={steps}"]), trainer.mesh)  # unquantized eval
    eval_loss = evaluate(plain.cfg, plain, state.params, plain.jit_eval_step(data.batch_sharding(cfg, plain.mesh)))
    print(f"{mode}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, eval (unquantized) {eval_loss:.4f}", flush=True)
    return Result(mode, losses, eval_loss, times[1:])  # the first step compiles


def table(results: list[Result], tail: int) -> str:
    base = results[0]
    base_train = float(np.mean(base.losses[-tail:]))
    head = (f"{'quantization':>12} {f'train loss (last {tail})':>22} {'ratio':>7} {'eval loss':>10} {'ratio':>7} "
            f"{'s/step':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        train_loss = float(np.mean(r.losses[-tail:]))
        lines.append(f"{r.mode:>12} {train_loss:>22.4f} {train_loss / base_train:>7.4f} {r.eval_loss:>10.4f} "
                     f"{r.eval_loss / base.eval_loss:>7.4f} {float(np.median(r.step_times)):>7.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per mode")
    parser.add_argument("--tail", type=int, default=20, help="the training loss is the mean of the last TAIL steps")
    parser.add_argument("--modes", default="none,int8,fp8", help="comma-separated; the first is the reference")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = parser.parse_args()
    overrides = list({item.split("=", 1)[0]: item for item in (*DEFAULTS, *args.overrides)}.values())  # later wins
    results = [run(mode, overrides, args.steps) for mode in args.modes.split(",")]
    print(f"quantized training, {args.steps} steps: {' '.join(overrides)}")
    print(table(results, args.tail))


if __name__ == "__main__":
    main()
