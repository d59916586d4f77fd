"""cuDNN flash attention vs dot_product on an NVIDIA GPU: the kernels alone (bfloat16), and the 1b preset at 8k.

    python benchmarks/attention_gpu.py [--lengths 2048 8192] [--steps 10] [--tokamax] [--documents N] [key=value ...]

Needs a GPU (`pip install -e '.[cuda]'`); CI never runs it. Two parts:

1. Kernel: forward + backward of `attention_ops.cudnn` and `attention_ops.dot_product` on bfloat16
   q [1, L, 16, 128], k/v [1, L, 8, 128] with causal masking and two packed documents (or --documents N equal
   ones), median of --steps calls after a warm-up, plus the largest difference of their outputs from cudnn's
   (bfloat16 tolerance, ~1e-2).
2. Model: the 1b preset (`model_name=1b`, bfloat16, fsdp over every local GPU, per_device_batch_size=1) at 8k
   tokens, attention=cudnn vs dot_product (which may not fit: an out-of-memory is reported, not raised):
   median step time, tokens/s per device and MFU (model FLOPs of `maxshard.model.flops.flops_per_token` against the
   device's peak from `maxshard/devices.py`). Its synthetic rows are one document each.

--tokamax adds `attention_ops.tokamax` (tokamax's Mosaic GPU FlashAttention, documents as key offsets; Hopper or
Blackwell, lengths a multiple of 128) to both parts, its time as a ratio to cudnn's; --documents 64 is where its
skipping of the key blocks before a document should show.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import accelerator  # benchmarks/ is the script's directory
import jax
import jax.numpy as jnp

from maxshard.model.layers import attention_ops as ops

MODEL = ("model_name=1b", "override_model_config=true", "dataset_type=synthetic", "dtype=bfloat16",
         "per_device_batch_size=1", "eval_period=0")


def segment_ids(length: int, documents: int | None) -> jax.Array:
    """[1, length]: two documents split at a third (the recorded table), or `documents` equal ones."""
    if documents is None:
        return (jnp.arange(length)[None] >= length // 3).astype(jnp.int32) + 1
    return (jnp.arange(length)[None] * documents // length).astype(jnp.int32) + 1


def kernel_row(length: int, steps: int, documents: int | None = None, tokamax: bool = False) -> str:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, length, 16, 128), jnp.bfloat16) * 128**-0.5
    k = jax.random.normal(keys[1], (1, length, 8, 128), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, length, 8, 128), jnp.bfloat16)
    segments = segment_ids(length, documents)

    def timed(fn: Callable) -> tuple[float, jax.Array]:
        loss = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, segments, segments).astype(jnp.float32)),
                                          argnums=(0, 1, 2)))
        out = jax.jit(fn)(q, k, v, segments, segments)
        return accelerator.median_seconds(lambda: loss(q, k, v), steps), out

    cudnn_s, cudnn_out = timed(ops.cudnn)

    def against_cudnn(fn: Callable) -> str:
        """'time | time / cudnn's | max |out - cudnn's out|', or why it failed."""
        try:
            seconds, out = timed(fn)
        except Exception as e:  # noqa: BLE001 - out of memory at long lengths is a result, not a failure
            return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]} | | "
        diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - cudnn_out.astype(jnp.float32))))
        return f"{seconds * 1e3:.2f} ms | {seconds / cudnn_s:.2f}x | {diff:.3g}"

    others = [against_cudnn(ops.tokamax)] if tokamax else []
    return " | ".join([f"| {length:,}", f"{cudnn_s * 1e3:.2f} ms", *others, against_cudnn(ops.dot_product)]) + " |"


def model_row(attention: str, length: int, steps: int, overrides: Sequence[str]) -> str:
    try:
        cfg = accelerator.load((*MODEL, f"max_target_length={length}", f"attention={attention}"), overrides)
        seconds = accelerator.median_seconds(accelerator.compile_step(cfg).run, steps)
    except Exception as e:  # noqa: BLE001 - dot_product may run out of memory at 8k
        return f"| {attention} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | |"
    speed = accelerator.throughput(cfg, seconds)
    mfu = "-" if speed["mfu"] is None else f"{100 * speed['mfu']:.1f}%"
    return f"| {cfg.model.attention} | {speed['step_ms']:.1f} ms | {speed['tokens_per_sec']:,.0f} | {mfu} |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--model-length", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tokamax", action="store_true", help="also time attention=tokamax (Hopper/Blackwell)")
    parser.add_argument("--documents", type=int, default=None, help="equal packed documents per kernel row")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for the model part")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("attention_gpu.py needs an NVIDIA GPU (jax.default_backend() is "
              f"{jax.default_backend()!r}); nothing measured", file=sys.stderr)
        return 2
    print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()}")
    tokamax = ("tokamax fwd+bwd", "tokamax / cudnn", "max |out diff|") if args.tokamax else ()
    header = ("length", "cudnn fwd+bwd", *tokamax, "dot_product fwd+bwd", "dot / cudnn", "max |out diff|")
    print(f"| {' | '.join(header)} |\n|{'---:|' * len(header)}")
    for length in args.lengths:
        print(kernel_row(length, args.steps, args.documents, args.tokamax), flush=True)
    print(f"\n1b preset, {args.model_length} tokens, batch 1 per device:")
    print("| attention | step | tokens/s/device | MFU |\n|---|---:|---:|---:|")
    for attention in ("cudnn", *(("tokamax",) if args.tokamax else ()), "dot_product"):
        print(model_row(attention, args.model_length, args.steps, args.overrides), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
