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

With a sliding window, a step where no device's keys reach any of its queries' windows is skipped whole, compute
and transfer (`needed_steps`): the K/V go from one needed step to the next in one ppermute of that many hops, and the
gradients jump home after the last. A window of at most one chunk leaves steps 0, 1 and C - 1 (a chunk's
neighbours are on the devices either side), whatever C. Inside a step the blockwise kernel skips the key blocks
outside the window. A soft-cap is the kernel's; the sinks join once, in step 0's partial result, and their gradient
is taken once from the merged output and log-sum-exp.

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
           "manual_over_batch_and_heads", "balanced_order", "needed_steps"]

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


def manual_over_batch_and_heads(fn: Callable, q, k, v, q_segment_ids, kv_segment_ids,
                                sinks: jax.Array | None = None) -> jax.Array:
    """`fn` on each device's [batch, length, heads] shard (shard_map), as kernels that XLA cannot partition need.
    A per-head array `sinks` [heads] travels sharded as q's heads (`fn(..., sinks=local)`): closed over, a traced
    array would enter every device whole, its heads no longer matching the local q's.

    Without an active mesh (a plain call, a test) `fn` runs on the whole arrays."""
    args = (q, k, v, q_segment_ids, kv_segment_ids)
    if sinks is not None:
        fn = _with_sinks(fn)
        args = (*args, sinks)
    if not active_mesh_sizes() or not nn.get_logical_axis_rules():
        return fn(*args)
    q_spec, kv_spec, seg_spec = _specs(ax.ATTN_QUERY, ax.ATTN_KEY_VALUE, ax.ATTN_SEGMENTS)
    specs = (q_spec, kv_spec, kv_spec, seg_spec, seg_spec) + ((_head_spec(q_spec),) if sinks is not None else ())
    mapped = jax.shard_map(fn, in_specs=specs, out_specs=q_spec, check_vma=False)
    return mapped(*args)


def _with_sinks(fn: Callable) -> Callable:
    return lambda q, k, v, q_seg, kv_seg, sinks: fn(q, k, v, q_seg, kv_seg, sinks=sinks)


def _head_spec(q_spec: PartitionSpec) -> PartitionSpec:
    """The spec of a [heads] array sharded as the heads axis of q [batch, length, heads, head_dim]."""
    return PartitionSpec(q_spec[2] if len(q_spec) > 2 else None)


# --------------------------------------------------------------------------------------------- the ring


def _chunk_indices(device: jax.Array, local_len: int, shards: int) -> jax.Array:
    """Global token indices [local_len] of the balanced chunks of `device`: chunk `device`, then 2C-1-device."""
    n = local_len // 2
    t = jnp.arange(local_len, dtype=jnp.int32)
    chunk = jnp.where(t < n, device, 2 * shards - 1 - device)
    return chunk * n + t % n


