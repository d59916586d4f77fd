"""The entry point: `python -m maxshard.train configs/base.yml key=value ...`.

`main` reads like a table of contents: configure, build the mesh and the sharded state, then loop over steps.
Every user mistake surfaces as one line and exit code 2, before anything is compiled.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax

from maxshard import config, data, mesh, model
from maxshard.config import Config, ConfigError
from maxshard.data.tokenizer import resolve_vocab
from maxshard.report import build_report, human_bytes
from maxshard.step import Trainer, TrainState

__all__ = ["main", "setup"]


def setup(argv: Sequence[str]) -> Config:
    """Parses the config, applies device simulation, derives device-dependent values and the vocabulary."""
    return resolve_vocab(config.load(argv))


def check_layout(cfg: Config, trainer: Trainer) -> Any:
    """Builds the layout report; warns (or fails with check_sharding) when too many parameter bytes are replicated."""
    report = build_report(cfg, dict(trainer.mesh.shape), trainer.rules)
    if report.replicated_fraction > cfg.max_replicated_fraction:
        message = (
            f"{report.replicated_fraction:.1%} of parameter bytes are replicated on every device "
            f"(max_replicated_fraction={cfg.max_replicated_fraction}); shard them with fsdp or tensor parallelism"
        )
        if cfg.check_sharding:
            raise ConfigError(message)
        warnings.warn(message, stacklevel=1)
    return report


def print_startup(cfg: Config, trainer: Trainer, report: Any) -> None:
    params = model.param_count(cfg)
    total = report.param_bytes_per_device + report.optimizer_bytes_per_device + report.gradient_bytes_per_device
    print(f"mesh: {mesh.describe(trainer.mesh)} over {cfg.num_devices} devices ({cfg.device_kind})")
    print(f"model: {params / 1e6:.2f}M parameters, {model.flops_per_token(cfg) / 1e6:.1f} MFLOP per token")
    print(
        f"memory per device: params {human_bytes(report.param_bytes_per_device)}, optimizer "
        f"{human_bytes(report.optimizer_bytes_per_device)}, gradients {human_bytes(report.gradient_bytes_per_device)}"
        f" (total {human_bytes(total)})"
    )
    print(f"batch: {cfg.global_batch_size} x {cfg.max_target_length} tokens, {cfg.steps} steps", flush=True)


def evaluate(cfg: Config, trainer: Trainer, params: Any, eval_step: Any) -> float:
    """Mean loss over `eval_steps` batches of the eval split (the same batches every time)."""
    batches = data.make_input(cfg, trainer.mesh, "eval")
    loss_sum, weight_sum = 0.0, 0.0
    for _ in range(cfg.eval_steps):
        out = eval_step(params, next(batches))
        loss_sum += float(out["loss_sum"])
        weight_sum += float(out["weight_sum"])
    return loss_sum / max(weight_sum, 1.0)


def train_loop(cfg: Config, trainer: Trainer, state: TrainState) -> TrainState:
    """Runs steps `state.step .. cfg.steps - 1`, logging every `log_period` steps."""
    batch_sharding = data.batch_sharding(cfg, trainer.mesh)
    train_step = trainer.jit_train_step(batch_sharding)
    eval_step = trainer.jit_eval_step(batch_sharding) if cfg.eval_period else None
    batches = data.make_input(cfg, trainer.mesh, "train")
    tokens_per_step = cfg.global_batch_size * cfg.max_target_length
    flops_per_step = model.flops_per_token(cfg) * tokens_per_step
    start = int(state.step)
    last_time, last_step = time.perf_counter(), start
    for step in range(start, cfg.steps):
        state, metrics = train_step(state, next(batches))
        if (step + 1) % cfg.log_period == 0 or step + 1 == cfg.steps:
            loss = float(metrics["loss"])  # blocks until this step is done
            now = time.perf_counter()
            step_time = (now - last_time) / (step + 1 - last_step)  # the first interval includes compilation
            last_time, last_step = now, step + 1
            tokens_per_sec = tokens_per_step / step_time / cfg.num_devices
            tflops = flops_per_step / step_time / cfg.num_devices / 1e12
            print(
                f"step {step + 1}/{cfg.steps} | loss {loss:.4f} | {step_time:.3f} s/step | "
                f"{tokens_per_sec:,.0f} tok/s/dev | {tflops:.3f} TFLOP/s/dev",
                flush=True,
            )
        if eval_step is not None and (step + 1) % cfg.eval_period == 0:
            print(f"eval step {step + 1}: loss {evaluate(cfg, trainer, state.params, eval_step):.4f}", flush=True)
    return state


def run(argv: Sequence[str]) -> int:
    cfg = setup(argv)
    trainer = Trainer(cfg, mesh.build(cfg))
    report = check_layout(cfg, trainer)
    print_startup(cfg, trainer, report)
    state = trainer.init_state()
    train_loop(cfg, trainer, state)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except ConfigError as e:
        print(f"maxshard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
