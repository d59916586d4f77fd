"""Pipeline schedules (maxshard/spec/pipeline_schedule.py): every row of SCHEDULES keeps the contract that
layers/pipeline.py and the planner rely on. Cheap: no model, no compile, a few small arrays.

The contract: every microbatch runs every stage of every repeat exactly once, in model order (repeat by repeat,
stage 0 to S-1), one stage per iteration (the shift moves outputs one stage on), and re-enters stage 0 only after it
left the last stage (its output waits in the circulation buffer); indices stay in range in bubbles too (the layer
gathers with them); `slots` finds every (repeat, microbatch, stage) where `assignment` puts it; the bubble fraction
is the share of idle stage-iterations; the buffer figures are what the layer builds. A schedule that breaks any of
these is reported (`test_the_contract_bites`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from maxshard.errors import ConfigError
from maxshard.spec import pipeline_schedule
from maxshard.spec.model_config import PipelineShape

SIZES = [(2, 1, 2), (2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 6), (8, 1, 16)]  # (stages, repeats, microbatches)


def table(schedule: pipeline_schedule.Schedule) -> np.ndarray:
    """[iterations, stages, 3]: (microbatch, repeat, valid) of every stage-iteration."""
    return np.stack([np.stack([np.asarray(a) for a in schedule.assignment(t)], axis=-1)
                     for t in range(schedule.iterations)]).astype(int)


def problems(schedule: pipeline_schedule.Schedule) -> list[str]:
    """How `schedule` breaks the contract of the module docstring (empty: it keeps it)."""
    s_, r_, m_ = schedule.stages, schedule.repeats, schedule.microbatches
    rows, found = table(schedule), []
    microbatch, repeat, valid = rows[..., 0], rows[..., 1], rows[..., 2].astype(bool)
    if rows.shape[1] != s_ or microbatch.min() < 0 or microbatch.max() >= m_ or repeat.min() < 0 \
            or repeat.max() >= r_:
        found.append("an index out of range")
    for m in range(m_):
        visits = sorted((repeat[t, s], s, t) for t, s in zip(*np.nonzero(valid & (microbatch == m))))
        if [(r, s) for r, s, _ in visits] != [(r, s) for r in range(r_) for s in range(s_)]:
            found.append(f"microbatch {m} does not run every stage of every repeat exactly once")
            continue
        for (_, s0, t0), (_, s1, t1) in zip(visits, visits[1:]):  # in model order
            if s1 == s0 + 1 and t1 != t0 + 1:
                found.append(f"microbatch {m} moves from stage {s0} at {t0} to stage {s1} at {t1}, not one on")
            if s1 == 0 and t1 <= t0:
                found.append(f"microbatch {m} re-enters stage 0 at {t1}, before it left stage {s0} at {t0}")
    idle = int((~valid).sum())
    if not math.isclose(schedule.bubble_fraction, idle / valid.size, rel_tol=1e-12):
        found.append(f"bubble fraction {schedule.bubble_fraction} for {idle} of {valid.size} stage-iterations idle")
    iteration, stage = schedule.slots()
    for r, m, s in np.ndindex(r_, m_, s_):
        if tuple(rows[iteration[r, m, s], stage[r, m, s]]) != (m, r, 1) or stage[r, m, s] != s:
            found.append(f"slots puts microbatch {m} of repeat {r} on stage {s} where assignment does not")
            break
    if (schedule.kept_inputs, schedule.buffer_microbatches) != (schedule.iterations, m_):
        found.append("buffer figures other than the layer's: a stage input per iteration, a buffer of M")
    return found


@pytest.mark.parametrize("name", sorted(pipeline_schedule.SCHEDULES))
@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_every_schedule_keeps_the_contract(name, sizes):
    schedule = pipeline_schedule.SCHEDULES[name](*sizes)
    schedule.check()
    assert problems(schedule) == []


@dataclasses.dataclass(frozen=True)
class _Backwards(pipeline_schedule.Circular):
    """Stages in the wrong order: microbatch m of repeat r on stage S-1-s at t = r*M + m + s."""

    def assignment(self, t):
        microbatch, repeat, valid = super().assignment(t)
        return microbatch[::-1], repeat[::-1], valid[::-1]


def test_the_contract_bites():
    assert problems(_Backwards(2, 2, 4))
    # fewer microbatches than stages: microbatch 0 would re-enter stage 0 before it left the last one (why `check`
    # refuses it)
    assert any("re-enters stage 0" in p for p in problems(pipeline_schedule.Circular(4, 2, 2)))
    assert not problems(pipeline_schedule.Circular(4, 2, 4))


def test_circular_matches_its_worked_example():
    """The table of the module docstring, S=2, R=2, M=4 (microbatch/repeat, -: bubble)."""
    schedule = pipeline_schedule.Circular(stages=2, repeats=2, microbatches=4)
    rows = table(schedule)
    shown = [" ".join(f"{m}/{r}" if v else "-" for m, r, v in rows[:, s]) for s in range(2)]
    assert shown == ["0/0 1/0 2/0 3/0 0/1 1/1 2/1 3/1 -", "- 0/0 1/0 2/0 3/0 0/1 1/1 2/1 3/1"]
    assert (schedule.iterations, schedule.bubble_fraction) == (9, 1 / 9)


@pytest.mark.parametrize("sizes", SIZES, ids=str)
def test_circular_figures(sizes):
    s, r, m = sizes
    schedule = pipeline_schedule.Circular(*sizes)
    assert schedule.iterations == m * r + s - 1
    assert int((table(schedule)[..., 2] == 0).sum()) == s * (s - 1)  # each stage idles S - 1 iterations
    assert schedule.bubble_fraction == (s - 1) / (m * r + s - 1)


def test_a_shape_gets_the_circular_schedule_which_checks_its_sizes():
    assert pipeline_schedule.of(PipelineShape(4, 1, 2, 8)) == pipeline_schedule.Circular(4, 2, 8)
    with pytest.raises(ConfigError, match="num_pipeline_microbatches=6 must be a multiple of the 4 pipeline"):
        pipeline_schedule.of(PipelineShape(4, 1, 2, 6)).check()
