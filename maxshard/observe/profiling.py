"""Captures a JAX profiler trace (xplane, readable by TensorBoard's profile plugin / XProf) over a few steps.

The trace starts at `profile_start`, not at step 0: the first steps compile and warm up, and a trace of them shows
compilation rather than the steady state. Each step is wrapped in a `StepTraceAnnotation` so the viewer can
split the timeline into steps and report step time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax

from maxshard.errors import ConfigError

PROFILE_SUBDIR = "profile"


class Profiler:
    """Traces steps `[start, start + num_steps)` into `profile_dir`; does nothing when not enabled.

    Usage in the loop:
        with profiler.step(step):
            state, metrics = train_step(state, batch)
        ...
        profiler.close()   # stops a trace that the run ended inside of
    """

    def __init__(self, profile_dir: str, start: int, num_steps: int, enabled: bool):
        if enabled and (start < 0 or num_steps < 1):
            raise ConfigError(f"profile_start must be >= 0 and profile_steps >= 1, got {start} and {num_steps}")
        self.profile_dir = profile_dir
        self.start = start
        self.last = start + num_steps - 1
        self.enabled = enabled
        self.active = False
        self.done = False

    @classmethod
    def from_config(cls, cfg: Any, is_primary: bool = True) -> Profiler:
        """`profiler: xplane` turns it on; traces go to `run_dir/profile`. Only the primary process traces,
        unless `is_primary` is passed True everywhere (each host then needs its own run_dir)."""
        enabled = cfg.profiler == "xplane" and is_primary
        return cls(os.path.join(cfg.run_dir, PROFILE_SUBDIR), cfg.profile_start, cfg.profile_steps, enabled)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Starts the trace at the first profiled step (or later, for a run resumed inside the window), annotates
        the step, and stops after the last one."""
        if self.enabled and not (self.active or self.done) and self.start <= step <= self.last:
            jax.profiler.start_trace(self.profile_dir)
            self.active = True
        if not self.active:
            yield
            return
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Waits for dispatched work, then stops the trace; the steps' device work would be cut off otherwise.

        Waiting on every live array is the simplest way to wait for "all dispatched steps" without knowing the
        loop's variables; it happens once per run.
        """
        if not self.active:
            return
        jax.block_until_ready(jax.live_arrays())
        jax.profiler.stop_trace()
        self.active = False
        self.done = True
