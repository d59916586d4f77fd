"""Pipeline schedules as tables: which stage does what, for which microbatch, at each tick (gpipe, 1F1B, interleaved
1F1B, zero-bubble), built once in Python and checked for dependencies; `layers/pipeline_runner.py` runs any of them.

Work items. A pipeline of S devices (the `stage` mesh axis) holds J = V x S logical stages: logical stage j = v*S + d
runs on device d as its virtual stage v (V = `num_pipeline_repeats`; the weights keep the circular pipeline's
[R, S, L, ...] layout, so repeat r is virtual stage r). Each (microbatch m, logical stage j) needs three unit actions:
  F  the forward of stage j on microbatch m (on the last logical stage also the head and the loss, whose gradient is
     the cotangent that starts the backward);
  B  the input gradient: the cotangent of stage j's input, handed to stage j-1 (the critical path);
  W  the weight gradient of stage j, added to its gradient sum (off the critical path).
Dependencies: F(m, j) after F(m, j-1); B(m, j) after F(m, j) and B(m, j+1); W(m, j) after B(m, j); always at a later
tick, since what one device computes reaches the next one by a collective permute at the end of the tick.

A schedule is each device's order of F and B plus where its W's go; `simulate` gives each action the first tick at
which its device is free and its dependencies are done (a device whose next action is not ready idles: the bubble).
Every tick costs one unit on every device (the SPMD runner steps all devices in lockstep), so the idle fraction of
the table is the pipeline's bubble in time. gpipe, 1f1b and interleaved_1f1b run a fused backward: W then B on
consecutive ticks, the input gradient handed on after both (a backward of two units, as in Megatron and torchtitan;
the runner computes the whole backward at W and hands its input gradient on at B).
  gpipe             all F, then all backwards. Idle (S-1)/(M+S-1); every device keeps all M microbatches.
  1f1b              S-d-1 warm-up forwards on device d, then one F and one backward in turn. Idle (S-1)/(M+S-1),
                    as gpipe, but device d keeps at most S-d microbatches in flight instead of M.
  interleaved_1f1b  Megatron's order over V virtual stages (microbatches in groups of S): idle (S-1)/(V*M+S-1).
  zero_bubble       ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of F and B with B
                    alone on the critical path; device d may defer up to d W's into the ticks where its next F or B
                    is not ready (one more and the oldest runs first). Idle (S-1)/(3M+S-1): a third of 1F1B's
                    idle time, for one more microbatch in flight (S+1).
Worked example, 1f1b with S=2, M=3 (F/B/W + microbatch, - idle):

    tick      0   1   2   3   4   5   6   7   8   9   10  11
    device 0  F0  F1  -   -   W0  B0  F2  W1  B1  -   W2  B2
    device 1  -   F0  W0  B0  F1  W1  B1  F2  W2  B2  -   -

Memory. A device keeps a microbatch's stage input from the tick it arrives until that stage's W (the runner
recomputes the stage's forward inside B and W, under the remat policy), and the cotangent of the stage's output from
its arrival until W: `in_flight` counts the stage inputs, `cotangents` the output cotangents, each the most any
device holds at once (the SPMD program gives every device the same buffers). Slots in those buffers are assigned
here, once (`Table.stash_slot`, `cot_slot`, `recv_*`), so the runner never searches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from maxshard.errors import ConfigError

__all__ = ["IDLE", "F", "F_LAST", "B", "W", "Table", "build", "SCHEDULE_NAMES", "FORMULAS", "bubble_formula"]

IDLE, F, F_LAST, B, W = 0, 1, 2, 3, 4  # action kinds in the table (F_LAST: F of the last logical stage, with the loss)
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")

Action = tuple[str, int, int]  # ("F" | "B" | "W", microbatch, virtual stage)


def bubble_formula(name: str) -> str:
    """The idle fraction of `name`'s table in S, M, V, as the planner prints it."""
    return FORMULAS[name][0]


