"""Ring attention over the `context` mesh axis, with causal load balancing; and the manual-sharding helper that
kernels which XLA cannot partition (splash) run under.

Layout (load balancing). With C context shards the sequence is cut into 2C chunks of n = length / 2C tokens and
device c holds chunks c and 2C-1-c: one early, one late. Causal attention gives a late chunk much more work than an
early one, so pairing them evens the work out. The permutation is applied inside the model, once per step: at
entry (`to_balanced` on the embeddings, segment ids and positions) and exit (`from_balanced` on the last hidden
state, before the output head). Everything between is position-free except attention, which works out each local
token's global index from its chunk numbers; RoPE reads the permuted `positions`; the loss is a sum over tokens, so
the model's outputs come back in the original order and nothing outside it changes. (Permuting the data instead
would save two reshuffles of [batch, length, embed] per step but leak the layout into the input pipeline, eval and
generation.) One layer is order-dependent besides attention: an MoE block with a capacity drops the tokens that
come last in its order, so under context parallelism a different set may be dropped (dropless MoE is unaffected).
XLA lowers the reorder of a length-sharded array as an all-gather over `context` and a slice (the planner counts
two per step); a ppermute-based reorder would move half as much and is left for later.

The ring schedule. Each device keeps its queries and passes its K/V chunk pair to the next device each step
(`ppermute`, c -> c+1); at step s it holds the pair of device j = c - s (mod C). Causality decides what is computed:

    s = 0:       q_early x kv_early and q_late x kv_late are the diagonal (causal); q_late x kv_early is full
    j < c:       kv_early of j precedes both query chunks: both query chunks x kv_early (kv_late is all in the future)
    j > c:       only q_late sees j's chunks, and sees both: q_late x (kv_early, kv_late)

Worked example, C = 2, 4 chunks: device 0 holds (0, 3), device 1 holds (1, 2). Step 0: device 0 computes 0x0,
3x0, 3x3, device 1 computes 1x1, 2x1, 2x2; step 1: device 0 gets (1, 2) (j = 1 > 0): 3x1, 3x2; device 1 gets
(0, 3) (j = 0 < 1): 1x0, 2x0. Every device: 2 diagonal + 3 full chunk pairs. The blockwise kernel skips the
blocks that are wholly in the future (by token index), so no branch per case is needed, as long as the blocks
divide n.

Every step returns a partial output and its log-sum-exp over the keys seen, merged with `blockwise_attention.merge`.
The backward pass is a second ring (custom VJP): with the final output and log-sum-exp, each step's key chunk gets
exact gradients (see blockwise_attention.py); dK and dV travel with their K/V chunk and after C steps arrive home.
Memory per device: the local q, k, v, one K/V chunk pair in flight and the output; nothing gathers the whole K/V.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxshard.model.layers import blockwise_attention as bw
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import active_mesh_axes, active_mesh_sizes, mesh_axes, partition_spec

__all__ = ["context_axes", "context_size", "to_balanced", "from_balanced", "ring_attend",
           "manual_over_batch_and_heads", "balanced_order"]

def context_axes() -> tuple[str, ...]:
    """The mesh axes ring attention runs over: those (of size > 1) that the active rules give the length of the
    queries inside attention (ax.ATTN_QUERY, the array `attention_ops.attend` constrains q to)."""
    return active_mesh_axes(ax.ATTN_QUERY)[1]


def context_size() -> int:
    sizes = active_mesh_sizes()
    return int(np.prod([sizes[a] for a in context_axes()], dtype=np.int64))


def balanced_order(length: int, shards: int) -> np.ndarray:
    """Token order of the balanced layout: chunks 0, 2C-1, 1, 2C-2, ... (device c gets chunks c and 2C-1-c)."""
    chunks = np.arange(length).reshape(2 * shards, -1)
    order = [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]
    return chunks[order].reshape(-1)


def to_balanced(x: jax.Array) -> jax.Array:
    """[batch, length, ...] in token order -> the balanced layout (identity without context parallelism)."""
    shards = context_size()
    return x if shards == 1 else jnp.take(x, balanced_order(x.shape[1], shards), axis=1)


def from_balanced(x: jax.Array) -> jax.Array:
    """Inverse of `to_balanced`."""
    shards = context_size()
    return x if shards == 1 else jnp.take(x, np.argsort(balanced_order(x.shape[1], shards)), axis=1)


def _specs(*logical: tuple[str | None, ...]) -> tuple[PartitionSpec, ...]:
    """The shard_map specs of arrays named `logical`: what their constraints give them under the active rules."""
    rules = nn.get_logical_axis_rules()
    return tuple(partition_spec(mesh_axes(names, rules)) for names in logical)


def manual_over_batch_and_heads(fn: Callable, q, k, v, q_segment_ids, kv_segment_ids) -> jax.Array:
    """`fn` on each device's [batch, length, heads] shard (shard_map), as kernels that XLA cannot partition need.

    Without an active mesh (a plain call, a test) `fn` runs on the whole arrays."""
    if not active_mesh_sizes() or not nn.get_logical_axis_rules():
        return fn(q, k, v, q_segment_ids, kv_segment_ids)
    q_spec, kv_spec, seg_spec = _specs(ax.ATTN_QUERY, ax.ATTN_KEY_VALUE, ax.ATTN_SEGMENTS)
    mapped = jax.shard_map(fn, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec), out_specs=q_spec,
                           check_vma=False)
    return mapped(q, k, v, q_segment_ids, kv_segment_ids)


# --------------------------------------------------------------------------------------------- the ring


def _chunk_indices(device: jax.Array, local_len: int, shards: int) -> jax.Array:
    """Global token indices [local_len] of the balanced chunks of `device`: chunk `device`, then 2C-1-device."""
    n = local_len // 2
    t = jnp.arange(local_len, dtype=jnp.int32)
    chunk = jnp.where(t < n, device, 2 * shards - 1 - device)
    return chunk * n + t % n


def _shift(axis: tuple[str, ...], shards: int, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Every array one step along the ring, device c -> c+1."""
    pairs = [(i, (i + 1) % shards) for i in range(shards)]
    return tuple(jax.lax.ppermute(x, axis, pairs) for x in xs)


