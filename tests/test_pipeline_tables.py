"""The table schedules (maxshard/spec/pipeline_tables.py): each table is checked for its dependencies, its idle
fraction equals its formula, zero-bubble idles less than 1F1B at equal sizes, 1F1B keeps fewer microbatches in
flight than gpipe, and the planner reads the table's figures. Pure Python: no model, no compile.
"""

from __future__ import annotations

import math

import pytest

from maxshard import plan as plan_cli
from maxshard.errors import ConfigError
from maxshard.spec import pipeline_schedule, pipeline_tables
from maxshard.spec.model_config import PipelineShape
from maxshard.planning import printout

# (stages, microbatches, virtual stages)
SIZES = [(2, 2, 1), (2, 4, 1), (3, 6, 1), (4, 4, 1), (4, 8, 1), (8, 16, 1), (2, 4, 2), (4, 8, 2), (4, 12, 3)]


def cases():
    for name in pipeline_tables.SCHEDULE_NAMES:
        for s, m, v in SIZES:
            if (v > 1) == (name == "interleaved_1f1b"):
                yield name, s, m, v


@pytest.mark.parametrize("name, s, m, v", list(cases()))
def test_idle_fraction_follows_the_formula(name, s, m, v):
    table = pipeline_tables.build(name, s, v, m)
    assert math.isclose(table.idle_fraction, pipeline_tables.FORMULAS[name][1](s, m, v), rel_tol=1e-12)
    assert table.ticks * s * (1 - table.idle_fraction) == pytest.approx(3 * m * v * s)  # F, B, W of every item


@pytest.mark.parametrize("s, m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_zero_bubble_idles_less_than_1f1b_which_keeps_less_than_gpipe(s, m):
    zb, one, gpipe = (pipeline_tables.build(n, s, 1, m) for n in ("zero_bubble", "1f1b", "gpipe"))
    assert zb.idle_fraction < one.idle_fraction == gpipe.idle_fraction
    assert (one.in_flight, gpipe.in_flight, zb.in_flight) == (s, m, min(s + 1, m))


def test_1f1b_matches_its_worked_example():
    assert pipeline_tables.build("1f1b", 2, 1, 3).render() == [
        "F0 F1 - - W0 B0 F2 W1 B1 - W2 B2",
        "- F0 W0 B0 F1 W1 B1 F2 W2 B2 - -",
    ]


def test_the_dependency_check_bites():
    timeline = pipeline_tables.simulate(2, 1, 2, [pipeline_tables._one_f_one_b(2, 2, d) for d in range(2)], None)
    pipeline_tables.check(2, 1, 2, timeline)
    with pytest.raises(ValueError, match="does not follow its W at once"):  # a split backward is not a fused one
        zb = pipeline_tables.simulate(2, 1, 2, [pipeline_tables._one_f_one_b(2, 2, d) for d in range(2)], 0, [0, 1])
        pipeline_tables._table(2, 1, 2, zb, fused=True)
    early = [row[:] for row in timeline]
    first_b = next(t for t, a in enumerate(early[0]) if a and a[0] == "B")
    early[0][first_b], early[0][1] = early[0][1], early[0][first_b]  # B of stage 0 before stage 1's B
    with pytest.raises(ValueError, match="does not follow"):
        pipeline_tables.check(2, 1, 2, early)
    with pytest.raises(ValueError, match="missing"):
        pipeline_tables.check(2, 1, 2, [[a for a in row if a != ("W", 1, 0)] for row in timeline])


def test_a_shape_names_its_schedule_and_the_sizes_are_checked():
    schedule = pipeline_schedule.of(PipelineShape(4, 1, 1, 8, "zero_bubble"))
    assert schedule.bubble_fraction == pytest.approx(3 / 27) and schedule.bubble_formula == "(S-1)/(3M+S-1)"
    assert schedule.kept_inputs == 1 and schedule.buffer_microbatches == schedule.table.in_flight - 1 + \
        schedule.table.cotangents
    with pytest.raises(ConfigError, match="num_pipeline_repeats must be 1"):
        pipeline_schedule.of(PipelineShape(2, 1, 2, 4, "1f1b")).check()
    with pytest.raises(ConfigError, match="multiple of the 4 pipeline stages"):
        pipeline_schedule.of(PipelineShape(4, 1, 2, 6, "interleaved_1f1b")).check()


def test_the_planner_s_step_time_uses_the_table_s_bubble():
    """The plan's bubble is the table's idle fraction, its compute time is divided by (1 - bubble), and its printout
    names the schedule and its in-flight stage inputs."""
    base = ["configs/base.yml", "dataset_type=synthetic", "emb_dim=64", "num_layers=4", "num_heads=8",
            "num_kv_heads=8", "head_dim=8", "mlp_dim=128", "max_target_length=32", "ici_pipeline_parallelism=4",
            "num_pipeline_microbatches=8"]
    plans = {name: plan_cli.plan_for([*base, f"pipeline_schedule={name}"], "v5litepod-8")
             for name in ("1f1b", "zero_bubble")}
    for name, plan in plans.items():
        assert plan.bubble == pytest.approx(pipeline_tables.build(name, 4, 1, 8).idle_fraction)
    one, zb = plans["1f1b"], plans["zero_bubble"]
    assert zb.compute_s / one.compute_s == pytest.approx((1 - one.bubble) / (1 - zb.bubble))
    assert "pipeline bubble: 11.1% (zero_bubble (S-1)/(3M+S-1), S=4; 5 microbatch stage inputs in flight)" in \
        printout.format_plan(zb)
