"""Compile time of the train step with 4 vs 32 scanned layers of the same width (target: 32 layers <= 1.3x).

    python benchmarks/compile_time.py [--repeats 2] [--layers 4,32] [key=value ...]

Why it should hold: with `scan_layers=true` the decoder block is traced and compiled once, whatever the depth;
only the stacked parameter shapes grow. A ratio near 1 says no per-layer work leaked out of the scan (an unrolled
loop, a per-layer constraint, an optimizer update per layer would each make compile time grow with depth).

Each measurement builds a fresh Trainer (so no trace or executable is reused), then times `lower` (trace + StableHLO)
and `compile` (XLA) of the jitted train step on abstract inputs with their shardings. Depths alternate within each
repeat and the median per depth is reported, so a slow minute on the shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import flax.linen as nn
import jax

from maxshard import config, data
from maxshard.parallel import mesh
from maxshard.training.step import Trainer

# The 256-wide model, scanned and fully rematerialized, fsdp=8; only num_layers changes between measurements.
MODEL = (*common.WIDE_MODEL, "scan_layers=true", "remat_policy=full", "ici_fsdp_parallelism=8")


def abstract_inputs(trainer: Trainer, cfg: config.Config) -> tuple[Any, Any]:
    """(state, batch) as ShapeDtypeStructs carrying their shardings: lowering needs no real arrays."""
    with_sharding = lambda leaf, s: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)  # noqa: E731
    state = jax.tree.map(with_sharding, nn.unbox(trainer.abstract_state), trainer.state_shardings)
    shape = (cfg.global_batch_size, cfg.max_target_length)
    shardings = trainer.batch_shardings(data.batch_sharding(cfg, trainer.mesh))
    batch = {k: jax.ShapeDtypeStruct(shape, "float32" if k == "loss_weights" else "int32", sharding=s)
             for k, s in shardings.items()}  # fmt: skip
    return state, batch


def measure(layers: int, extra: Sequence[str]) -> tuple[float, float]:
    """(lower seconds, compile seconds) of the train step of a fresh `layers`-deep model."""
    cfg = common.load([common.BASE, *MODEL, *extra, f"num_layers={layers}"])
    trainer = Trainer(cfg, mesh.build(cfg))
    step = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))
    state, batch = abstract_inputs(trainer, cfg)
    start = time.perf_counter()
    lowered = step.lower(state, batch)
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    parser.add_argument("--repeats", type=int, default=2, help="alternating measurements per depth")
    parser.add_argument("--layers", default="4,32", help="two comma-separated depths: shallow,deep")
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.layers.split(",")]
    results: dict[int, list[tuple[float, float]]] = {d: [] for d in depths}
    measure(depths[0], args.overrides)  # warm the process: imports, backend start, first-jit overheads
    for r in range(args.repeats):
        for d in depths if r % 2 == 0 else depths[::-1]:
            results[d].append(measure(d, args.overrides))
            print(f"repeat {r + 1}: {d} layers lower {results[d][-1][0]:.2f} s, compile {results[d][-1][1]:.2f} s",
                  flush=True)  # fmt: skip
    print("| layers | lower s | compile s | total s |\n|---:|---:|---:|---:|")
    totals = {}
    for d, rows in results.items():
        lower, comp = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        totals[d] = statistics.median(r[0] + r[1] for r in rows)
        print(f"| {d} | {lower:.2f} | {comp:.2f} | {totals[d]:.2f} |")
    ratio = totals[depths[-1]] / totals[depths[0]]
    verdict = "meets" if ratio <= 1.3 else "misses"
    print(f"ratio {depths[-1]} / {depths[0]} layers (lower + compile): {ratio:.2f}x ({verdict} the 1.3x target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