def _shift(axis: tuple[str, ...], shards: int, hops: int, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Every array `hops` steps along the ring, device c -> c + hops."""
    pairs = [(i, (i + hops) % shards) for i in range(shards)]
    return tuple(jax.lax.ppermute(x, axis, pairs) for x in xs)


def needed_steps(shards: int, local_len: int, window: int) -> tuple[int, ...]:
    """The ring steps s (device c holds device c - s's K/V) where some device has a key in some query's window, by
    chunk (`_chunk_indices`): all of them without a window. A step no device needs is skipped whole, compute and
    transfer: the K/V jump from one needed step to the next in one ppermute. With a window of at most one chunk,
    only steps 0, 1 and C - 1 remain (a chunk's neighbours live on the devices either side)."""
    if not window:
        return tuple(range(shards))
    n = local_len // 2

    def chunks(device: int) -> tuple[int, int]:
        return device, 2 * shards - 1 - device

    def sees(q_chunk: int, kv_chunk: int) -> bool:  # some key at or before some query, and after its window start
        return kv_chunk * n <= q_chunk * n + n - 1 and kv_chunk * n + n - 1 > q_chunk * n - window

    return tuple(step for step in range(shards)
                 if any(sees(qc, kc) for c in range(shards) for qc in chunks(c)
                        for kc in chunks((c - step) % shards)))


def _ring_forward(q, k, v, q_seg, kv_seg, sinks, axis, shards, block_q, block_kv, window, softcap):
    """(out float32 [b, q, h, g, d], lse [b, h, g, q]) of local queries over every device's keys. The sinks join
    once, in step 0's partial result (as the initial running maximum), so the merges count them once."""
    me = jax.lax.axis_index(axis)
    q_idx = _chunk_indices(me, q.shape[1], shards)
    out, lse, at = None, None, 0
    for step in needed_steps(shards, q.shape[1], window):
        if step != at:
            k, v, kv_seg = _shift(axis, shards, step - at, k, v, kv_seg)
            at = step
        kv_idx = _chunk_indices((me - step) % shards, k.shape[1], shards)
        part, part_lse = bw.forward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, block_q, block_kv, window, softcap,
                                    sinks if out is None else None)
        out, lse = (part.astype(jnp.float32), part_lse) if out is None else bw.merge(out, lse, part, part_lse)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _ring(q, k, v, q_seg, kv_seg, sinks, axis, shards, block_q, block_kv, window, softcap):
    out, _ = _ring_forward(q, k, v, q_seg, kv_seg, sinks, axis, shards, block_q, block_kv, window, softcap)
    return out.astype(v.dtype)


def _ring_fwd(q, k, v, q_seg, kv_seg, sinks, axis, shards, block_q, block_kv, window, softcap):
    out, lse = _ring_forward(q, k, v, q_seg, kv_seg, sinks, axis, shards, block_q, block_kv, window, softcap)
    out = out.astype(v.dtype)
    return out, (q, k, v, q_seg, kv_seg, sinks, out, lse)


def _ring_bwd(axis, shards, block_q, block_kv, window, softcap, residuals, dout):
    """dK and dV travel with their K/V chunk and, after the last needed step, jump home; the sinks' gradient is
    taken once from the merged out and lse (their share of every row is in lse)."""
    q, k, v, q_seg, kv_seg, sinks, out, lse = residuals
    me = jax.lax.axis_index(axis)
    q_idx = _chunk_indices(me, q.shape[1], shards)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    at = 0
    for step in needed_steps(shards, q.shape[1], window):
        if step != at:
            k, v, kv_seg, dk, dv = _shift(axis, shards, step - at, k, v, kv_seg, dk, dv)
            at = step
        kv_idx = _chunk_indices((me - step) % shards, k.shape[1], shards)
        dq_s, dk_s, dv_s = bw.backward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, out, lse, dout, None,
                                       block_q, block_kv, window, softcap)
        dq, dk, dv = dq + dq_s, dk + dk_s, dv + dv_s
    if at:
        dk, dv = _shift(axis, shards, shards - at, dk, dv)  # home: the chunk came from device c - at
    dsinks = None if sinks is None else bw.sink_grad(sinks, lse, out, dout).astype(sinks.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attend(q, k, v, q_segment_ids, kv_segment_ids, block_q: int, block_kv: int, window: int = 0,
                softcap: float = 0.0, sinks: jax.Array | None = None) -> jax.Array:
    """Ring attention of the balanced layout: q [b, length, heads, d], k, v [b, length, kv_heads, d] sharded over
    the context axes on length (and batch and heads as the rules say) -> [b, length, heads, d]. `window`,
    `softcap` and `sinks` [heads] as `attention_ops.attend`'s; the sinks are sharded as q's heads."""
    axis, shards = context_axes(), context_size()

    def local(q, k, v, q_seg, kv_seg, *head_sinks):
        b, length, heads, dim = q.shape
        local_kv_heads = k.shape[2]
        qg = q.reshape(b, length, local_kv_heads, heads // local_kv_heads, dim)
        grouped = head_sinks[0].astype(jnp.float32).reshape(local_kv_heads, -1) if head_sinks else None
        out = _ring(qg, k, v, q_seg, kv_seg, grouped, axis, shards, block_q, block_kv, window, softcap)
        return out.reshape(b, length, heads, v.shape[-1])  # v's head width (latent attention's may differ)

    q_spec, kv_spec, seg_spec = _specs(ax.ATTN_QUERY, ax.ATTN_KEY_VALUE, ax.ATTN_SEGMENTS)
    specs = (q_spec, kv_spec, kv_spec, seg_spec, seg_spec)
    args = (q, k, v, q_segment_ids, kv_segment_ids)
    if sinks is not None:
        specs, args = (*specs, _head_spec(q_spec)), (*args, sinks)
    mapped = jax.shard_map(local, in_specs=specs, out_specs=q_spec, check_vma=False)
    return mapped(*args)