# name -> (the idle fraction as printed, as a function of S, M, V); tests/test_pipeline_tables.py checks each
# table against its row
FORMULAS = {
    "gpipe": ("(S-1)/(M+S-1)", lambda s, m, v: (s - 1) / (m + s - 1)),
    "1f1b": ("(S-1)/(M+S-1)", lambda s, m, v: (s - 1) / (m + s - 1)),
    "interleaved_1f1b": ("(S-1)/(V*M+S-1)", lambda s, m, v: (s - 1) / (v * m + s - 1)),
    "zero_bubble": ("(S-1)/(3M+S-1)", lambda s, m, v: (s - 1) / (3 * m + s - 1)),
}


@dataclasses.dataclass(frozen=True)
class Table:
    """A checked schedule table; arrays are [ticks, S] int32 (-1 where nothing applies)."""

    stages: int
    virtual: int
    microbatches: int
    kind: np.ndarray  # IDLE, F, F_LAST, B, W
    microbatch: np.ndarray
    virtual_stage: np.ndarray
    stash_slot: np.ndarray  # the action's stage-input slot
    cot_slot: np.ndarray  # the action's output-cotangent slot (F_LAST writes it, B and W read it)
    recv_forward: np.ndarray  # stash slot the activation arriving from device d-1 at the end of the tick goes to
    recv_backward: np.ndarray  # cotangent slot the input gradient arriving from device d+1 goes to
    in_flight: int  # stage inputs a device keeps at most
    cotangents: int  # output cotangents a device keeps at most
    fused: bool  # each W is its stage's whole backward and the next tick's B only hands its input gradient on

    @property
    def ticks(self) -> int:
        return self.kind.shape[0]

    @property
    def idle_fraction(self) -> float:
        return float((self.kind == IDLE).sum()) / self.kind.size

    def render(self) -> list[str]:
        """One line per device: F0, B1, W2 (microbatch; virtual stage after a dot when V > 1), '-' idle."""
        names = {F: "F", F_LAST: "F", B: "B", W: "W"}
        rows = []
        for d in range(self.stages):
            cells = []
            for t in range(self.ticks):
                k = self.kind[t, d]
                if k == IDLE:
                    cells.append("-")
                    continue
                v = f".{self.virtual_stage[t, d]}" if self.virtual > 1 else ""
                cells.append(f"{names[k]}{self.microbatch[t, d]}{v}")
            rows.append(" ".join(cells))
        return rows


# --------------------------------------------------------------------------------------------- orders per device


def _one_f_one_b(s: int, m: int, d: int) -> list[Action]:
    warm = min(s - d - 1, m)
    order: list[Action] = [("F", i, 0) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i, 0), ("B", i, 0)]
    return order + [("B", i, 0) for i in range(m - warm, m)]


