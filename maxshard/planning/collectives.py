"""Count the collectives of a compiled program from its HLO text (`compiled.as_text()`).

What is counted. Every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute instruction, once
per *execution*: an instruction inside a `while` body counts `known_trip_count` times (a scanned stack of 32 layers
runs its body 32 times, though the text shows it once), and nested loops multiply. Async pairs (`all-gather-start`
/ `all-gather-done`) count once, at the `-done`.

What "bytes" means. The size of the full buffer on one device, the larger side of the instruction:

    all-gather          result   (the gathered array: n x the operand)
    reduce-scatter      operand  (the array before scattering: n x the result)
    all-reduce          operand  (= result)
    all-to-all          operand  (= result)
    collective-permute  operand  (= result)

This is the quantity `estimate.py` plans, independent of the algorithm; the traffic a ring moves is derived from it
there ((n-1)/n x bytes for gathers and scatters, twice that for all-reduce). Tuple-shaped instructions (XLA combines
several small collectives into one) count once, with the bytes of every element.

Copies of one collective. XLA:TPU splits a collective into async-collective fusions and the text then shows the
same instruction (same `channel_id`) in several of them; each channel counts once, at the largest multiplicity of
its copies. Collectives written by hand in `shard_map` may all carry one channel id (XLA:CPU numbers every one of
them 1), so a copy is keyed by its channel *and* its rank among that channel's collectives in its computation: the
n-th one in one fusion is a copy of the n-th in another, and distinct collectives of one computation stay distinct.
Loops without `known_trip_count` (XLA:TPU drops it) run `i < N` from a constant start: N - start times.

The HLO text names operands without their shapes, so each computation keeps a table `%name -> shape` of its
instructions and parameters.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Iterator

__all__ = ["KINDS", "collective_arrays", "count_collectives", "shape_bytes"]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEE = re.compile(r"\b(?:body|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_INDEX = re.compile(r"\bindex=(\d+)")
_ELEMENT = re.compile(r"^\s*%[\w.\-]+#(\d+)\s*,")  # `%param#k`: newer HLO text's element k of a tuple
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape: `f32[8,64]{1,0}` -> 2048; a tuple `(f32[2], bf16[4])` sums its arrays."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in _ITEMSIZE:
            total += _ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    args: str  # the operand list as written: `%a, %b`, or `0` for constant(0)
    rest: str


@dataclasses.dataclass
class _Computation:
    name: str
    shapes: dict[str, str]
    instrs: list[_Instr]


def _params(signature: str) -> dict[str, str]:
    """`p0: f32[2], p1: (s32[], f32[4])` -> {p0: 'f32[2]', p1: '(s32[], f32[4])'} (splits at top-level commas)."""
    shapes, depth, start = {}, 0, 0
    for i, ch in enumerate(signature + ","):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            name, _, shape = signature[start:i].partition(":")
            if shape:
                shapes[name.strip().lstrip("%")] = shape.strip()
            start = i + 1
    return shapes


def _split_call(args_and_attrs: str) -> tuple[str, str]:
    """`%a, %b), channel_id=1, ...` -> ('%a, %b', 'channel_id=1, ...'): the operand list ends at its ')'."""
    depth = 1
    for i, ch in enumerate(args_and_attrs):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return args_and_attrs[:i], args_and_attrs[i + 1 :]
    return args_and_attrs, ""


def _computations(hlo_text: str) -> Iterator[tuple[_Computation, bool]]:
    """(computation, is_entry) for every computation of an HLO module text."""
    current: _Computation | None = None
    is_entry = False
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and current is None:
            current = _Computation(header.group(1), _params(header.group(2)), [])
            is_entry = line.startswith("ENTRY")
        elif line.strip() == "}" and current is not None:
            yield current, is_entry
            current = None
        elif current is not None:
            instr = _INSTR.match(line)
            if instr:
                name, shape, op, tail = instr.groups()
                args, rest = _split_call(tail)
                current.shapes[name] = shape
                current.instrs.append(_Instr(name, shape, op, _OPERAND.findall(args), args, rest))


def _by_name(comp: _Computation, name: str) -> _Instr | None:
    """The instruction `name`, seen through copies (XLA:TPU copies a loop's initial counter)."""
    instr = next((i for i in comp.instrs if i.name == name), None)
    while instr is not None and instr.op == "copy" and len(instr.operands) == 1:
        instr = next((i for i in comp.instrs if i.name == instr.operands[0]), None)
    return instr


def _counted_trips(instr: _Instr, comp: _Computation, comps: dict[str, _Computation]) -> int | None:
    """Trip count of `while (i < N)` started from a constant i, for HLO without `known_trip_count` (XLA:TPU).

    The condition's root must be `compare(get-tuple-element(param, index=k), constant(N)), direction=LT` (or
    `compare(%param#k, constant(N))`, as newer XLA prints it), and element k of the while's initial tuple a
    constant.
    """
    condition = _CONDITION.search(instr.rest)
    cond = comps.get(condition.group(1)) if condition else None
    root = cond.instrs[-1] if cond and cond.instrs else None
    if root is None or root.op != "compare" or "direction=LT" not in root.rest or len(root.operands) != 2:
        return None
    counter, bound = (_by_name(cond, n) for n in root.operands)
    index = _INDEX.search(counter.rest) if counter is not None and counter.op == "get-tuple-element" else None
    index = index or _ELEMENT.match(root.args)
    init = _by_name(comp, instr.operands[0]) if instr.operands else None
    if index is None or bound is None or bound.op != "constant" or init is None or init.op != "tuple":
        return None
    k = int(index.group(1))
    start = _by_name(comp, init.operands[k]) if k < len(init.operands) else None
    if start is None or start.op != "constant" or not (_is_int(bound.args) and _is_int(start.args)):
        return None
    return max(int(bound.args) - int(start.args), 0)


def _is_int(text: str) -> bool:
    return text.strip().lstrip("-").isdigit()


def _callees(instr: _Instr, comp: _Computation, comps: dict[str, _Computation]) -> list[tuple[str, int]]:
    """(called computation, times per execution of `instr`): a while body runs its trip count."""
    times = 1
    if instr.op == "while":
        trips = _TRIP.search(instr.rest)
        times = int(trips.group(1)) if trips else _counted_trips(instr, comp, comps) or 1
    called = [(name, times) for name in _CALLEE.findall(instr.rest)]
    for group in _BRANCHES.findall(instr.rest):  # a conditional: every branch counted once (an upper bound)
        called += [(name, 1) for name in _OPERAND.findall(group)]
    return called


def _multiplicities(comps: dict[str, _Computation], entry: str) -> dict[str, int]:
    """How many times each computation runs per execution of the entry (summed over every call site)."""
    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        if name not in comps:
            return
        runs[name] = runs.get(name, 0) + times
        for instr in comps[name].instrs:
            for callee, n in _callees(instr, comps[name], comps):
                visit(callee, times * n)

    visit(entry, 1)
    return runs


def _kind(op: str) -> str | None:
    base = op[: -len("-done")] if op.endswith("-done") else op
    base = "all-to-all" if base == "ragged-all-to-all" else base  # MoE dispatch with variable sizes
    return base if base in KINDS else None


def _bytes(instr: _Instr, comp: _Computation) -> int:
    """The larger of result and operands; for `-done`, the operands are those of its `-start`."""
    operands = instr.operands
    if instr.op.endswith("-done"):
        start = _by_name(comp, operands[0]) if operands else None
        operands = start.operands if start is not None else []
    operand_bytes = sum(shape_bytes(comp.shapes.get(name, "")) for name in operands)
    return max(shape_bytes(instr.shape), operand_bytes)


def collective_arrays(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array the collectives of an HLO module text produce (a synchronous one's result, an
    asynchronous one's `-done`), once per instruction however often it runs."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for comp, _ in _computations(hlo_text) for instr in comp.instrs if _kind(instr.op)
            for dtype, dims in _ARRAY.findall(instr.shape)]


def count_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{kind: {"count": executions per step, "bytes": full-buffer bytes per device summed over executions}}.

    Every kind of `KINDS` is present (zeros when the program has none).
    """
    comps, entry = {}, ""
    for comp, is_entry in _computations(hlo_text):
        comps[comp.name] = comp
        entry = comp.name if is_entry else entry
    seen: dict[object, tuple[str, int, int]] = {}  # channel -> (kind, runs, bytes)
    for name, times in _multiplicities(comps, entry).items():
        comp, ranks = comps[name], Counter()
        for instr in comp.instrs:
            kind = _kind(instr.op)
            if kind is None:
                continue
            channel = _CHANNEL.search(instr.rest)
            if channel:
                ranks[channel.group(1)] += 1
            key = (int(channel.group(1)), ranks[channel.group(1)]) if channel else (name, instr.name)
            if key not in seen or times > seen[key][1]:
                seen[key] = (kind, times, _bytes(instr, comp))
    result = {kind: {"count": 0, "bytes": 0} for kind in KINDS}
    for kind, times, size in seen.values():
        result[kind]["count"] += times
        result[kind]["bytes"] += times * size
    return result
