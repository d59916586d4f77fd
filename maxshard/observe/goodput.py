"""Goodput: the share of a run's wall time spent in steps that count, and where the rest of it went.

The categories are those MaxText reports through Google's `ml-goodput-measurement` (its `BadputType` names in
brackets), computed here from a log the run keeps itself:

    productive          step time of every step that counts: the last execution of each step number
    initialization      from the start of `maxshard.train` to the loop, less compile and restore
                        [TPU_INITIALIZATION + TRAINING_PREP]
    compile             the train step compiled before the loop, and each start's first step, where JAX still
                        compiles what the loop calls first [PROGRAM_STARTUP]
    data_loading        time the loop waited for the next batch [DATA_LOADING_SYNC]
    checkpoint_save     time the loop was blocked by saves [UNPRODUCTIVE_CHECKPOINT_SAVE_TIME]
    checkpoint_restore  reading the checkpoint a start resumed from [UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME]
    lost_progress       step time of steps run again after a restart: work past the checkpoint a start resumed
                        from [WASTED_PROGRESS_FROM_DISRUPTION]
    recovery            from the last record of a start that did not end (killed, crashed) to the next start
                        [INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION]
    other               the rest of the wall time: evaluation, logging, the untracked tail of a killed start [OTHER]

So the categories sum to the wall time by construction. Starts that overlap in time (two runs on one directory,
which the run directory's lock refuses, or a lock taken over from a host that still ran) count some time twice:
`summarize` then reports what it can, with `other` at 0 and the excess in `overcounted`, and `warning` says so in a
line. An accounting check never fails a run whose work is done.

Each event names its start (`start_id`: host, pid and start time), so the events of starts that overlap, interleaved
in one file, are still told apart; the wall time is the union of the starts' spans and their recovery gaps.

Why not the package itself: ml-goodput-measurement 0.2.3 records to and reads from Google Cloud Logging only. Its
`GoodputRecorder`/`GoodputCalculator` build a Cloud Logging client (a GCP project and credentials) unless given a
`cloud_logger` the package documents as never to be passed by users, and importing it pulls Cloud Logging,
Monitoring and Storage clients. A run on a laptop, CI or any cluster without a GCP project has no such log, so the
same categories are computed from `run_dir/goodput.jsonl`, which the primary process appends one line per event to
(line-buffered: a killed start loses at most the step in flight, which is then counted as recovery).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from maxshard.units import format_duration

__all__ = ["CATEGORIES", "LOG_FILE", "Recorder", "summarize", "read_log", "format_summary", "warning", "metrics"]

LOG_FILE = "goodput.jsonl"
CATEGORIES = ("productive", "initialization", "compile", "data_loading", "checkpoint_save", "checkpoint_restore",
              "lost_progress", "recovery", "other")
_PHASES = ("initialization", "compile", "checkpoint_restore", "checkpoint_save")


class Recorder:
    """Appends the events of one start to `run_dir/goodput.jsonl`; a no-op on processes other than the primary."""

    def __init__(self, run_dir: str, is_primary: bool, started: float | None = None) -> None:
        self.path = os.path.join(run_dir, LOG_FILE)
        self._file = None
        self._first_step = True
        self._phases = 0.0
        began = time.time() if started is None else started
        self._start_id = f"{socket.gethostname()}:{os.getpid()}:{began:.6f}"
        if is_primary:
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # line-buffered
            self._event({"event": "start", "time": began})

    def _event(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"time": time.time(), **record, "start_id": self._start_id}) + "\n")

    def phase(self, name: str, seconds: float) -> None:
        """Time outside the steps: before the loop (initialization, compile, checkpoint_restore) or after it (the
        wait for the last save, checkpoint_save)."""
        assert name in _PHASES, name
        self._phases += seconds
        self._event({"event": "phase", "name": name, "seconds": seconds})

    def recorded(self) -> float:
        """Seconds of the phases recorded so far in this start."""
        return self._phases

    def step(self, step: int, seconds: float, data: float, save: float) -> None:
        """One loop iteration: step `step` (counted from 1) took `seconds` besides `data` and `save` waits."""
        self._event({"event": "step", "step": step, "seconds": seconds, "data": data, "save": save,
                     "first": self._first_step})
        self._first_step = False

    def end(self) -> dict[str, float]:
        """Marks the start as ended normally and returns the run's summary over all its starts so far."""
        self._event({"event": "end"})
        return summarize(read_log(self.path)) if self._file is not None else {}

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_log(path: str) -> list[dict[str, Any]]:
    """The events of every start, skipping a last line cut off by a kill."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _starts(events: Iterable[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events grouped by start, in the order the starts began.

    Events that name their start (`start_id`) join it wherever they are in the file; a log written before starts
    were named groups each event with the start above it."""
    starts: dict[str, list[dict[str, Any]]] = {}
    current = None
    for n, event in enumerate(events):
        if event["event"] == "start":
            current = event.get("start_id", f"line {n}")
            starts.setdefault(current, [])
        key = event.get("start_id", current)
        if key in starts:
            starts[key].append(event)
    return sorted(starts.values(), key=lambda start: start[0]["time"])


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of `intervals` (each [begin, end])."""
    covered, reached = 0.0, float("-inf")
    for begin, end in sorted(intervals):
        if end > reached:
            covered += end - max(begin, reached)
            reached = end
    return covered


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Seconds per category over every start, plus `wall` and `goodput` (productive / wall), `restarts`, and
    `overcounted`: seconds the categories exceed the wall time by (0 unless starts overlapped: `warning`)."""
    starts = _starts(events)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    spans: list[tuple[float, float]] = []
    last_run: dict[int, tuple[float, int, int]] = {}  # step -> (time, start, event) of its last execution
    for i, start in enumerate(starts):
        spans.append((start[0]["time"], start[-1]["time"]))
        ended = start[-1]["event"] == "end"
        if i + 1 < len(starts) and not ended:  # killed: until the next start the job was recovering
            gap = max(0.0, starts[i + 1][0]["time"] - start[-1]["time"])
            totals["recovery"] += gap
            spans.append((start[-1]["time"], start[-1]["time"] + gap))
        for j, event in enumerate(start):
            if event["event"] == "phase":
                totals[event["name"]] += event["seconds"]
            elif event["event"] == "step":
                totals["data_loading"] += event["data"]
                totals["checkpoint_save"] += event["save"]
                last_run[event["step"]] = max(last_run.get(event["step"], (float("-inf"), -1, -1)),
                                              (event["time"], i, j))
    for i, start in enumerate(starts):
        for j, event in enumerate(start):
            if event["event"] != "step":
                continue
            if event["first"]:
                totals["compile"] += event["seconds"]
            else:
                totals["productive" if last_run[event["step"]][1:] == (i, j) else "lost_progress"] += event["seconds"]
    wall = _union(spans)
    counted = sum(totals[c] for c in CATEGORIES if c != "other")
    overcounted = counted - wall if counted - wall > 1e-6 * max(wall, 1.0) else 0.0
    totals["other"] = max(wall - counted, 0.0)
    return {**totals, "wall": wall, "goodput": min(totals["productive"] / wall, 1.0) if wall > 0 else 0.0,
            "restarts": float(max(len(starts) - 1, 0)), "overcounted": overcounted}


