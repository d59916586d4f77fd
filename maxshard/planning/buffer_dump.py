"""What XLA's dumps say about a compiled step's memory: its HBM heap and the values live where that heap is fullest.

Why. `memory_analysis()` gives totals, and its temporaries are not the same figure on every libtpu release (some
report the heap, older ones add what their log calls the heap's fragmentation a second time: benchmarks/README.md,
"The same heap, reported once"). The buffer assignment XLA writes under
`--xla_dump_to` (`OPTIONS`, passed as compile options) holds the heap itself, the largest `preallocated-temp`
allocation of the default memory space, and every value in it with its size; the live-range dump says when each
is live. The bytes of the buffers live at one instruction are below the heap by its gaps: what XLA's placement of
buffers of different lifetimes leaves unusable. Used by benchmarks/live_buffers.py, benchmarks/pipeline_memory.py
and the XLA:TPU tests that check a plan term or a schedule against the buffers the compiler keeps.
"""

from __future__ import annotations

import collections
import glob
import os
import re

__all__ = ["OPTIONS", "options", "live_at_peak"]

# XLA's dump of the optimised train step's module only, as text (the buffer assignment and live ranges with it)
OPTIONS = {"xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "", "xla_dump_hlo_module_re": "train_step"}

# a value of the heap: its instruction and shape index, "(phi)" for what a loop carries, its size, offset and shape
_VALUE = re.compile(r"value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_RANGE = re.compile(r"^    (\S+):(\d+)-(\d+)$", re.M)


def options(directory: str) -> dict[str, object]:
    """Compile options that dump the train step's buffer assignment and live ranges into `directory`."""
    return {**OPTIONS, "xla_dump_to": directory}


def live_at_peak(directory: str) -> tuple[int, list[tuple[int, str, str]], int]:
    """(the instruction's index, [(bytes, value, shape)] largest first, the heap's bytes): the buffers of the train
    step's largest temporary allocation in the default memory space live where their bytes sum highest.

    A buffer is a range of the heap (offset, size); several values can name it at once (a while loop's result, its
    body's parameter and what the body returns are one buffer), so each buffer counts once at each instruction,
    under the name of its largest-ranged value live there."""
    assignment = _read(directory, "after_optimizations-buffer-assignment.txt")
    ranges = _read(directory, "after_optimizations-live-range.txt")
    allocations = re.split(r"\n(?=allocation \d+:)", assignment)
    heads = [a.split("\n", 1)[0] for a in allocations]
    temps = [a for a, head in zip(allocations, heads) if "preallocated-temp" in head and "color" not in head]
    heap = max(temps, key=lambda a: int(re.search(r"size (\d+)", a).group(1)))
    span = {name: (int(start), int(end)) for name, start, end in _RANGE.findall(ranges)}
    # the live-range dump names a value by its instruction and shape index ("fusion.3{}", "fusion.4{1}")
    buffers: dict[tuple[int, int], list[tuple[str, str]]] = collections.defaultdict(list)
    for name, size, offset, shape in _VALUE.findall(heap):
        buffers[int(offset), int(size)].append((name if "{" in name else name + "{}", shape))
    live_times = {key: set().union(*(range(span[n][0], span[n][1] + 1) for n, _ in named))
                  for key, named in buffers.items()}
    totals: collections.Counter[int] = collections.Counter()
    for (_, size), times in live_times.items():
        for t in times:
            totals[t] += size
    peak = max(totals, key=totals.__getitem__)
    live = []
    for (offset, size), named in buffers.items():
        if peak in live_times[offset, size]:
            name, shape = max((n for n in named if span[n[0]][0] <= peak <= span[n[0]][1]),
                              key=lambda n: span[n[0]][1] - span[n[0]][0])
            live.append((size, name, shape))
    return peak, sorted(live, reverse=True), int(re.search(r"size (\d+)", heap).group(1))


def _read(directory: str, suffix: str) -> str:
    """The train step's dump file ending in `suffix`."""
    with open(glob.glob(os.path.join(directory, f"*train_step*{suffix}"))[0]) as f:
        return f.read()