def _gpipe(s: int, m: int, d: int) -> list[Action]:
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def _interleaved(s: int, m: int, v: int, d: int) -> list[Action]:
    """Megatron's interleaved order: the k-th forward of a device runs virtual stage (k // S) % V on microbatch
    (k // (S V)) S + k % S; backwards walk the virtual stages from the last."""
    total = m * v

    def item(k: int, forward: bool) -> Action:
        chunk = (k // s) % v
        mb = (k // (s * v)) * s + k % s
        return ("F", mb, chunk) if forward else ("B", mb, v - 1 - chunk)

    warm = min((s - d - 1) * 2 + (v - 1) * s, total)
    order = [item(k, True) for k in range(warm)]
    for k in range(total - warm):
        order += [item(warm + k, True), item(k, False)]
    return order + [item(k, False) for k in range(total - warm, total)]


# --------------------------------------------------------------------------------------------- simulation


def simulate(s: int, v: int, m: int, orders: Sequence[list[Action]], w_lag: int | None,
             lags: Sequence[int] = ()) -> list[list]:
    """Each device's actions per tick (None: idle), from its order of F and B.

    `w_lag` None: a fused backward, W then B on consecutive ticks, so the input gradient leaves after both (1F1B's
    backward of two units). Otherwise zero-bubble: B alone on the critical path, and device d defers up to
    `lags[d]` W's to the ticks where its next F or B is not ready (one more and the oldest W runs first)."""
    j_last = v * s - 1
    if w_lag is None:
        orders = [[x for a in order for x in ((("W", a[1], a[2]), a) if a[0] == "B" else (a,))] for order in orders]
    done: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, logical stage) -> tick
    pos = [0] * s
    pending: list[list[tuple[int, int]]] = [[] for _ in range(s)]  # (microbatch, logical stage) awaiting W
    timeline: list[list] = [[] for _ in range(s)]
    remaining = sum(len(o) for o in orders) + (0 if w_lag is None else sum(a[0] == "B" for o in orders for a in o))
    t = 0
    while remaining:
        if t > 3 * m * v * s * s + s:
            raise RuntimeError("pipeline schedule deadlocks")  # an order whose dependencies never clear
        acts = []
        for d in range(s):
            act = None
            if pending[d] and len(pending[d]) > lags[d]:
                act = ("W", *pending[d][0])
            elif pos[d] < len(orders[d]):
                kind, mb, vs = orders[d][pos[d]]
                j = vs * s + d
                if kind == "F":
                    ready = j == 0 or done.get(("F", mb, j - 1), t) < t
                else:  # B and W read the stage input and the cotangent of the stage's output
                    ready = done.get(("F", mb, j), t) < t and (j == j_last or done.get(("B", mb, j + 1), t) < t)
                if ready:
                    act = (kind, mb, j)
            if act is None and pending[d]:  # fill the bubble with a deferred weight gradient
                act = ("W", *pending[d][0])
            acts.append(act)
        for d, act in enumerate(acts):
            timeline[d].append(act)
            if act is None:
                continue
            done[act] = t
            remaining -= 1
            if act[0] == "W" and w_lag is not None:
                pending[d].pop(0)
            else:
                pos[d] += 1
                if act[0] == "B" and w_lag is not None:
                    pending[d].append((act[1], act[2]))
        t += 1
    return timeline


# --------------------------------------------------------------------------------------------- checks and slots


def check(s: int, v: int, m: int, timeline: list[list]) -> None:
    """Every (kind, microbatch, logical stage) exactly once, on its device, after what it needs (module docstring)."""
    j_last, when = v * s - 1, {}
    for d, row in enumerate(timeline):
        for t, act in enumerate(row):
            if act is None:
                continue
            kind, mb, j = act
            if j % s != d or act in when:
                raise ValueError(f"{act} on device {d} at tick {t}: wrong device or done twice")
            when[act] = t
    need = {(k, mb, j) for k in "FBW" for mb in range(m) for j in range(v * s)}
    if set(when) != need:
        raise ValueError(f"actions missing from the table: {sorted(need - set(when))[:3]}")
    for (kind, mb, j), t in when.items():
        before = {"F": [("F", mb, j - 1)] if j else [],
                  "B": [("F", mb, j)] + ([("B", mb, j + 1)] if j < j_last else []),
                  "W": [("F", mb, j)] + ([("B", mb, j + 1)] if j < j_last else [])}[kind]
        late = [b for b in before if when[b] >= t]
        if late:
            raise ValueError(f"{(kind, mb, j)} at tick {t} does not follow {late[0]} (tick {when[late[0]]})")


def _assign_slots(intervals: dict[tuple[int, int], tuple[int, int, int]], s: int) -> tuple[dict, int]:
    """Interval colouring per device: (microbatch, j) -> slot, and the most slots any device needs.
    `intervals`: (microbatch, j) -> (device, first tick, last tick), both inclusive."""
    slot, most = {}, 0
    for d in range(s):
        mine = sorted((a, b, key) for key, (dev, a, b) in intervals.items() if dev == d)
        free_at: list[int] = []  # per slot: the first tick it is free again
        for a, b, key in mine:
            for i, f in enumerate(free_at):
                if f <= a:
                    free_at[i], slot[key] = b + 1, i
                    break
            else:
                slot[key] = len(free_at)
                free_at.append(b + 1)
        most = max(most, len(free_at))
    return slot, most


def _table(s: int, v: int, m: int, timeline: list[list], fused: bool) -> Table:
    check(s, v, m, timeline)
    ticks, j_last = len(timeline[0]), v * s - 1
    when = {act: t for row in timeline for t, act in enumerate(row) if act is not None}
    last_use = {(mb, j): max(when[("B", mb, j)], when[("W", mb, j)]) for mb in range(m) for j in range(v * s)}
    stash = {(mb, j): (j % s, when[("F", mb, j - 1)] if j else when[("F", mb, j)], last_use[(mb, j)])
             for mb in range(m) for j in range(v * s)}
    cots = {(mb, j): (j % s, when[("F", mb, j)] if j == j_last else when[("B", mb, j + 1)], last_use[(mb, j)])
            for mb in range(m) for j in range(v * s)}
    stash_slot, in_flight = _assign_slots(stash, s)
    cot_slot, cotangents = _assign_slots(cots, s)
    arrays = {name: np.full((ticks, s), -1, np.int32) for name in
              ("kind", "microbatch", "virtual_stage", "stash_slot", "cot_slot", "recv_forward", "recv_backward")}
    arrays["kind"][:] = IDLE
    codes = {"F": F, "B": B, "W": W}
    for (kind, mb, j), t in when.items():
        d = j % s
        arrays["kind"][t, d] = F_LAST if (kind == "F" and j == j_last) else codes[kind]
        arrays["microbatch"][t, d], arrays["virtual_stage"][t, d] = mb, j // s
        arrays["stash_slot"][t, d] = stash_slot[(mb, j)]
        if kind != "F" or j == j_last:
            arrays["cot_slot"][t, d] = cot_slot[(mb, j)]
        if kind == "F" and j < j_last:  # reaches device (d+1) % S at the end of tick t
            arrays["recv_forward"][t, (d + 1) % s] = stash_slot[(mb, j + 1)]
        if kind == "B" and j > 0:
            arrays["recv_backward"][t, (d - 1) % s] = cot_slot[(mb, j - 1)]
    for name in ("microbatch", "virtual_stage", "stash_slot", "cot_slot"):  # in range in idle ticks too: the
        arrays[name] = np.maximum(arrays[name], 0)  # runner indexes with them before it selects the branch
    if fused and any(when[("B", mb, j)] != when[("W", mb, j)] + 1 for mb in range(m) for j in range(v * s)):
        raise ValueError("a fused backward's B does not follow its W at once")
    return Table(s, v, m, in_flight=in_flight, cotangents=cotangents, fused=fused, **arrays)


def build(name: str, stages: int, virtual: int, microbatches: int) -> Table:
    """The checked table of schedule `name` (module docstring) for S stages, V virtual stages, M microbatches."""
    s, v, m = stages, virtual, microbatches
    if name not in SCHEDULE_NAMES:
        raise ConfigError(f"pipeline_schedule={name!r} is not one of circular, {', '.join(SCHEDULE_NAMES)}")
    if name != "interleaved_1f1b" and v != 1:
        raise ConfigError(f"pipeline_schedule={name} runs one virtual stage per device: num_pipeline_repeats must "
                          f"be 1 (num_layers = stages x num_layers_per_pipeline_stage), got {v}")
    if name == "interleaved_1f1b" and m % s:
        raise ConfigError(f"pipeline_schedule=interleaved_1f1b needs num_pipeline_microbatches={m} to be a multiple "
                          f"of the {s} pipeline stages (microbatches go round in groups of S)")
    if name == "gpipe":
        timeline = simulate(s, v, m, [_gpipe(s, m, d) for d in range(s)], None)
    elif name == "1f1b":
        timeline = simulate(s, v, m, [_one_f_one_b(s, m, d) for d in range(s)], None)
    elif name == "interleaved_1f1b":
        timeline = simulate(s, v, m, [_interleaved(s, m, v, d) for d in range(s)], None)
    else:
        timeline = simulate(s, v, m, [_one_f_one_b(s, m, d) for d in range(s)], 0, list(range(s)))
    return _table(s, v, m, timeline, fused=name != "zero_bubble")
