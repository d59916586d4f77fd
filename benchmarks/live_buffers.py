"""Which buffers are live at the peak of a train step compiled for a TPU slice: the evidence behind a planner term.

Compiles the step ahead of time (libtpu, no TPU) with XLA's dumps on (`--xla_dump_to`: the buffer assignment after
optimisation and the live range of every value over the scheduled program), then prints the planned and compiled
peaks and the buffers of the largest temporary allocation live at the instruction where their bytes sum highest,
largest first (each under one of the values naming it: a loop's carried buffer is one buffer), and that sum by
shape. The sum is below XLA's allocation by the gaps its placement leaves, and XLA:TPU's `memory_analysis()`
temporaries before libtpu 0.0.52 exceed the allocation further: the live set says which values make the peak.

    flock /tmp/tpu_compile.lock python benchmarks/live_buffers.py --topology v6e-256 --dump /tmp/mixtral \\
        model_name=mixtral_8x7b per_device_batch_size=12

(benchmarks/README.md, "Mixtral 8x7B on v6e-256"; the whole Mixtral step takes 2-10 minutes to compile.)
"""

from __future__ import annotations

import argparse
import collections
import re

import common  # noqa: F401 - the repository on sys.path

from maxshard.launch import topologies
from maxshard.parallel import mesh
from maxshard.planning import buffer_dump, estimate
from maxshard.planning.compiled import compile_train_step, peak_bytes
from maxshard.planning.tpu_compile import abstract_devices
from maxshard.run.target import load_for_target

def compile_with_dump(argv: list[str], topology: str, dump: str) -> tuple[int, int, int]:
    """(planned, compiled peak, reported temporaries) bytes per device of the step, its buffer assignment and live
    ranges under `dump`."""
    target = topologies.parse(topology)
    cfg = load_for_target([common.BASE, *argv], target)
    step = compile_train_step(cfg, mesh.build(cfg, abstract_devices(target)), buffer_dump.options(dump))
    stats = step.memory_analysis()
    return estimate.make_plan(cfg, target).peak_bytes, peak_bytes(stats), stats.temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", required=True, help="a TPU slice: v6e-256, v5litepod-8, ...")
    parser.add_argument("--dump", required=True, help="an empty directory for XLA's dumps")
    parser.add_argument("--top", type=int, default=20, help="values to list (default 20)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of configs/base.yml")
    args = parser.parse_args()
    planned, compiled, temp = compile_with_dump(args.overrides, args.topology, args.dump)
    print(f"planned {planned / 2**30:.2f} GiB, compiled {compiled / 2**30:.2f} GiB per device "
          f"(planned / compiled {planned / compiled:.3f})")
    peak, live, allocated = buffer_dump.live_at_peak(args.dump)
    print(f"live at instruction {peak}: {sum(v[0] for v in live) / 2**30:.2f} GiB in {len(live)} values, of a "
          f"{allocated / 2**30:.2f} GiB temporary allocation")
    # libtpu before 0.0.52 reports the heap plus what its log calls the heap's fragmentation as its temporaries;
    # 0.0.52 the heap (benchmarks/README.md, "The same heap, reported once")
    on_heap = compiled - temp + allocated
    print(f"reported temporaries {temp / 2**30:.3f} GiB, the heap {allocated / 2**30:.3f} GiB: the peak on the heap "
          f"{on_heap / 2**30:.3f} GiB (planned / that {planned / on_heap:.3f})")
    for size, name, shape in live[:args.top]:
        print(f"  {size / 2**20:9.1f} MiB  {name:<32} {shape}")
    by_shape = collections.Counter()
    for size, _, shape in live:
        by_shape[re.sub(r"\{.*", "", shape)] += size
    print("by shape:")
    for shape, size in by_shape.most_common(args.top):
        print(f"  {size / 2**20:9.1f} MiB  {shape}")


if __name__ == "__main__":
    main()
