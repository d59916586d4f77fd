"""The entry point: `python -m maxshard.train configs/base.yml key=value ...`.

`main` reads like a table of contents: load the run, build the mesh and the sharded state, then loop over steps.
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

from maxshard import cli, data, rewards
from maxshard.checkpoint import emergency
from maxshard.checkpoint import manager as checkpoint
from maxshard.config import Config
from maxshard.data import chat, preflight
from maxshard.generation import reward_model, rollouts
from maxshard.errors import ConfigError
from maxshard.evaluation.in_training import TaskEvaluation
from maxshard.model import trainable
from maxshard.objectives import kinds as objective_kinds
from maxshard.model.transformer import count_params
from maxshard.observe import console, goodput, metrics
from maxshard.observe.profiling import Profiler
from maxshard.observe.report import Report, build_report
from maxshard.parallel import mesh
from maxshard.run import compile_check, loading, lock, stand_ins
from maxshard.training import precomputed
from maxshard.training.step import Trainer, TrainState

__all__ = ["main", "run", "USAGE"]

USAGE = """usage: python -m maxshard.train CONFIG.yml [key=value ...]

Trains the model CONFIG.yml describes; any key of configs/base.yml (every key is listed there with a one-line
comment) can be overridden as key=value, e.g. `model_name=tiny steps=100 cpu_device_count=8`.
Outputs go to base_output_directory/run_name/; running the same command again resumes the run.

Other entry points:
  python -m maxshard.launch xpk ...       submit the same config to a GKE cluster through XPK
  python -m maxshard.plan CONFIG.yml ...      plan memory and step time for a target topology
  python -m maxshard.eval CONFIG.yml tasks=...  score the run on lm-eval-harness tasks
  python tools/sharding_report.py ...      show how every parameter is laid out on the mesh"""


def check_layout(cfg: Config, trainer: Trainer) -> Report:
    """Builds the layout report; warns (or fails with check_sharding) when too many parameter bytes are replicated."""
    report = build_report(cfg, dict(trainer.mesh.shape), trainer.rules, trainer.abstract_state)
    if report.replicated_fraction > cfg.max_replicated_fraction:
        message = (
            f"{report.replicated_fraction:.1%} of parameter bytes are replicated on every device "
            f"(max_replicated_fraction={cfg.max_replicated_fraction}); shard them with fsdp or tensor parallelism"
        )
        if cfg.check_sharding:
            raise ConfigError(message)
        warnings.warn(message, stacklevel=1)
    return report


def evaluate(cfg: Config, trainer: Trainer, state: TrainState, eval_step: Any) -> float:
    """Mean loss over `eval_steps` batches of the eval split (the same batches every time)."""
    batches = data.make_input(cfg, trainer.mesh, "eval")
    loss_sum, weight_sum = 0.0, 0.0
    for _ in range(cfg.eval_steps):
        out = eval_step(state.params, next(batches), state.reference)
        loss_sum += float(out["loss_sum"])
        weight_sum += float(out["weight_sum"])
    return loss_sum / max(weight_sum, 1.0)


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


def start(cfg: Config, trainer: Trainer, ckpt: checkpoint.Checkpoints, clock: goodput.Recorder
          ) -> tuple[TrainState, data.InputIterator]:
    """The state to train from (resumed, seeded or fresh) and the train batches, positioned where it left off."""
    began = time.perf_counter()
    state, data_state = ckpt.restore_or_init()
    if data_state is not None:  # a resume: the read counts as checkpoint_restore, a fresh init as initialization
        clock.phase("checkpoint_restore", time.perf_counter() - began)
    batches = train_input(cfg, trainer, state)
    if data_state is not None:
        batches.set_state(data_state)
    return state, batches


def train_input(cfg: Config, trainer: Trainer, state: TrainState) -> Any:
    """The train batches: the data pipeline's (with a precomputed reference beside them, scored first from the
    starting parameters if not yet stored), or GRPO's rollouts sampled from the state being trained."""
    sharding = data.batch_sharding(cfg, trainer.mesh)
    if objective_kinds.kind(cfg.objective).samples:
        return rollouts.Rollouts(cfg, trainer, sharding)
    if trainer.reference_kind == "precomputed":
        precomputed.ensure(cfg, trainer, state.params, int(state.step))
        return precomputed.WithReference(cfg, data.make_input(cfg, trainer.mesh, "train"), sharding)
    return data.make_input(cfg, trainer.mesh, "train")


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


