"""Goodput's accounting over starts (maxshard/observe/goodput.py): which step time counts, which is lost work.

The whole path (a real kill and restart through `maxshard.train`, the summary in metrics.jsonl and on the console)
is checked by tests/test_local_checkpoints.py; here the arithmetic on a log written by the Recorder itself.
"""

from __future__ import annotations

import json

import pytest

from maxshard.observe import goodput


def _log(tmp_path, events):
    path = tmp_path / goodput.LOG_FILE
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"time": 99, "ev')  # a line cut by a kill
    return goodput.read_log(str(path))


def _step(t, step, seconds, first=False, data=0.0, save=0.0, **named):
    return {"time": t, "event": "step", "step": step, "seconds": seconds, "data": data, "save": save, "first": first,
            **named}


def test_a_killed_start_loses_the_steps_run_again_and_its_downtime_is_recovery(tmp_path):
    events = _log(tmp_path, [
        {"time": 0.0, "event": "start"},
        {"time": 10.0, "event": "phase", "name": "compile", "seconds": 6.0},
        {"time": 10.0, "event": "phase", "name": "initialization", "seconds": 4.0},
        _step(12.0, 1, 2.0, first=True),
        _step(13.0, 2, 1.0, data=0.25),
        _step(14.5, 3, 1.0, save=0.5),  # checkpoint at step 3
        _step(15.5, 4, 1.0),
        _step(16.5, 5, 1.0),  # killed after this record
        {"time": 20.0, "event": "start"},
        {"time": 21.0, "event": "phase", "name": "checkpoint_restore", "seconds": 1.0},
        {"time": 23.0, "event": "phase", "name": "compile", "seconds": 2.0},
        _step(24.0, 4, 1.0, first=True),
        _step(25.0, 5, 1.0),
        _step(26.0, 6, 1.0),
        {"time": 26.5, "event": "end"},
    ])
    s = goodput.summarize(events)
    assert s["wall"] == 26.5 and s["restarts"] == 1
    assert s["recovery"] == 20.0 - 16.5
    assert s["lost_progress"] == 2.0  # the first start's steps 4 and 5
    assert s["productive"] == 1.0 + 1.0 + 1.0 + 1.0  # steps 2, 3 (first start), 5, 6 (second); 4 is compile
    assert s["compile"] == 6.0 + 2.0 + 2.0 + 1.0 and s["data_loading"] == 0.25 and s["checkpoint_save"] == 0.5
    assert sum(s[c] for c in goodput.CATEGORIES) == pytest.approx(s["wall"])
    assert s["other"] == pytest.approx(26.5 - 3.5 - 4.0 - 11.0 - 0.25 - 0.5 - 1.0 - 2.0 - 4.0)
    metrics = goodput.metrics(s)
    assert metrics["goodput/percent"] == pytest.approx(100 * 4.0 / 26.5)
    assert goodput.format_summary(s).startswith("goodput 15.1% of 26s wall over 2 starts; badput: compile")


def test_time_counted_twice_is_a_warning_not_an_error():
    events = [{"time": 0.0, "event": "start"}, {"time": 1.0, "event": "phase", "name": "compile", "seconds": 5.0},
              {"time": 2.0, "event": "end"}]
    s = goodput.summarize(events)
    assert s["overcounted"] == pytest.approx(3.0) and s["other"] == 0.0
    assert goodput.warning(s).startswith("warning: goodput's categories exceed the wall time by 3s")


def test_overlapping_starts_on_one_directory_are_reported_not_fatal(tmp_path):
    """Two starts on one run directory (a lock taken over from a host that still ran): their events interleave in
    one file. Each keeps its own steps, the wall time is the union of their spans, and the time counted twice is a
    warning, never an error."""
    a, b = {"start_id": "a"}, {"start_id": "b"}
    events = _log(tmp_path, [
        {"time": 0.0, "event": "start", **a},
        {"time": 4.0, "event": "phase", "name": "compile", "seconds": 4.0, **a},
        {"time": 5.0, "event": "start", **b},
        _step(6.0, 1, 2.0, first=True, **a),
        {"time": 9.0, "event": "phase", "name": "compile", "seconds": 4.0, **b},
        _step(10.0, 2, 4.0, **a),
        _step(11.0, 1, 2.0, first=True, **b),
        {"time": 11.0, "event": "end", **a},
        _step(14.0, 2, 3.0, **b),
        {"time": 15.0, "event": "end", **b},
    ])
    s = goodput.summarize(events)
    assert s["wall"] == 15.0 and s["restarts"] == 1
    assert s["productive"] == 3.0 and s["lost_progress"] == 4.0  # step 2 last ran in start b
    assert s["other"] == 0.0 and s["overcounted"] == pytest.approx(4 + 2 + 4 + 4 + 2 + 3 - 15.0)
    assert "counted twice" in goodput.warning(s)
    alone = goodput.summarize([e for e in events if e["start_id"] == "a"])  # start a alone: nothing counted twice
    assert alone["wall"] == 11.0 and alone["productive"] == 4.0 and goodput.warning(alone) is None