def _ring_forward(q, k, v, q_seg, kv_seg, axis, shards, block_q, block_kv):
    """(out float32 [b, q, h, g, d], lse [b, h, g, q]) of local queries over every device's keys."""
    me = jax.lax.axis_index(axis)
    q_idx = _chunk_indices(me, q.shape[1], shards)
    out, lse = None, None
    for step in range(shards):
        kv_idx = _chunk_indices((me - step) % shards, k.shape[1], shards)
        part, part_lse = bw.forward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, block_q, block_kv)
        out, lse = (part.astype(jnp.float32), part_lse) if out is None else bw.merge(out, lse, part, part_lse)
        if step < shards - 1:
            k, v, kv_seg = _shift(axis, shards, k, v, kv_seg)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q, k, v, q_seg, kv_seg, axis, shards, block_q, block_kv):
    out, _ = _ring_forward(q, k, v, q_seg, kv_seg, axis, shards, block_q, block_kv)
    return out.astype(v.dtype)


def _ring_fwd(q, k, v, q_seg, kv_seg, axis, shards, block_q, block_kv):
    out, lse = _ring_forward(q, k, v, q_seg, kv_seg, axis, shards, block_q, block_kv)
    out = out.astype(v.dtype)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _ring_bwd(axis, shards, block_q, block_kv, residuals, dout):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    me = jax.lax.axis_index(axis)
    q_idx = _chunk_indices(me, q.shape[1], shards)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for step in range(shards):
        kv_idx = _chunk_indices((me - step) % shards, k.shape[1], shards)
        dq_s, dk_s, dv_s = bw.backward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, out, lse, dout, None,
                                       block_q, block_kv)
        dq, dk, dv = dq + dq_s, dk + dk_s, dv + dv_s
        if step < shards - 1:
            k, v, kv_seg = _shift(axis, shards, k, v, kv_seg)
        dk, dv = _shift(axis, shards, dk, dv)  # the gradients travel with their chunk; C shifts bring them home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attend(q, k, v, q_segment_ids, kv_segment_ids, block_q: int, block_kv: int) -> jax.Array:
    """Ring attention of the balanced layout: q [b, length, heads, d], k, v [b, length, kv_heads, d] sharded over
    the context axes on length (and batch and heads as the rules say) -> [b, length, heads, d]."""
    axis, shards = context_axes(), context_size()

    def local(q, k, v, q_seg, kv_seg):
        b, length, heads, dim = q.shape
        local_kv_heads = k.shape[2]
        qg = q.reshape(b, length, local_kv_heads, heads // local_kv_heads, dim)
        out = _ring(qg, k, v, q_seg, kv_seg, axis, shards, block_q, block_kv)
        return out.reshape(b, length, heads, v.shape[-1])  # v's head width (latent attention's may differ)

    q_spec, kv_spec, seg_spec = _specs(ax.ATTN_QUERY, ax.ATTN_KEY_VALUE, ax.ATTN_SEGMENTS)
    mapped = jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, seg_spec), out_specs=q_spec,
                           check_vma=False)
    return mapped(q, k, v, q_segment_ids, kv_segment_ids)