def warning(summary: Mapping[str, float]) -> str | None:
    """A line for a summary whose categories exceed the wall time (starts that overlapped), else None."""
    if not summary.get("overcounted"):
        return None
    return (f"warning: goodput's categories exceed the wall time by {format_duration(summary['overcounted'])}: "
            "starts on this run directory overlapped in time, so some time is counted twice")


def metrics(summary: Mapping[str, float]) -> dict[str, float]:
    """The summary as metrics.jsonl / TensorBoard scalars: goodput/percent, goodput/<category>_seconds, ..."""
    if not summary:
        return {}
    out = {"goodput/percent": 100.0 * summary["goodput"], "goodput/wall_seconds": summary["wall"],
           "goodput/restarts": summary["restarts"]}
    out.update({f"goodput/{c}_seconds": summary[c] for c in CATEGORIES})
    return out


def format_summary(summary: Mapping[str, float]) -> str:
    """One line for the end of the run: the goodput and every category that took time, largest first."""
    wall = summary["wall"]
    parts = [f"{c.replace('_', ' ')} {format_duration(summary[c])} ({summary[c] / wall:.1%})"
             for c in sorted(CATEGORIES, key=lambda c: -summary[c]) if summary[c] > 0 and c != "productive"]
    restarts = int(summary["restarts"])
    return (f"goodput {summary['goodput']:.1%} of {format_duration(wall)} wall over {restarts + 1} start"
            f"{'s' if restarts else ''}; badput: " + ", ".join(parts))
