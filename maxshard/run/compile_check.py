"""The fit check that trusts the compiler: the train step is compiled before the first step, and XLA's own peak per
device decides whether the remat policy fits.

The plan (`planning/fit.py`) chooses before anything compiles, from a memory model fitted on XLA:CPU and XLA:TPU
programs, which another compiler may hold differently (an H100's: benchmarks/README.md, "Remat policies: planned vs
compiled vs allocator peak, and their cost"). The compiled program's `memory_analysis()` (arguments + temporaries +
outputs - donated, `planning/compiled.peak_bytes`; on a GPU equal to the allocator's peak, the same section) is
exact, and the step compiles anyway, so it has the last word:

    remat_policy: auto   the policies are compiled in auto's order of preference (`fit.by_preference`: on the
                         device first, then the fewest FLOPs re-run, then the smaller planned peak), skipping those
                         the plan puts beyond what a compile could overturn, until one fits
                         (`run/auto_compile.py`, the same decision `maxshard.plan` makes for a target). The plan's
                         own choice is among them; a policy it prefers but plans just over the usable memory
                         (within its error) is compiled first, one compile more where the plan was right
    an explicit policy   used as given when its compiled peak fits; otherwise one error line (exit 2) with the
                         compiled peak, before the first step

Where a backend gives no memory analysis the compiled step is used unchecked. The compiled executable is what the
loop runs, so the check costs no second compile.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jax.sharding import NamedSharding

from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.planning import memory
from maxshard.run.auto_compile import choose, with_policy
from maxshard.planning.compiled import abstract_inputs, peak_bytes
from maxshard.training.step import Trainer
from maxshard.units import format_bytes

__all__ = ["CompiledStep", "compile_step"]


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """The train step as it will run: its trainer (whose config names the policy), executable and peak."""

    trainer: Trainer
    step: Any  # called as step(state, batch) -> (state, metrics)
    peak_bytes: int | None  # None where the backend has no memory analysis
    seconds: float  # compile time, every policy tried included

    def line(self) -> str:
        """One line for the console: what compiled, how long it took and what it needs per device."""
        cfg = self.trainer.cfg
        text = f"compiled the train step in {self.seconds:.1f}s (remat_policy={cfg.remat_policy})"
        if self.peak_bytes is None or cfg.memory_fit is None:
            return text
        return (f"{text}: peak {format_bytes(self.peak_bytes)} per device of "
                f"{format_bytes(cfg.memory_fit.usable_bytes)} usable (XLA's memory analysis)")


def compile_step(trainer: Trainer, batch_sharding: NamedSharding) -> CompiledStep:
    """The train step compiled for `trainer`'s policy; under `auto`, for the first policy in auto's order whose
    compile fits (`auto_compile.choose`, as `maxshard.plan` decides it for a target)."""
    started = time.perf_counter()
    cfg = trainer.cfg
    usable = cfg.memory_fit.usable_bytes if cfg.memory_fit is not None else None
    if usable is None or cfg.memory_fit.requested != "auto":
        step, peak = _compiled(trainer, batch_sharding)
        if peak is not None and usable is not None and peak > usable:
            raise ConfigError(_refusal(cfg, peak, usable))
        return CompiledStep(trainer, step, peak, time.perf_counter() - started)
    return _compile_auto(trainer, batch_sharding, usable, started)


def _compile_auto(trainer: Trainer, batch_sharding: NamedSharding, usable: int, started: float) -> CompiledStep:
    """`auto` decided by compiles: each policy compiled in auto's order until one fits, a line for each that did
    not; where the backend has no memory analysis, the first compiled is used unchecked. ConfigError (one line)
    when none fits."""
    compiled: list[tuple[Trainer, Any, int | None]] = []

    def compile_peak(policy: str) -> int | None:
        if compiled:
            last, _, peak = compiled[-1]
            print(f"remat_policy={last.cfg.remat_policy} compiled to a peak of {format_bytes(peak)} per device, over "
                  f"the {format_bytes(usable)} usable; compiling remat_policy={policy} instead", flush=True)
        same = policy == trainer.cfg.remat_policy  # the plan's own choice: the trainer as it was built
        candidate = trainer if same else Trainer(with_policy(trainer.cfg, policy), trainer.mesh)
        compiled.append((candidate, *_compiled(candidate, batch_sharding)))
        peak = compiled[-1][2]
        return usable if peak is None else peak  # no memory analysis: nothing to check it against

    chosen, _ = choose(trainer.cfg, usable, compile_peak)
    if chosen is None:
        if not compiled:  # every policy planned beyond what a compile could overturn (loading.check_memory refuses)
            raise ConfigError(f"remat_policy=auto: every policy is planned over the {format_bytes(usable)} usable")
        last, _, peak = compiled[-1]
        raise ConfigError(_refusal(last.cfg, peak, usable, auto=True))
    candidate, step, peak = compiled[-1]
    return CompiledStep(candidate, step, peak, time.perf_counter() - started)


def _compiled(trainer: Trainer, batch_sharding: NamedSharding) -> tuple[Any, int | None]:
    """(the executable, its peak bytes per device or None)."""
    jitted = trainer.jit_train_step(batch_sharding)
    executable = jitted.lower(*abstract_inputs(trainer, batch_sharding)).compile()
    stats = executable.memory_analysis()
    return executable, (peak_bytes(stats) if stats is not None else None)


def _next_policy(cfg: Config) -> str | None:
    """The policy after the config's in order of device memory (less saved, more recomputed, as its compiler runs
    them: `memory.policies`); None after the last, or for a policy outside that order (an offload policy on
    XLA:CPU)."""
    order = list(memory.policies(memory.compiler(cfg)))
    if cfg.remat_policy not in order:
        return None
    position = order.index(cfg.remat_policy)
    return order[position + 1] if position + 1 < len(order) else None


def _refusal(cfg: Config, peak: int, usable: int, auto: bool = False) -> str:
    """The one line for a compiled step over the usable memory: `cfg`'s policy as given, or the last `auto`
    compiled."""
    following = None if auto else _next_policy(cfg)
    advice = (f"try remat_policy={following} or auto" if following is not None else
              "shard more (ici_fsdp_parallelism, ici_tensor_parallelism) or lower per_device_batch_size")
    return (f"remat_policy={cfg.remat_policy} compiles to a peak of {format_bytes(peak)} per device (XLA's memory "
            f"analysis), {format_bytes(peak - usable)} more than the {format_bytes(usable)} usable "
            f"({cfg.memory_fit.capacity_source}, memory_headroom={cfg.memory_headroom:g}); {advice}")
