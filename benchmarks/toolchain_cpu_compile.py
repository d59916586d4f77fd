"""XLA:CPU compile cost of a small train step on whichever toolchain runs this script: what the test suite, which is
bound by compiling small programs on the CPU, pays for the jax that the interpreter's pip resolves
(docs/toolchains.md, "Which Python gives which toolchain").

    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" python benchmarks/toolchain_cpu_compile.py

XLA_FLAGS as tests/conftest.py sets them: jax 0.10.2 (Python 3.11) accepts both; jax 0.12 (Python 3.12) has no
`--xla_cpu_use_fusion_emitters` and aborts on it, so there name only the optimization level. CPU seconds (this
process's user + system time, which counts XLA's compile threads) are the figure to compare on a shared machine:
wall time there depends on what else runs. Each layout is compiled from a fresh config and mesh `--repeats` times;
the median is printed, one JSON line per layout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import jax

from maxshard.parallel import mesh
from maxshard.planning.compiled import compile_train_step

LAYOUTS = {"fsdp=8": ("ici_fsdp_parallelism=8",),
           "fsdp=4 tensor=2": ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for name, layout in LAYOUTS.items():
        cpu, wall = [], []
        for _ in range(args.repeats):
            cfg = common.load([common.BASE, *common.SMALL_MODEL, *layout, "remat_policy=full"])
            start_cpu, start_wall = cpu_seconds(), time.perf_counter()
            compile_train_step(cfg, mesh.build(cfg, jax.devices()[: cfg.num_devices]))
            cpu.append(cpu_seconds() - start_cpu)
            wall.append(time.perf_counter() - start_wall)
        print(json.dumps({"jax": jax.__version__, "layout": name, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                          "compile_cpu_s": round(statistics.median(cpu), 2),
                          "compile_wall_s": round(statistics.median(wall), 2)}))


if __name__ == "__main__":
    main()
