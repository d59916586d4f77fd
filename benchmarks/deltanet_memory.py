"""One layer's training step, gated DeltaNet against full attention: compiled memory and step time by length.

    python benchmarks/deltanet_memory.py [--lengths 4096 16384 65536] [--repeats 3] [--time-limit-gib 2]
                                         [--time-attention-up-to 16384] [--skip-dot-product-from 65536]

One row of L tokens (batch 1, one document), one layer on one CPU device, float32: `GatedDeltaNet`
(layers/gated_deltanet.py; 2 key heads, 4 value heads, 16 wide each, chunks of `delta_chunk_size`) against
`Attention` (layers/attention.py; 4 heads x 16, causal) with attention=blockwise (512 x 512 blocks) and
attention=dot_product, embed 64. The step is the gradient of sum(layer(x) * cotangent) with respect to the
layer's parameters and x: forward and backward. It is lowered from abstract arguments and compiled;
`memory_analysis().temp_size_in_bytes` is what it needs beyond its arguments and outputs. Then, where those
temporaries are under --time-limit-gib (and, for attention, up to --time-attention-up-to tokens), it runs on real
arrays: the median of --repeats runs after one warm-up.

The DeltaNet layer's temporaries should grow linearly with L ([chunks, chunk, chunk] blocks and one [dk, dv] state
per chunk for the backward pass); dot_product's quadratically; blockwise's linearly (its scores are one block
pair at a time), but its work grows with L squared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from maxshard.model.layers.attention import Attention  # noqa: E402
from maxshard.model.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from maxshard.spec.model_config import ModelConfig  # noqa: E402

MIB = 2**20
WIDTHS = dict(vocab_size=128, emb_dim=64, num_heads=4, num_kv_heads=4, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)


def layer(kind: str, length: int) -> tuple[object, ModelConfig]:
    """The layer of `kind` ("deltanet", or an attention implementation) and its config, for rows of `length`."""
    if kind == "deltanet":
        cfg = ModelConfig(**WIDTHS, max_target_length=length)
        return GatedDeltaNet(cfg, jnp.float32, jnp.float32), cfg
    cfg = ModelConfig(**WIDTHS, max_target_length=length, attention=kind)
    return Attention(cfg, jnp.float32, jnp.float32), cfg


def compiled_step(kind: str, length: int) -> tuple[object, tuple[jax.Array, ...]]:
    """(the compiled step, abstract arguments): d(sum(layer(x) * cotangent)) / d(params, x)."""
    module, cfg = layer(kind, length)
    x = jax.ShapeDtypeStruct((1, length, cfg.emb_dim), jnp.float32)
    ints = jax.ShapeDtypeStruct((1, length), jnp.int32)
    zeros = jnp.zeros(ints.shape, jnp.int32)
    params = nn.unbox(jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros(x.shape), zeros + 1,
                                                         zeros))["params"])

    def loss(p, x, cotangent, segments, positions):
        return jnp.sum(module.apply({"params": p}, x, segments, positions) * cotangent)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    args = (params, x, x, ints, ints)
    return step.lower(*args).compile(), args


def run_seconds(compiled: object, args: tuple, repeats: int) -> float:
    """Median wall seconds of `repeats` runs after one warm-up, on random arrays of the arguments' shapes."""
    rng = np.random.default_rng(0)
    params, x, cotangent, ints, _ = args
    concrete = (jax.tree.map(lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), params),
                jnp.asarray(rng.standard_normal(x.shape), jnp.float32),
                jnp.asarray(rng.standard_normal(cotangent.shape), jnp.float32),
                jnp.ones(ints.shape, jnp.int32), jnp.broadcast_to(jnp.arange(ints.shape[1], dtype=jnp.int32),
                                                                  ints.shape))
    jax.block_until_ready(compiled(*concrete))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*concrete))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(kind: str, length: int, repeats: int, time_limit_gib: float, timed_attention: int
            ) -> dict[str, object]:
    start = time.perf_counter()
    compiled, args = compiled_step(kind, length)
    row = {"kind": kind, "length": length, "compile": time.perf_counter() - start,
           "temp": compiled.memory_analysis().temp_size_in_bytes}
    if row["temp"] <= time_limit_gib * 2**30 and (kind == "deltanet" or length <= timed_attention):
        row["step"] = run_seconds(compiled, args, repeats)
    return row


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| length | layer | compiled temporaries | x per 4x length | step (fwd + bwd) | compile s |",
             "|---:|---|---:|---:|---:|---:|"]
    previous: dict[str, int] = {}
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['length']:,} | {r['kind']} | skipped: {r['skipped']} | | | |")
            continue
        growth = f"{r['temp'] / previous[r['kind']]:.2f}" if r["kind"] in previous else ""
        previous[r["kind"]] = r["temp"]
        step = f"{r['step']:.3f} s" if "step" in r else "not run"
        lines.append(f"| {r['length']:,} | {r['kind']} | {r['temp'] / MIB:,.1f} MiB | {growth} | {step} | "
                     f"{r['compile']:.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--time-limit-gib", type=float, default=2.0, help="run only steps whose temporaries fit")
    parser.add_argument("--skip-dot-product-from", type=int, default=0, help="compile dot_product only below this")
    parser.add_argument("--time-attention-up-to", type=int, default=16384,
                        help="attention's steps are run only up to this length (their work grows with L squared)")
    parser.add_argument("--kinds", nargs="+", default=["deltanet", "blockwise", "dot_product"])
    args = parser.parse_args(argv)
    rows = []
    for length in args.lengths:
        for kind in args.kinds:
            if kind == "dot_product" and args.skip_dot_product_from and length >= args.skip_dot_product_from:
                rows.append({"kind": kind, "length": length, "skipped": "not compiled at this length"})
                continue
            rows.append(measure(kind, length, args.repeats, args.time_limit_gib, args.time_attention_up_to))
            print(rows[-1], flush=True)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, load average {os.getloadavg()[0]:.1f}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
