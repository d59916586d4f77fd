"""Compiled FLOPs of blockwise attention with a sliding window against the window-proportional ideal.

    python benchmarks/attention_window.py [--length 32768] [--window 1024] [--blocks 512 256 128] [--heads 8]
                                          [--head-dim 128] [--time-length 8192] [--repeats 3]

One row of float32 q [1, L, heads, head_dim], k/v [1, L, heads, head_dim] (one document), causal with a window of W
keys (query i sees keys i - W < j <= i), `attention_ops.blockwise` at each block size (block_q = block_kv). Ideal:
every query meets exactly W keys, 2 flops per multiply-add of q.k and of p.v: forward 4 L W head_dim heads; the
backward recomputes q.k and takes dv, dp, dk and dq, five products: 10 L W head_dim heads.

How the FLOPs are counted. XLA's `cost_analysis()` counts a `while_loop` body once, whatever its trip count: the
script prints that figure for the whole 32k forward, and it equals the one-block program's (the body once). So
the count is (block pairs the kernel visits) x (FLOPs of one visited pair). The pairs visited are those where
`blockwise_attention._needed` holds (the loops run over `_span` of them and `cond` skips the rest at no FLOPs),
counted with the kernel's own functions on the real token indices; the FLOPs of one pair are `cost_analysis()` of
the same kernel compiled at length = one block (one q block x one key block: the matmuls, mask, exp and the
rescaling, plus the once-per-q-block normalisation, so a slight over-count). Nothing runs; it compiles for the host
CPU (the FLOP count of a program does not depend on the backend's speed).

A check that the count is what runs: the forward is also timed on the host CPU at --time-length tokens (2 heads,
the smallest block), with the window and without (causal over the whole length); the time ratio should follow the
ratio of visited pairs (within the machine's noise).

The target: forward <= 1.2x the ideal at 32k tokens with a 1k window. The waste is the key blocks a query block
straddles: a q block of B tokens needs W + B - 1 keys rounded up to whole key blocks, (W + B) / W of the ideal,
so the block must be small against the window (128 at W = 1024: 9 blocks of 128 for 1024 keys, 1.125x).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from maxshard.model.layers import attention_ops as ops  # noqa: E402
from maxshard.model.layers import blockwise_attention as bw  # noqa: E402


def flops(fn, length: int, heads: int, head_dim: int) -> float:
    """XLA's cost_analysis FLOPs of `fn(q, k, v, segments)` compiled for [1, length, heads, head_dim] inputs."""
    x = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, length), jnp.int32)
    analysis = jax.jit(fn).lower(x, x, x, seg).compile().cost_analysis()
    return float((analysis[0] if isinstance(analysis, list) else analysis)["flops"])


def forward_fn(block: int, window: int):
    return lambda q, k, v, s: ops.blockwise(q, k, v, s, s, block_q=block, block_kv=block, window=window)


def backward_fn(block: int, window: int):
    """The custom VJP's backward alone (`bw.backward`); its out, lse and dout are stand-ins (FLOPs do not depend on
    the values), so no forward is in the program."""

    def fn(q, k, v, s):
        idx = jnp.arange(q.shape[1], dtype=jnp.int32)
        qg = q[:, :, :, None]  # [b, L, heads, group 1, d]
        lse = jnp.zeros((q.shape[0], q.shape[2], 1, q.shape[1]), jnp.float32)
        return bw.backward(qg, k, v, s, s, idx, idx, qg, lse, qg, None, block, block, window)

    return fn


def visited_pairs(length: int, block: int, window: int) -> int:
    """Block pairs (q block, key block) the kernel computes: where `_needed` holds, on the kernel's own indices."""
    idx = jnp.arange(length, dtype=jnp.int32).reshape(-1, block)
    return int(jnp.sum(bw._needed(idx[:, None], idx[None], window)))


def timed_forward(length: int, block: int, window: int, heads: int, dim: int, repeats: int) -> float:
    """Median wall seconds of the jitted forward on random inputs (after one warm-up call)."""
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, length, heads, dim), jnp.float32) for key in keys)
    segments = jnp.ones((1, length), jnp.int32)
    fn = jax.jit(forward_fn(block, window))
    fn(q, k, v, segments).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(q, k, v, segments).block_until_ready()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--blocks", type=int, nargs="+", default=[512, 256, 128])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--time-length", type=int, default=8192, help="0: no timing")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    length, window, heads, dim = args.length, args.window, args.heads, args.head_dim
    ideal_fwd, ideal_bwd = 4 * length * window * dim * heads, 10 * length * window * dim * heads

    whole = flops(forward_fn(args.blocks[-1], window), length, heads, dim)
    one = flops(forward_fn(args.blocks[-1], window), args.blocks[-1], heads, dim)
    print(f"cost_analysis of the whole {length}-token forward: {whole / 1e9:.4f} GFLOP; of the one-block program: "
          f"{one / 1e9:.4f} GFLOP (the loop bodies counted once)\n")
    print(f"L={length} W={window} heads={heads} head_dim={dim}; ideal forward {ideal_fwd / 1e9:.1f} GFLOP, "
          f"backward {ideal_bwd / 1e9:.1f} GFLOP\n")
    print("| block | pairs visited | of all causal pairs | forward GFLOP | forward / ideal | backward GFLOP | "
          "backward / ideal |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for block in args.blocks:
        pairs = visited_pairs(length, block, window)
        causal = visited_pairs(length, block, 0)
        fwd = pairs * flops(forward_fn(block, window), block, heads, dim)
        bwd = pairs * flops(backward_fn(block, window), block, heads, dim)
        print(f"| {block} | {pairs:,} | {pairs / causal:.3f} | {fwd / 1e9:.1f} | {fwd / ideal_fwd:.3f} | "
              f"{bwd / 1e9:.1f} | {bwd / ideal_bwd:.3f} |")

    if args.time_length:
        block, tl = args.blocks[-1], args.time_length
        local, whole = (timed_forward(tl, block, w, 2, dim, args.repeats) for w in (window, 0))
        pairs = visited_pairs(tl, block, window) / visited_pairs(tl, block, 0)
        print(f"\nforward on this CPU at {tl} tokens, 2 heads, {block}-token blocks: window {local:.2f} s, causal "
              f"{whole:.2f} s, ratio {local / whole:.3f} (visited pairs ratio {pairs:.3f})")


if __name__ == "__main__":
    main()
