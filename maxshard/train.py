"""The entry point: `python -m maxshard.train configs/base.yml key=value ...`.

`main` reads like a table of contents: configure, build the mesh and the sharded state, then loop over steps.
Every user mistake surfaces as one line and exit code 2, before anything is compiled.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from maxshard import checkpoint, config, data, mesh, metrics, model, perf
from maxshard.config import Config, ConfigError
from maxshard.data.tokenizer import resolve_vocab
from maxshard.launch import distributed
from maxshard.layers import pipeline
from maxshard.profiling import Profiler
from maxshard.report import build_report
from maxshard.step import Trainer, TrainState

__all__ = ["main", "setup"]


def setup(argv: Sequence[str]) -> Config:
    """Parses the config, joins the other processes (multi-host), then derives device-dependent values."""
    distributed.initialize(config.parse(argv))  # must precede every device query
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
    """The mesh, the model size and the per-device memory estimate, before anything compiles."""
    per_device = {
        "params": report.param_bytes_per_device,
        "opt_state": report.optimizer_bytes_per_device,
        "grads": report.gradient_bytes_per_device,
    }
    summary = metrics.format_startup_summary(
        dict(trainer.mesh.shape), model.param_count(cfg), per_device, cfg.device_kind, perf.peak_flops(cfg.device_kind)
    )
    print(summary)
    shape = pipeline.validate_pipeline(cfg)
    if shape is not None:
        print(
            f"pipeline: {shape.stages} stages x {shape.repeats} repeats x {shape.layers_per_stage} layers, "
            f"{shape.microbatches} microbatches, bubble fraction {shape.bubble_fraction:.3f}"
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


class StepLogger:
    """Turns each finished step's values into throughput figures; prints and records every `log_period` steps.

    Step time is measured between the ends of two steps, so the first step (which includes compilation) is logged
    with its loss and a `compile_time` (time from the loop's start to its end) but no throughput.
    """

    def __init__(self, cfg: Config, writer: metrics.MetricsWriter) -> None:
        self.cfg, self.writer = cfg, writer
        self.tokens_per_step = cfg.global_batch_size * cfg.max_target_length
        self.flops_per_step = model.flops_per_token(cfg) * self.tokens_per_step
        self.peak = perf.peak_flops(cfg.device_kind)
        bubble = pipeline.bubble_fraction(cfg)
        self.constants = {"pipeline/bubble_fraction": bubble} if bubble else {}
        self.started = time.perf_counter()
        self.compiled = False
        self.reference: metrics.StepValues | None = None  # timing reference: the last logged (or first) step

    def restart(self) -> None:
        """Forget the timing reference, e.g. after an evaluation that would otherwise count as step time."""
        self.reference = None

    def __call__(self, done: metrics.StepValues | None) -> None:
        if done is None:
            return
        step = done.step + 1  # steps are counted from 1 in logs
        if not self.compiled:
            self.compiled = True
            self.reference = done
            self._write(step, {**done.values, "compile_time": done.ready_time - self.started}, None)
            return
        if self.reference is None:
            self.reference = done
            return
        if step % self.cfg.log_period and step != self.cfg.steps:
            return
        step_time = (done.ready_time - self.reference.ready_time) / (done.step - self.reference.step)
        self.reference = done
        self._write(step, dict(done.values), step_time)

    def _write(self, step: int, record: dict[str, Any], step_time: float | None) -> None:
        if step_time is None:
            self.writer.write(step, record)
            line = f"step {step}/{self.cfg.steps} | loss {record['loss']:.3f} | compiled and ran in "
            print(line + f"{record['compile_time']:.1f}s", flush=True)
            return
        figures = perf.step_perf(self.tokens_per_step, self.flops_per_step, step_time, self.cfg.num_devices, self.peak)
        record.update({"step_time": step_time, **figures, **self.constants, **(metrics.memory_stats() or {})})
        self.writer.write(step, record)
        eta = (self.cfg.steps - step) * step_time
        progress = metrics.format_progress(
            step, self.cfg.steps, record["loss"], step_time, figures["tokens_per_sec_per_device"], figures["mfu"],
            eta, tflops=figures["tflops_per_device"],
        )
        if "moe_dropped_fraction" in record:
            progress += f" | dropped {record['moe_dropped_fraction']:.1%} | expert load max {record['moe_expert_load_max']:.2f}"
        print(progress, flush=True)


@contextlib.contextmanager
def catch_sigterm() -> Iterator[threading.Event]:
    """SIGTERM (GKE's preemption notice) sets an event instead of killing: the loop saves and exits 0.

    With several processes JAX's own preemption notifier holds SIGTERM and agrees on the stop step
    (`checkpoint.preemption_reached`); a Python handler would replace it, so none is installed there.
    """
    event = threading.Event()
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
        yield event
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: event.set())
    try:
        yield event
    finally:
        signal.signal(signal.SIGTERM, previous)


def start(cfg: Config, trainer: Trainer, ckpt: checkpoint.Checkpoints) -> tuple[TrainState, data.InputIterator]:
    """The state to train from (resumed, seeded or fresh) and the train batches, positioned where it left off."""
    state, data_state = ckpt.restore_or_init()
    batches = data.make_input(cfg, trainer.mesh, "train")
    if data_state is not None:
        batches.set_state(data_state)
    return state, batches


def end_of_step(
    step: int, state: TrainState, batches: data.InputIterator, ckpt: checkpoint.Checkpoints, sigterm: threading.Event
) -> bool:
    """Saves when due after `step` steps; True when a preemption notice says to stop here."""
    ckpt.raise_if_save_failed()
    preempted = checkpoint.preemption_reached(step, sigterm)
    if ckpt.due(step, preempted):
        ckpt.save(step, state, batches.get_state())
    if preempted:
        ckpt.wait()
        saved = "saved" if ckpt.manager is not None else "not saved (enable_checkpointing is off)"
        print(f"preempted: stopping after step {step}, checkpoint {saved}", flush=True)
    return preempted


def train_loop(
    cfg: Config,
    trainer: Trainer,
    state: TrainState,
    batches: data.InputIterator,
    writer: metrics.MetricsWriter,
    ckpt: checkpoint.Checkpoints,
    sigterm: threading.Event,
) -> TrainState:
    """Runs steps `state.step .. cfg.steps - 1`; metrics are fetched one step late so the device never waits."""
    batch_sharding = data.batch_sharding(cfg, trainer.mesh)
    train_step = trainer.jit_train_step(batch_sharding)
    eval_step = trainer.jit_eval_step(batch_sharding) if cfg.eval_period else None
    profiler = Profiler.from_config(cfg, is_primary=jax.process_index() == 0)
    deferred, log = metrics.DeferredMetrics(), StepLogger(cfg, writer)
    for step in range(int(state.step), cfg.steps):
        with profiler.step(step):
            state, step_metrics = train_step(state, next(batches))
        log(deferred.push(step, step_metrics))
        if eval_step is not None and (step + 1) % cfg.eval_period == 0:
            log(deferred.flush())
            eval_loss = evaluate(cfg, trainer, state.params, eval_step)
            writer.write(step + 1, {"eval_loss": eval_loss})
            print(f"eval at step {step + 1}: loss {eval_loss:.4f}", flush=True)
            log.restart()
        if end_of_step(step + 1, state, batches, ckpt, sigterm):
            break
    log(deferred.flush())
    profiler.close()
    return state


def run(argv: Sequence[str]) -> int:
    cfg = setup(argv)
    trainer = Trainer(cfg, mesh.build(cfg))
    report = check_layout(cfg, trainer)
    print_startup(cfg, trainer, report)
    # Exits run inner first: the last save is committed, then metrics are flushed, then SIGTERM is given back.
    with (
        catch_sigterm() as sigterm,
        metrics.MetricsWriter.from_config(cfg, is_primary=jax.process_index() == 0) as writer,
        checkpoint.Checkpoints(cfg, trainer) as ckpt,
    ):
        writer.write_config(cfg)
        state, batches = start(cfg, trainer, ckpt)
        if int(state.step) >= cfg.steps:
            print(f"run already complete: step {int(state.step)} of steps={cfg.steps}; nothing to do", flush=True)
            return 0
        train_loop(cfg, trainer, state, batches, writer, ckpt, sigterm)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except ConfigError as e:
        print(f"maxshard: error: {e}", file=sys.stderr)
        return 2
    except checkpoint.CheckpointError as e:  # a failed save, or a checkpoint unreadable for a reason other than damage
        print(f"maxshard: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
