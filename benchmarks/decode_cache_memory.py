"""The KV cache's bytes in the compiled decode step as the text grows: a local/global model against the same model
with only global layers.

    python benchmarks/decode_cache_memory.py [--lengths 512 2048 8192 32768] [--batch 8] [--window 256] [k=v ...]

Nothing runs: for each cache length (prompt + new tokens) the generation engine's decode step
(`maxshard/generation/decode.py`, `Engine.compile_decode`) is compiled on one CPU device for abstract weights, and
its `memory_analysis()` gives the step's argument bytes (the weights and the donated cache), its output bytes and
its temporaries. The cache column splits the cache's bytes between the local layers (a ring of `window` slots each,
layers/kv_cache.py) and the global ones (one slot per position). The model is base.yml's default width (emb 128,
4 heads x 32, mlp 512) with 6 layers in Gemma 3's pattern (5 local, 1 global) and the same 6 layers all global.
"""

from __future__ import annotations

import argparse
import math
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

PATTERNS = {"gemma3 (5 local : 1 global)": "[local,local,local,local,local,global]", "all global": "[global]"}
MIB = 2**20


def engine_for(pattern: str, window: int, overrides: Sequence[str]) -> Engine:
    cfg = loading.load_run([common.BASE, *common.STEP_ONLY, "num_layers=6", "attention=dot_product",
                            f"attention_pattern={pattern}", f"sliding_window={window if 'local' in pattern else 0}",
                            *overrides],
                           num_devices=1, check_fit=False)
    generation_mesh, rules = mesh.build(cfg, jax.devices()[:1]), sharding.flax_rules(cfg)
    boxed = abstract_params(cfg.model)
    shardings = sharding.tree_shardings(boxed, generation_mesh, rules)
    params = jax.tree.map(lambda b, s: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=s), nn.unbox(boxed), shardings)
    return Engine(cfg.model, generation_mesh, rules, params, allowed_tokens(cfg.model.vocab_size, 259, (0, 1)))


def cache_bytes(engine: Engine, batch: int, length: int) -> tuple[int, int]:
    """(bytes of the cache leaves shorter than `length`: the local layers' rings, bytes of the others)."""
    local = other = 0
    for leaf in jax.tree.leaves(nn.unbox(engine.abstract_cache(batch, length))):
        size = math.prod(leaf.shape) * leaf.dtype.itemsize
        if leaf.shape[-2] < length:  # [(layers,) batch, kv_heads, slots, head_dim]
            local += size
        else:
            other += size
    return local, other


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args(argv)
    print(f"batch {args.batch}, window {args.window}, float32 cache, one CPU device; MiB")
    print("| model | cache length | local layers' cache | global layers' cache | decode arguments | outputs | "
          "temporaries |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, pattern in PATTERNS.items():
        engine = engine_for(pattern, args.window, args.overrides)
        for length in args.lengths:
            local, other = cache_bytes(engine, args.batch, length)
            figures = engine.compile_decode(args.batch, length)[1].memory_analysis()
            print(f"| {name} | {length:,} | {local / MIB:.2f} | {other / MIB:.2f} | "
                  f"{figures.argument_size_in_bytes / MIB:.2f} | {figures.output_size_in_bytes / MIB:.2f} | "
                  f"{figures.temp_size_in_bytes / MIB:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
