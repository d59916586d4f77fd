"""MaxText's `train_compile` and maxshard's train step for the same model and target, compiled ahead of time with
the same XLA:TPU on this CPU: per-device compiled peak, temporaries and collective bytes, one JSON line per system.

    flock /tmp/tpu_compile.lock python benchmarks/maxtext_tpu_compile.py maxtext
    flock /tmp/tpu_compile.lock python benchmarks/maxtext_tpu_compile.py maxshard

Both need one venv holding both packages, so that jax and libtpu are the same: MaxText from PyPI needs Python 3.12
(`python3.12 -m venv V && V/bin/pip install "maxtext[tpu]" && V/bin/pip install --no-deps -e .`; README.md, "Which
Python gives which toolchain"). Each system runs in its own process (one 8B compile at a time is what a 24 GiB
machine holds). The recipe is Llama 3.1 8B at 4 x 8192 tokens per chip on v6e-256, FSDP over all 256 chips, full
rematerialization: MaxText's `llama3.1-8b` model with those keys, maxshard's 8b preset with the same
(`toolchain_compile.RECIPE_8B`).

MaxText's program is the one its `train_compile.main` compiles (its config, mesh, shardings and compiler options):
the module function that compiles is wrapped to keep the compiled object, nothing else changes. Peaks are
`planning/compiled.py`'s (arguments + temporaries + outputs - donated) and collective bytes per device per step
(`planning/collectives.py`) for both, from the same `memory_analysis()` and HLO text. FLOPs are not compared: a
scanned loop's body is counted once by `cost_analysis()`, so they are not comparable across programs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toolchain_compile  # noqa: E402  (puts the repository on sys.path; JAX_PLATFORMS=cpu)

from maxshard.planning.collectives import count_collectives  # noqa: E402
from maxshard.planning.compiled import peak_bytes  # noqa: E402

TOPOLOGY = "v6e-256"
MAXTEXT_RECIPE = ("model_name=llama3.1-8b", "per_device_batch_size=4", "max_target_length=8192",
                  "remat_policy=full", "ici_fsdp_parallelism=-1", "dataset_type=synthetic", "enable_checkpointing=false",
                  f"compile_topology={TOPOLOGY}", "compile_topology_num_slices=1", "run_name=maxtext_tpu_compile")


def maxtext_compiled() -> Any:
    """The train step MaxText's `train_compile.main` compiles for MAXTEXT_RECIPE."""
    from maxtext.trainers.pre_train import train_compile

    # libtpu on a machine without a TPU: no metadata server, no chip lock (as maxshard/planning/tpu_compile.py).
    for variable, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                            ("TPU_ACCELERATOR_TYPE", TOPOLOGY), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(variable, value)
    kept, compile_step = [], train_compile.jit_and_compile
    train_compile.jit_and_compile = lambda *a, **k: kept.append(compile_step(*a, **k)) or kept[-1]
    base = os.path.join(os.path.dirname(train_compile.__file__), "..", "..", "configs", "base.yml")
    train_compile.main(["train_compile", os.path.normpath(base), *MAXTEXT_RECIPE])
    return kept[-1]


def maxshard_compiled() -> Any:
    """maxshard's train step for the same recipe (toolchain_compile's 8b on v6e-256)."""
    from maxshard.launch import topologies
    from maxshard.parallel import mesh
    from maxshard.planning.compiled import compile_train_step
    from maxshard.planning.tpu_compile import abstract_devices
    from maxshard.run.target import load_for_target

    target = topologies.parse(TOPOLOGY, 1)
    cfg = load_for_target([os.path.join(toolchain_compile.REPO, "configs", "base.yml"), *toolchain_compile.RECIPE_8B],
                          target)
    return compile_train_step(cfg, mesh.build(cfg, abstract_devices(target)))


def main() -> None:
    system = sys.argv[1] if len(sys.argv) > 1 else ""
    if system not in ("maxtext", "maxshard"):
        sys.exit("usage: maxtext_tpu_compile.py maxtext|maxshard")
    started = time.perf_counter()
    compiled = maxtext_compiled() if system == "maxtext" else maxshard_compiled()
    seconds = time.perf_counter() - started
    stats, collectives = compiled.memory_analysis(), count_collectives(compiled.as_text())
    gib = lambda n: round(n / 2**30, 2)  # noqa: E731
    print(json.dumps({
        "system": system, **{p: toolchain_compile.metadata.version(p) for p in toolchain_compile.PACKAGES},
        "topology": TOPOLOGY, "peak_gib": gib(peak_bytes(stats)), "temp_gib": gib(stats.temp_size_in_bytes),
        "argument_gib": gib(stats.argument_size_in_bytes), "collective_gib": gib(sum(c["bytes"] for c in
                                                                                  collectives.values())),
        "collectives_gib": {k: gib(c["bytes"]) for k, c in collectives.items() if c["count"]},
        "seconds": round(seconds, 1),
    }))


if __name__ == "__main__":
    main()
