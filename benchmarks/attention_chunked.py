"""Time of a chunked attention layer (Llama 4) on the host CPU: the layer's call against its chunk cut alone and a
global layer.

    python benchmarks/attention_chunked.py [--length 8192] [--chunk 512] [--heads 4] [--head-dim 64] [--block 256]
                                           [--repeats 3]

One row of float32 q, k, v [1, L, heads, head_dim] (one document), `attention_ops.blockwise` forward, three ways:

  layer    what `layers/attention.py` passes a chunked layer: the segment ids cut at chunk boundaries
           (`chunked_segments`) and a window of the chunk's size, a superset of the chunk, so the kernel skips the
           key blocks before it
  cut      the cut segment ids alone: the same numbers (tests/test_attention_chunked.py), every causal key block
           visited and masked
  global   a global causal layer over the whole length

The kernel skips by the window; the chunk's mask inside the visited blocks is the segments'. Target: layer well
below cut, near chunk / (length / 2) of it plus the blocks the window straddles.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from maxshard.model.layers import attention_ops as ops  # noqa: E402
from maxshard.model.layers.attention import chunked_segments  # noqa: E402


def _seconds(fn, args, repeats: int) -> float:
    """Median wall seconds of `fn(*args)` over `repeats` runs after one that compiles."""
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    q = jax.random.normal(jax.random.PRNGKey(0), (1, args.length, args.heads, args.head_dim)) * args.head_dim ** -0.5
    positions = jnp.arange(args.length, dtype=jnp.int32)[None]
    whole = jnp.ones((1, args.length), jnp.int32)
    cut = chunked_segments(whole, positions, args.chunk)
    ways = {"layer": (cut, args.chunk), "cut": (cut, 0), "global": (whole, 0)}
    times = {}
    for name, (segments, window) in ways.items():
        fn = jax.jit(lambda q, s, window=window: ops.blockwise(q, q, q, s, s, block_q=args.block,
                                                              block_kv=args.block, window=window))
        times[name] = _seconds(fn, (q, segments), args.repeats)
    print(f"blockwise forward, {args.length} tokens, chunks of {args.chunk}, {args.heads} heads x {args.head_dim}, "
          f"{args.block}-token blocks, median of {args.repeats}:")
    for name, seconds in times.items():
        print(f"  {name:<7} {seconds:.3f} s   {seconds / times['cut']:.3f} of cut")


if __name__ == "__main__":
    main()
