"""Pipeline schedules: which microbatch and repeat each stage works on at each iteration, and what that order costs.

A schedule owns the order of work of a pipeline of S stages, R repeats and M microbatches (a `PipelineShape` of
spec/model_config.py): the number of iterations, the bubble (the stage-iterations that hold no microbatch), which
microbatch and repeat stage s runs at iteration t or that it idles, and the buffer figures the planner counts.
`layers/pipeline.py` runs it (the circulation buffer, the shift, one checkpoint per iteration), and the planner
(planning/traffic.py, memory.py, printout.py) and the console read its figures; none of them works out the order
itself. A new order of work on the same mechanics (stage 0 reads the circulation buffer of all M microbatches, one
shift and one checkpoint per iteration) is one class with the members of `Schedule` and its row in `SCHEDULES`;
tests/test_pipeline_schedule.py checks every row's contract. Schedules that interleave forward and backward work
(`pipeline_schedule: gpipe | 1f1b | interleaved_1f1b | zero_bubble`) are tables (spec/pipeline_tables.py) run by
layers/pipeline_runner.py: `Tabled` gives the planner and the console their figures, and the layer's forward-only
calls (eval, a frozen reference, generation) keep the circular order, which computes the same function. `of` reads
the name the shape carries (`PipelineShape.schedule`, from the `pipeline_schedule` key).

Circular (the one schedule). Layer r*S*L + s*L + l lives on stage s in repeat r (L layers per stage): a microbatch
walks stages 0..S-1, wraps from the last stage back to the first and walks them again with the next repeat's
weights, R times. Microbatch m of repeat r is on stage s at iteration t = r*M + m + s; there are M*R + S - 1
iterations and the bubble fraction is (S-1) / (M*R + S-1). Worked example, S=2, R=2, M=4 (entries:
microbatch/repeat, -: bubble):

    iteration   0    1    2    3    4    5    6    7    8
    stage 0    0/0  1/0  2/0  3/0  0/1  1/1  2/1  3/1   -      layers 0 (repeat 0) and 2 (repeat 1)
    stage 1     -   0/0  1/0  2/0  3/0  0/1  1/1  2/1  3/1     layers 1 (repeat 0) and 3 (repeat 1)

Bubble: 2 of 18 stage-iterations = 1/9 = (S-1)/(M*R+S-1). Microbatch 0 leaves stage 1 after iteration 1 and
re-enters stage 0 at iteration 4: with M > S a finished microbatch waits M - S iterations in the circulation buffer,
which is why M >= S (the config asks for a multiple of S). The buffer holds all M microbatches (the layer input for
repeat 0, the wrapped activations afterwards), and the backward keeps every iteration's stage input: M*R + S - 1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from maxshard.errors import ConfigError
from maxshard.spec import pipeline_tables

__all__ = ["Schedule", "Circular", "Tabled", "SCHEDULES", "NAMES", "of", "circular_of", "held_at_peak"]


class Schedule(Protocol):
    """What a schedule owns (module docstring); built from the sizes S, R, M."""

    stages: int
    repeats: int
    microbatches: int
    bubble_formula: ClassVar[str]  # the bubble fraction in S, M, R, as the planner prints it

    @property
    def iterations(self) -> int:
        """Iterations of the pipeline loop; each runs every stage once (a bubble on zeros) and one shift."""

    @property
    def bubble_fraction(self) -> float:
        """Share of the stage-iterations that hold no microbatch."""

    @property
    def kept_inputs(self) -> int:
        """Microbatch stage inputs the backward keeps per stage (each with what the remat policy saves inside)."""

    @property
    def buffer_microbatches(self) -> int:
        """Microbatches the circulation buffer holds per stage."""

    @property
    def output_microbatches(self) -> int:
        """Microbatches of the pipeline's output a stage holds for the head (0 where the head runs per microbatch)."""

    @property
    def in_flight(self) -> int:
        """Microbatch stage inputs a stage keeps at once for backward work still to come (the console's figure)."""

    def check(self) -> None:
        """A one-line ConfigError when the sizes do not suit the schedule."""

    def assignment(self, t: jax.Array | int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(microbatch, repeat, valid) of every stage at iteration t, each [stages]; valid is False in a bubble, whose
        microbatch and repeat are in range but mean nothing. Traceable: t may be a traced scalar."""

    def slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(iteration, stage) index arrays [R, M, S]: where microbatch m of repeat r is on stage s."""


@dataclasses.dataclass(frozen=True)
class Circular:
    """Microbatch m of repeat r on stage s at iteration t = r*M + m + s (module docstring)."""

    stages: int
    repeats: int
    microbatches: int
    bubble_formula: ClassVar[str] = "(S-1)/(M*R+S-1)"

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble_fraction(self) -> float:
        """(S - 1) / (M * R + S - 1): each stage idles S - 1 iterations, while the pipeline fills or drains."""
        return (self.stages - 1) / self.iterations

    @property
    def kept_inputs(self) -> int:
        """One per iteration (each iteration's stage computation is one checkpoint)."""
        return self.iterations

    @property
    def buffer_microbatches(self) -> int:
        """All M: the input of repeat 0 until stage 0 reads it, then the wrapped activation."""
        return self.microbatches

    @property
    def output_microbatches(self) -> int:
        """M / S: the head runs on the whole batch after the pipeline, and each stage gets its share of the output
        (layers/pipeline._finished). Live at the compiled step's peak at the 70B-width shape of
        benchmarks/pipeline_memory.py and the v5e-8 shape of tests/test_pipeline_tpu.py; the planner's pipeline
        term does not count it (benchmarks/README.md, pipeline schedules)."""
        return self.microbatches // self.stages

    @property
    def in_flight(self) -> int:
        return self.kept_inputs

    def check(self) -> None:
        if self.microbatches % self.stages:
            raise ConfigError(f"num_pipeline_microbatches={self.microbatches} must be a multiple of the {self.stages} "
                              "pipeline stages (a finished microbatch waits for stage 0 to come round again)")

    def assignment(self, t: jax.Array | int) -> tuple[jax.Array, jax.Array, jax.Array]:
        step = t - jnp.arange(self.stages)  # r*M + m of stage s
        valid = (step >= 0) & (step < self.microbatches * self.repeats)
        repeat = jnp.clip(step // self.microbatches, 0, self.repeats - 1)
        return step % self.microbatches, repeat, valid

    def slots(self) -> tuple[np.ndarray, np.ndarray]:
        r, m, s = np.meshgrid(*(np.arange(n) for n in (self.repeats, self.microbatches, self.stages)), indexing="ij")
        return r * self.microbatches + m + s, s


@dataclasses.dataclass(frozen=True)
class Tabled:
    """A schedule that is a table (spec/pipeline_tables.py): the figures the planner and console read.

    The runner (layers/pipeline_runner.py) keeps a stage input per microbatch in flight and recomputes the stage's
    forward inside its backward, so only the one microbatch whose backward runs holds what the remat policy saves:
    `kept_inputs` is that one, and `buffer_microbatches` the rest (the other in-flight stage inputs and the output
    cotangents; the embedding runs per microbatch on stage 0, so no stage holds all M)."""

    name: str
    stages: int
    repeats: int
    microbatches: int

    @property
    def table(self) -> pipeline_tables.Table:
        return _table(self.name, self.stages, self.repeats, self.microbatches)

    @property
    def bubble_formula(self) -> str:  # type: ignore[override]
        return pipeline_tables.bubble_formula(self.name)

    @property
    def iterations(self) -> int:
        return self.table.ticks

    @property
    def bubble_fraction(self) -> float:
        """The share of idle stage-ticks of the table (the runner steps every stage once per tick)."""
        return self.table.idle_fraction

    @property
    def kept_inputs(self) -> int:
        return 1

    @property
    def in_flight(self) -> int:
        return self.table.in_flight

    @property
    def buffer_microbatches(self) -> int:
        table = self.table
        return table.in_flight - 1 + table.cotangents

    @property
    def output_microbatches(self) -> int:
        """None: the last stage runs the head on each microbatch as it arrives (F_LAST)."""
        return 0

    def check(self) -> None:
        Circular(self.stages, self.repeats, self.microbatches).check()  # the forward-only calls run circular
        _table(self.name, self.stages, self.repeats, self.microbatches)


@functools.lru_cache(maxsize=64)
def _table(name: str, stages: int, repeats: int, microbatches: int) -> pipeline_tables.Table:
    return pipeline_tables.build(name, stages, repeats, microbatches)


SCHEDULES: dict[str, type[Schedule]] = {"circular": Circular}  # orders of work the circular layer runs
NAMES = ("circular", *pipeline_tables.SCHEDULE_NAMES)  # every `pipeline_schedule`


def of(shape: Any) -> Schedule:
    """The schedule of a pipeline of `shape` (a PipelineShape: stages, repeats, microbatches, schedule name)."""
    name = getattr(shape, "schedule", "circular")
    if name in SCHEDULES:
        return SCHEDULES[name](shape.stages, shape.repeats, shape.microbatches)
    return Tabled(name, shape.stages, shape.repeats, shape.microbatches)  # type: ignore[return-value]


def held_at_peak(schedule: Schedule) -> int:
    """Microbatch-sized activations a stage holds at once: kept stage inputs, the buffer (or stash and output
    cotangents) and the pipeline's output share. What benchmarks/pipeline_memory.py and tests/test_pipeline_tpu.py
    compare with the compiled step's live bytes; the planner's pipeline term counts the first two."""
    return schedule.kept_inputs + schedule.buffer_microbatches + schedule.output_microbatches


def circular_of(shape: Any) -> Circular:
    """The order the layer's own forward runs for any schedule (the function is the same)."""
    return Circular(shape.stages, shape.repeats, shape.microbatches)
