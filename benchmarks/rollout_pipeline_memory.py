"""GRPO's sampling from a pipelined model: the decode step's memory on the training mesh, pipelined or not.

    python benchmarks/rollout_pipeline_memory.py [--layouts fsdp=8 stage=2,fsdp=4 ...] [--batch 64] [k=v ...]

Nothing runs: for each layout of 8 simulated CPU devices the generation engine (`maxshard/generation/decode.py`)
is built, as GRPO's rollouts build it, on the training mesh for the train state's own (abstract) parameters, and its
decode step is compiled; `memory_analysis()` gives the step's argument bytes (the weights, the donated cache), and
its temporaries. A pipelined model's stack arrives as [repeats, stages, layers per stage, ...] split over `stage`
and is read as the scanned stack inside the step; the columns say what XLA makes of that: the per-device share of
the stack's weights and of the cache, the temporaries, and the all-gathers in the step. The model is base.yml's
default width (emb 128, 4 heads x 32, mlp 512) with 8 layers; the cache holds `--length` slots per sequence.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence

import common  # noqa: F401  (first: 8 simulated devices, the repository on sys.path)
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402

from maxshard.generation.decode import Engine  # noqa: E402
from maxshard.generation.sampling import allowed_tokens  # noqa: E402
from maxshard.model.transformer import abstract_params  # noqa: E402
from maxshard.parallel import mesh, sharding  # noqa: E402
from maxshard.run import loading  # noqa: E402

MIB = 2**20
KNOBS = {"stage": "ici_pipeline_parallelism", "fsdp": "ici_fsdp_parallelism", "tensor": "ici_tensor_parallelism"}


def engine_for(layout: str, overrides: Sequence[str]) -> tuple[Engine, float]:
    """(the engine on the layout's 8-device mesh for abstract train-state parameters, MiB of the stack per device)."""
    knobs = [f"{KNOBS[axis]}={size}" for axis, size in (item.split("=") for item in layout.split(","))]
    cfg = loading.load_run([common.BASE, *common.STEP_ONLY, "num_layers=8", "attention=dot_product", *knobs,
                            *overrides], num_devices=8, check_fit=False)
    run_mesh, rules = mesh.build(cfg, jax.devices()[:8]), sharding.flax_rules(cfg)
    boxed = abstract_params(cfg.model)
    shardings = sharding.tree_shardings(boxed, run_mesh, rules)
    params = jax.tree.map(lambda b, s: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=s), nn.unbox(boxed), shardings)
    stack = sum(math.prod(s.shard_shape(p.shape)) * p.dtype.itemsize
                for p, s in zip(jax.tree.leaves(params["decoder"]), jax.tree.leaves(shardings["decoder"])))
    engine = Engine(cfg.model, run_mesh, rules, params, allowed_tokens(cfg.model.vocab_size, 259, (0, 1)))
    return engine, stack / MIB


def cache_per_device(engine: Engine, batch: int, length: int) -> float:
    boxed = engine.abstract_cache(batch, length)
    shardings = sharding.tree_shardings(boxed, engine.mesh, engine.rules)
    leaves = zip(jax.tree.leaves(nn.unbox(boxed)), jax.tree.leaves(shardings))
    return sum(math.prod(s.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf, s in leaves) / MIB


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    parser.add_argument("--layouts", nargs="+", default=["fsdp=8", "stage=2,fsdp=4", "stage=4,fsdp=2"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args(argv)
    print(f"batch {args.batch}, {args.length} cache slots, float32, 8 simulated CPU devices; MiB per device")
    print("| layout | stack weights | cache | decode arguments | temporaries | all-gathers |")
    print("|---|---:|---:|---:|---:|---:|")
    for layout in args.layouts:
        engine, stack = engine_for(layout, args.overrides)
        cache = cache_per_device(engine, args.batch, args.length)
        step = engine.compile_decode(args.batch, args.length)[1]
        figures, gathers = step.memory_analysis(), len(re.findall(r" all-gather\(", step.as_text()))
        print(f"| {layout} | {stack:.2f} | {cache:.2f} | {figures.argument_size_in_bytes / MIB:.2f} | "
              f"{figures.temp_size_in_bytes / MIB:.2f} | {gathers} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
