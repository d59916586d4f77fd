"""What XLA's dumps say about a compiled step's memory: its HBM heap and the values live where that heap is fullest.

Why. `memory_analysis()` gives totals, and its temporaries are not the same figure on every libtpu release (0.0.52
reports the heap; 0.0.42.1 and 0.0.50.1 add what their log calls the heap's fragmentation a second time:
benchmarks/README.md, "libtpu 0.0.52: the same heap, reported once"). The buffer assignment XLA writes under
`--xla_dump_to` (`OPTIONS`, passed as compile options) holds the heap itself, the largest `preallocated-temp`
allocation of the default memory space, and every value in it with its size; the live-range dump says when each
is live. The sum of the values live at one instruction is below the heap (it has gaps), and misses a value a while
loop carries under the loop's own names. Used by benchmarks/live_buffers.py and the XLA:TPU tests that check a plan
term against the values the compiler keeps.
"""

from __future__ import annotations

import collections
import glob
import os
import re

__all__ = ["OPTIONS", "options", "live_at_peak"]

# XLA's dump of the optimised train step's module only, as text (the buffer assignment and live ranges with it)
OPTIONS = {"xla_dump_hlo_as_text": True, "xla_dump_hlo_pass_re": "", "xla_dump_hlo_module_re": "train_step"}

_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)")
_RANGE = re.compile(r"^    (\S+):(\d+)-(\d+)$", re.M)


def options(directory: str) -> dict[str, object]:
    """Compile options that dump the train step's buffer assignment and live ranges into `directory`."""
    return {**OPTIONS, "xla_dump_to": directory}


def live_at_peak(directory: str) -> tuple[int, list[tuple[int, str, str]], int]:
    """(the instruction's index, [(bytes, value, shape)] largest first, the heap's bytes): the values of the train
    step's largest temporary allocation in the default memory space live where their sizes sum highest."""
    assignment = _read(directory, "after_optimizations-buffer-assignment.txt")
    ranges = _read(directory, "after_optimizations-live-range.txt")
    allocations = re.split(r"\n(?=allocation \d+:)", assignment)
    heads = [a.split("\n", 1)[0] for a in allocations]
    temps = [a for a, head in zip(allocations, heads) if "preallocated-temp" in head and "color" not in head]
    heap = max(temps, key=lambda a: int(re.search(r"size (\d+)", a).group(1)))
    # the live-range dump names a value by its instruction and shape index ("fusion.3{}", "fusion.4{1}")
    values = [(name if "{" in name else name + "{}", int(size), shape) for name, size, shape in _VALUE.findall(heap)]
    span = {name: (int(start), int(end)) for name, start, end in _RANGE.findall(ranges)}
    totals: collections.Counter[int] = collections.Counter()
    for name, size, _ in values:
        start, end = span[name]
        for t in range(start, end + 1):
            totals[t] += size
    peak = max(totals, key=totals.__getitem__)
    live = sorted(((size, name, shape) for name, size, shape in values if span[name][0] <= peak <= span[name][1]),
                  reverse=True)
    return peak, live, int(re.search(r"size (\d+)", heap).group(1))


def _read(directory: str, suffix: str) -> str:
    """The train step's dump file ending in `suffix`."""
    with open(glob.glob(os.path.join(directory, f"*train_step*{suffix}"))[0]) as f:
        return f.read()