def compiled_step(trainer: Trainer, writer: metrics.MetricsWriter) -> compile_check.CompiledStep:
    """The train step compiled before the first step; XLA's peak per device confirms the remat policy or replaces
    it (`compile_check`). Printed and recorded (`memory/compiled_peak_bytes` at step 0)."""
    compiled = compile_check.compile_step(trainer, data.batch_sharding(trainer.cfg, trainer.mesh))
    print(compiled.line(), flush=True)
    if compiled.peak_bytes is not None:
        writer.write(0, {"memory/compiled_peak_bytes": compiled.peak_bytes})
    return compiled


def train_loop(
    compiled: compile_check.CompiledStep,
    state: TrainState,
    batches: data.InputIterator,
    writer: metrics.MetricsWriter,
    ckpt: checkpoint.Checkpoints,
    sigterm: threading.Event,
    clock: goodput.Recorder,
    task_eval: TaskEvaluation | None = None,
) -> TrainState:
    """Runs steps `state.step .. cfg.steps - 1`; metrics are fetched one step late so the device never waits."""
    trainer, train_step = compiled.trainer, compiled.step
    cfg = trainer.cfg
    batch_sharding = data.batch_sharding(cfg, trainer.mesh)
    # No eval for sampled batches (GRPO) nor for a reference stored for the train batches only
    no_eval = objective_kinds.kind(cfg.objective).samples or trainer.reference_kind == "precomputed"
    eval_step = trainer.jit_eval_step(batch_sharding) if cfg.eval_period and not no_eval else None
    profiler = Profiler.from_config(cfg, is_primary=jax.process_index() == 0)

    # Data counters are the run's: every process sees every row (data/pipeline.py), or counts the global rows (store.py)
    deferred, log = metrics.DeferredMetrics(), console.StepLogger(cfg, writer, compiled.seconds)
    first = int(state.step)
    for step in range(first, cfg.steps):
        began = time.perf_counter()  # the iteration's time, less its waits for data and saves, is the step's
        with profiler.step(step):
            batch = rollouts.next_batch(batches, state)
            data_wait = time.perf_counter() - began
            state, step_metrics = train_step(state, batch)
        # the input's counters as this step read them (GRPO: this rollout's rewards), fetched with its metrics
        log(deferred.push(step, {**step_metrics, **batches.stats()}))
        rollouts.show_samples(batches, step + 1, cfg.log_period)
        evaluates = eval_step is not None and (step + 1) % cfg.eval_period == 0
        if step == first or evaluates or step + 1 == cfg.steps or ckpt.due(step + 1, False):
            # Dispatch returns at once: where a wait follows anyway (the first step's compile, an evaluation, a
            # save, the end), wait here, so that the step's compute is counted as the step's.
            jax.block_until_ready(state)
        eval_began = time.perf_counter()
        if evaluates:
            log(deferred.flush())
            eval_loss = evaluate(cfg, trainer, state, eval_step)
            writer.write(step + 1, {"eval_loss": eval_loss})
            print(f"eval at step {step + 1}: loss {eval_loss:.4f}", flush=True)
            log.restart()
        if task_eval is not None and task_eval.due(step + 1):
            log(deferred.flush())
            writer.write(step + 1, task_eval(state.params, step + 1))
            log.restart()
        save_began = time.perf_counter()
        stop = end_of_step(step + 1, state, batches, ckpt, sigterm)
        # The step's own time ends where evaluation begins (goodput counts evaluation as other).
        clock.step(step + 1, eval_began - began - data_wait, data_wait, time.perf_counter() - save_began)
        if stop:
            break
    log(deferred.flush())
    profiler.close()
    return state


