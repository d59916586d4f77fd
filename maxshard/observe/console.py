"""What a training run shows a person and records for tools: the startup summary and the per-step log.

The startup figures (mesh, parameter count, per-device memory, pipeline, batch) are printed once and written as the
first record of `metrics.jsonl` (`{"step": 0, "startup": {...}}`), so sweeps and tools read them instead of
parsing console text. `StepLogger` turns each finished step into throughput figures, prints the progress line and
writes the record every `log_period` steps; where the input's count of skipped bad records grew since the last line,
a second line says how many, their share of the records read and the first few (`format_skipped`). Number formats
live in `maxshard/units.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from maxshard.config import Config
from maxshard.data import bad_records
from maxshard.model import quantization
from maxshard.spec import pipeline_schedule
from maxshard.model.flops import flops_per_token
from maxshard import perf
from maxshard.observe.metrics import MetricsWriter, StepValues, memory_stats
from maxshard.parallel import mesh as mesh_lib
from maxshard.units import format_bytes, format_count, format_duration, format_flops

__all__ = ["format_progress", "format_skipped", "format_startup_summary", "startup_figures", "print_startup",
           "StepLogger"]


def format_progress(
    step: int,
    total_steps: int,
    loss: float,
    step_time: float,
    tokens_per_sec: float,
    mfu: float | None,
    eta_seconds: float | None,
    flops_per_sec: float | None = None,
) -> str:
    """One compact console line; MFU, FLOP/s and ETA are left out when unknown (never guessed)."""
    parts = [
        f"step {step}/{total_steps}",
        f"loss {loss:.3f}",
        f"{step_time:.3f} s/step",
        f"{format_count(tokens_per_sec)} tok/s/dev",
    ]
    if flops_per_sec is not None:
        parts.append(f"{format_flops(flops_per_sec)}/dev")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    if eta_seconds is not None:
        parts.append(f"ETA {format_duration(eta_seconds)}")
    return " | ".join(parts)


def format_skipped(skipped: int, read: int | None, first: list[str], limit: float) -> str:
    """The skipped-records line: the count, its share of the records read (left out where no count of them is
    known) with the bound `limit` (`max_bad_record_fraction`), and the first bad records as `where: reason`."""
    share = (f" of {read:,} read ({skipped / read:.1%}; the run stops above max_bad_record_fraction={limit:g} "
             f"from {bad_records.MIN_RECORDS:,} read)") if read and read >= skipped else ""
    shown = f"; first: {'; '.join(first[: bad_records.SHOWN])}" if first else ""
    return f"skipped records: {skipped:,}{share}{shown}"


def format_startup_summary(figures: Mapping[str, Any]) -> str:
    """Printed once before training, from `startup_figures`: the mesh, the model size, what each device holds."""
    memory = figures["memory_per_device"]
    parts = " + ".join(f"{name} {format_bytes(b)}" for name, b in memory.items())
    count, trained = figures["param_count"], figures.get("trainable_param_count", figures["param_count"])
    lora = figures.get("lora")
    trains = "" if trained == count else (
        f", {format_count(trained)} trainable ({trained:,}, {trained / count:.2%}: LoRA rank {lora['rank']} on "
        f"{', '.join(lora['targets'])}; the rest frozen)") if lora else (
        f", {count - trained:,} moved by the train step, not the optimizer (MoE selection biases)")
    lines = [
        f"run: {figures['run_dir']}",
        f"mesh: {mesh_lib.describe(figures['mesh'])} ({figures['devices']} device{'s' * (figures['devices'] != 1)})",
        f"parameters: {format_count(count)} ({count:,}){trains}",
        f"per-device memory estimate: {parts} = {format_bytes(sum(memory.values()))}",
    ]
    peak = figures["peak_flops"]
    precision = figures.get("peak_precision", "bf16")
    peak_text = f"peak {peak / 1e12:.0f} TFLOP/s {precision}" if peak else "peak unknown: MFU not reported"
    attention = figures.get("attention")
    if attention:  # which kernel `attention: auto` resolved to on this device (model/attention_choice.py)
        how = f"auto -> {attention['kernel']}" if attention["requested"] == "auto" else f"{attention['kernel']} (as set)"
        peak_text += f"; attention {how}"
    lines.append(f"device: {figures['device_kind']}, {peak_text}")
    if figures.get("quantization", "none") != "none":
        lines.append(f"quantization: {figures['quantization']} on the attention and MLP matmuls, forward and backward "
                     "(qwix; maxshard/model/quantization.py)")
    if figures.get("memory_fit"):
        lines.append(format_memory_fit(figures["memory_fit"]))
    pipe = figures["pipeline"]
    if pipe is not None:
        lines.append(f"pipeline: {pipe['stages']} stages x {pipe['repeats']} repeats x {pipe['layers_per_stage']} "
                     f"layers, {pipe['microbatches']} microbatches, bubble fraction {pipe['bubble_fraction']:.3f}"
                     + (f", schedule {pipe['schedule']} ({pipe['in_flight']} microbatch stage inputs in flight)"
                        if "schedule" in pipe else ""))
    lines.append(f"batch: {figures['global_batch_size']} x {figures['max_target_length']} tokens, "
                 f"{figures['steps']} steps")
    if figures.get("chat_template"):
        template = figures["chat_template"]
        lines.append(f"chat template: {template['name']} (sha256 {template['sha256']}); the loss counts assistant "
                     "turns only (`tokens` per step)")
    return "\n".join(lines)


def format_memory_fit(fit: Mapping[str, Any]) -> str:
    """Which remat policy runs and why: the planned peak per device against the usable memory."""
    chosen = f"auto -> {fit['policy']}" if fit["requested"] == "auto" else f"{fit['policy']} (as set)"
    why = "the least recompute that fits" if fit["requested"] == "auto" else "fits"
    return (f"remat: {chosen}, {why}: planned peak {format_bytes(fit['planned_bytes'])} per device of "
            f"{format_bytes(fit['usable_bytes'])} usable ({fit['capacity_source']}, "
            f"{1 - fit['usable_bytes'] / fit['capacity_bytes']:.0%} headroom)")


def startup_figures(cfg: Config, mesh_shape: Mapping[str, int], param_count: int, report: Any,
                    trainable_param_count: int | None = None) -> dict[str, Any]:
    """The run's startup figures as plain JSON values (one home: the console line and metrics.jsonl read them)."""
    lora = None if not cfg.model.lora_rank else {
        "rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha, "targets": list(cfg.model.lora_targets)}
    shape = cfg.model.pipeline
    pipeline = None if shape is None else {
        "stages": shape.stages, "repeats": shape.repeats, "layers_per_stage": shape.layers_per_stage,
        "microbatches": shape.microbatches, "bubble_fraction": pipeline_schedule.of(shape).bubble_fraction,
        "schedule": shape.schedule, "in_flight": pipeline_schedule.of(shape).in_flight,
    }
    return {
        "run_dir": cfg.run_dir,
        "devices": math.prod(mesh_shape.values()),
        "processes": cfg.num_processes,
        "mesh": dict(mesh_shape),
        "param_count": param_count,
        "trainable_param_count": param_count if trainable_param_count is None else trainable_param_count,
        "lora": lora,
        "memory_per_device": {
            "params": report.param_bytes_per_device,
            "opt_state": report.optimizer_bytes_per_device,
            "grads": report.gradient_bytes_per_device,
            **({"reference": report.reference_bytes_per_device} if report.reference_bytes_per_device else {}),
        },
        "device_kind": cfg.device_kind,
        "peak_flops": quantization.peak_flops(cfg),
        "peak_precision": quantization.peak_precision(cfg),
        "quantization": cfg.quantization,
        "attention": {"requested": cfg.attention, "kernel": cfg.model.attention},
        "pipeline": pipeline,
        "remat_policy": cfg.remat_policy,
        "memory_fit": None if cfg.memory_fit is None else cfg.memory_fit.as_json(),
        "global_batch_size": cfg.global_batch_size,
        "max_target_length": cfg.max_target_length,
        "steps": cfg.steps,
    }


def print_startup(figures: Mapping[str, Any], writer: MetricsWriter) -> None:
    """Prints the summary and records the figures as the first record of metrics.jsonl."""
    print(format_startup_summary(figures), flush=True)
    writer.write_startup(figures)


class StepLogger:
    """Turns each finished step's values into throughput figures; prints and records every `log_period` steps.

    Step time is measured between the ends of two steps, so the first step is logged with its loss and a
    `compile_time` but no throughput: the compile before the loop (`compiled_seconds`) plus the time from the loop's
    start to the first step's end (where JAX still compiles what the loop calls first, and the step runs).

    Skipped records (`data/skipped_records`, the run's count) are reported at each logged step where the count grew
    since the last logged step (so a resumed run says at its first line what it skipped before); the first reasons
    come from the run directory (`bad_records.read_examples`), where the input wrote them.
    """

    def __init__(self, cfg: Config, writer: MetricsWriter, compiled_seconds: float = 0.0):
        self.cfg, self.writer = cfg, writer
        self.compiled_seconds = compiled_seconds
        self.tokens_per_step = cfg.global_batch_size * cfg.max_target_length
        self.flops_per_step = flops_per_token(cfg.model) * self.tokens_per_step
        self.peak = quantization.peak_flops(cfg)  # the 8-bit peak's share for a quantized run
        shape = cfg.model.pipeline
        self.constants = {} if shape is None else {
            "pipeline/bubble_fraction": pipeline_schedule.of(shape).bubble_fraction}
        self.started = time.perf_counter()
        self.compiled = False
        self.reference: StepValues | None = None  # timing reference: the last logged (or first) step
        self.skipped_shown = 0  # the count of skipped records at the last line that reported it

    def restart(self) -> None:
        """Forget the timing reference, e.g. after an evaluation that would otherwise count as step time."""
        self.reference = None

    def __call__(self, done: StepValues | None) -> None:
        if done is None:
            return
        step = done.step + 1  # steps are counted from 1 in logs
        if not self.compiled:
            self.compiled = True
            self.reference = done
            compile_time = self.compiled_seconds + done.ready_time - self.started
            self._write_first(step, {**done.values, "compile_time": compile_time})
            return
        if step % self.cfg.log_period and step != self.cfg.steps:
            if self.reference is None:
                self.reference = done
            return
        if self.reference is None:  # the first step after an evaluation: its values, with no time to divide
            self.reference = done
            self._write_untimed(step, dict(done.values))
            return
        step_time = (done.ready_time - self.reference.ready_time) / (done.step - self.reference.step)
        self.reference = done
        self._write(step, dict(done.values), step_time)

    def _write_first(self, step: int, record: dict[str, Any]) -> None:
        self.writer.write(step, record)
        print(f"step {step}/{self.cfg.steps} | loss {record['loss']:.3f} | compiled and ran in "
              f"{record['compile_time']:.1f}s", flush=True)
        self._report_skipped(record)

    def _write_untimed(self, step: int, record: dict[str, Any]) -> None:
        self.writer.write(step, record)
        print(f"step {step}/{self.cfg.steps} | loss {record['loss']:.3f} | timed from the next step", flush=True)
        self._report_skipped(record)

    def _write(self, step: int, record: dict[str, Any], step_time: float) -> None:
        figures = perf.step_perf(self.tokens_per_step, self.flops_per_step, step_time, self.cfg.num_devices, self.peak)
        record.update({"step_time": step_time, **figures, **self.constants, **(memory_stats() or {})})
        self.writer.write(step, record)
        eta = (self.cfg.steps - step) * step_time
        progress = format_progress(
            step, self.cfg.steps, record["loss"], step_time, figures["tokens_per_sec_per_device"], figures["mfu"],
            eta, flops_per_sec=figures["tflops_per_device"] * 1e12,
        )
        if "moe/dropped_fraction" in record:
            progress += (f" | dropped {record['moe/dropped_fraction']:.1%}"
                         f" | expert load max {record['moe/expert_load_max']:.2f}")
        if "rewards/accuracy" in record:  # a preference objective (maxshard/objectives/preference.py)
            progress += f" | reward accuracy {record['rewards/accuracy']:.2f} margin {record['rewards/margin']:.3f}"
        if "rollout/seconds" in record:  # GRPO: the last rollout's reward and speed (generation/rollouts.py)
            progress += (f" | reward {record['reward/mean']:.3f} | rollout {record['rollout/seconds']:.2f}s "
                         f"{record['rollout/tokens_per_sec']:,.0f} tok/s")
        if "rollout/turns" in record:  # multi-turn episodes (generation/environments.py)
            progress += (f" | {record['rollout/turns']:.1f} turns {record['rollout/tool_calls']:.1f} tool calls, "
                         f"{record['rollout/episodes_cut']:.0%} cut")
        print(progress, flush=True)
        self._report_skipped(record)

    def _report_skipped(self, record: Mapping[str, Any]) -> None:
        """Prints the skipped-records line (`format_skipped`) where the count grew since the last one."""
        skipped = record.get("data/skipped_records") or 0
        if skipped <= self.skipped_shown:
            return
        self.skipped_shown = skipped
        first = bad_records.read_examples(self.cfg.run_dir)
        print(format_skipped(skipped, record.get("data/records_read"), first, self.cfg.max_bad_record_fraction),
              flush=True)
