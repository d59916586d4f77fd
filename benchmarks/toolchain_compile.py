"""One train step compiled ahead of time with XLA:TPU on whichever toolchain runs this script: its versions and the
compiled program's per-device memory and collectives, as one JSON line (and a benchmarks/README.md table row).

    flock /tmp/tpu_compile.lock python benchmarks/toolchain_compile.py [--topology v6e-256] [key=value ...]

Run it with each interpreter whose pip resolves a different jax / libtpu (docs/toolchains.md, "Which Python gives
which toolchain") to see what the toolchain alone changes: the config, the code and the target are the same, only
XLA:TPU differs. The default is the 8b preset (Llama-3.1-8B shape) at Llama 3's v6e recipe, 4 x 8192 tokens per
chip with `remat_policy: full` (what `auto` picks there), as docs/planning.md's `maxshard.plan --compile` example.

Peak is `planning/compiled.py`'s (arguments + temporaries + outputs - donated); collective bytes are per device
per step with a scanned loop's body counted once per layer (`planning/collectives.py`). Nothing is allocated and no
TPU is needed (libtpu describes the slice: `planning/tpu_compile.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the abstract TPU devices come from libtpu, not from a backend

from maxshard.launch import topologies  # noqa: E402
from maxshard.parallel import mesh  # noqa: E402
from maxshard.planning.collectives import count_collectives  # noqa: E402
from maxshard.planning.compiled import compile_train_step, peak_bytes  # noqa: E402
from maxshard.planning.tpu_compile import abstract_devices  # noqa: E402
from maxshard.run.target import load_for_target  # noqa: E402

RECIPE_8B = ("model_name=8b", "per_device_batch_size=4", "remat_policy=full")
PACKAGES = ("jax", "jaxlib", "libtpu", "flax")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v6e-256")
    parser.add_argument("overrides", nargs="*", help="key=value for configs/base.yml (default: the 8b recipe)")
    args = parser.parse_args()
    target = topologies.parse(args.topology, 1)
    cfg = load_for_target([os.path.join(REPO, "configs", "base.yml"), *(args.overrides or RECIPE_8B)], target)
    devices = abstract_devices(target)
    started = time.perf_counter()
    compiled = compile_train_step(cfg, mesh.build(cfg, devices))
    seconds = time.perf_counter() - started
    stats = compiled.memory_analysis()
    collectives = count_collectives(compiled.as_text())
    gib = lambda n: round(n / 2**30, 2)  # noqa: E731
    row = {
        "python": platform.python_version(), **{p: metadata.version(p) for p in PACKAGES},
        "topology": args.topology, "overrides": list(args.overrides or RECIPE_8B),
        "peak_gib": gib(peak_bytes(stats)), "temp_gib": gib(stats.temp_size_in_bytes),
        "argument_gib": gib(stats.argument_size_in_bytes), "output_gib": gib(stats.output_size_in_bytes),
        "alias_gib": gib(stats.alias_size_in_bytes),
        "collective_gib": gib(sum(c["bytes"] for c in collectives.values())),
        "collectives_gib": {k: gib(c["bytes"]) for k, c in collectives.items() if c["count"]},
        "compile_seconds": round(seconds, 1),
    }
    print(json.dumps(row))
    print(f"| {row['python']} | {row['jax']} | {row['libtpu']} | {row['peak_gib']} GiB | {row['temp_gib']} GiB | "
          f"{row['collective_gib']} GiB | {row['compile_seconds']} s |")


if __name__ == "__main__":
    main()
