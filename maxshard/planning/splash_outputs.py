"""The splash kernel's block-sized float32 outputs: what one call of it writes to device memory besides its output
and log-sum-exp, read off the installed kernel rather than written down, because it changes with the toolchain.

The splash kernel of older jax releases (`jax.experimental.pallas.ops.tpu.splash_attention`) returns its running
max, running sum and output accumulator, [block_q, 128 | head_dim] float32, as outputs of the forward call, and its
dK/dV and dQ accumulators as outputs of the backward calls; XLA:TPU gives each its own buffer per (sequence row, kv
head) call, and the layer backward's peak holds the forward's three. Newer kernels keep them in scratch (the core's
vector memory): their calls return only the output, the log-sum-exp and the gradients, and the step compiles
smaller by those buffers (benchmarks/README.md, "Held-out shapes": the splash block term, and the LoRA step's live
sets under each jax).

`largest_call_bytes` traces the kernel's backward abstractly at a length that no block, group or head width equals,
keeps the float32 outputs with no length-sized dimension, pads them to the compiler's tile and takes the largest
call's sum: the forward and backward calls run one after another, and the live set at that peak held the forward's
only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["largest_call_bytes"]


def _tiled(shape: tuple[int, ...], tile: tuple[int, int]) -> int:
    """Elements of `shape` with its two minor dimensions padded to (rows, lanes)."""
    rows, lanes = tile
    *major, second, minor = (1, *shape) if len(shape) == 1 else shape
    size = -(-second // rows) * rows * -(-minor // lanes) * lanes
    for d in major:
        size *= d
    return size


def _pallas_calls(jaxpr) -> list:
    """Every pallas_call equation of `jaxpr`, nested ones included."""
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            calls.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    calls.extend(_pallas_calls(inner))
    return calls


@functools.cache
def largest_call_bytes(group: int, head_dim: int, block_q: int, block_kv: int, tile: tuple[int, int]) -> int:
    """Bytes of block-sized float32 outputs of the splash call (forward, dK/dV or dQ) that writes the most, for one
    sequence row and kv head: `group` query heads of `head_dim`, the blocks the config gives; 0 where the kernel
    keeps its accumulators in scratch."""
    from maxshard.model.layers import attention_ops

    length = 8 * max(block_q, block_kv, group, head_dim)  # no block-sized dimension equals it
    q = jax.ShapeDtypeStruct((1, length, group, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, length, 1, head_dim), jnp.bfloat16)

    def loss(q, k, v):
        ids = jnp.ones((1, length), jnp.int32)
        out = attention_ops.splash(q, k, v, ids, ids, block_q=block_q, block_kv=block_kv, interpret=False)
        return out.astype(jnp.float32).sum()

    traced = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)
    per_call = [sum(4 * _tiled(v.aval.shape, tile) for v in call.outvars
                    if v.aval.dtype == jnp.float32 and length not in v.aval.shape)
                for call in _pallas_calls(traced.jaxpr)]
    return max(per_call, default=0)