def run(argv: Sequence[str]) -> int:
    started = time.time()  # goodput's wall time of this start begins here
    cfg = loading.load_run(argv, join_processes=True, resume=True)
    preflight.check(cfg)  # the inputs, before the model is built
    if objective_kinds.kind(cfg.objective).samples:
        if reward_model.is_model_reward(cfg):  # and the reward that scores them (imported once per process)
            reward_model.check(cfg)
        else:
            rewards.load_reward(cfg)
        if cfg.grpo_environment:  # a multi-turn run's environment, as its reward
            rewards.load_function(cfg.grpo_environment, "grpo_environment")
    run_lock = lock.hold(cfg.run_dir, jax.process_index() == 0, jax.process_count())  # before anything is written
    try:
        return train(cfg, started)
    finally:
        if run_lock is not None:
            run_lock.release()


def train(cfg: Config, started: float) -> int:
    """Builds the model and trains it; `started` is when this start began (goodput's wall time)."""
    trainer = Trainer(cfg, mesh.build(cfg))
    report = check_layout(cfg, trainer)
    task_eval = TaskEvaluation.from_config(cfg, trainer)  # unknown tasks fail here, before anything compiles
    params = trainer.abstract_state.params
    figures = console.startup_figures(cfg, dict(trainer.mesh.shape), count_params(params), report,
                                      count_params(trainable.trainable_subset(params, cfg.model)))
    figures["chat_template"] = chat.describe(cfg)  # None unless the run reads chat sources
    # Exits run inner first: the last save is committed, then metrics are flushed, then SIGTERM is given back.
    with (
        catch_sigterm() as sigterm,
        metrics.MetricsWriter.from_config(cfg, is_primary=jax.process_index() == 0) as writer,
        goodput.Recorder(cfg.run_dir, jax.process_index() == 0, started) as clock,
        emergency.open_checkpoints(cfg, trainer) as ckpt,
    ):
        console.print_startup(figures, writer)
        for line in stand_ins.stand_ins(cfg):  # what this CPU run computes in place of an accelerator's op
            print(line, flush=True)
        writer.write_config(cfg)
        state, batches = start(cfg, trainer, ckpt, clock)
        if int(state.step) >= cfg.steps:
            print(f"run already complete: step {int(state.step)} of steps={cfg.steps}; nothing to do", flush=True)
            return 0
        compiled = compiled_step(trainer, writer)
        clock.phase("compile", compiled.seconds)
        clock.phase("initialization", time.time() - started - clock.recorded())
        state = train_loop(compiled, state, batches, writer, ckpt, sigterm, clock, task_eval)
        report_goodput(int(state.step), ckpt, clock, writer)
    return 0


def report_goodput(step: int, ckpt: checkpoint.Checkpoints, clock: goodput.Recorder,
                   writer: metrics.MetricsWriter) -> None:
    """The run's goodput over all its starts so far: one console line, and scalars in metrics.jsonl/TensorBoard."""
    began = time.perf_counter()
    ckpt.wait()  # the last save's commit is part of the run's checkpoint time
    clock.phase("checkpoint_save", time.perf_counter() - began)
    try:
        summary = clock.end()
    except (OSError, ValueError, KeyError, TypeError) as e:  # an unreadable log: the training itself succeeded
        print(f"goodput: not reported, its log ({goodput.LOG_FILE} in the run directory) could not be read: {e}",
              flush=True)
        return
    if summary:
        print(goodput.format_summary(summary), flush=True)
        warning = goodput.warning(summary)
        if warning:
            print(warning, flush=True)
        writer.write(step, goodput.metrics(summary))


def main(argv: Sequence[str] | None = None) -> int:
    return cli.entry(argv, USAGE, run)


if __name__ == "__main__":
    sys.exit(main())
