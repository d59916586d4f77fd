"""Gated DeltaNet with the sequence sharded (context or sequence parallelism): each device runs the causal conv and
the chunked delta rule on its own tokens, and only the conv's halo and the rule's chunk states cross devices.

Pieces. Under the active rules the layer's length axis (ax.LENGTH in ax.QUERY) is split over some mesh axes; under
context parallelism the sequence arrives in ring attention's balanced order (layers/ring_attention.py: device c holds
chunks c and 2C-1-c). Each device's tokens are cut into R equal pieces, each contiguous in token order (R = 2 under
context parallelism alone, 1 under sequence parallelism alone); the order of all pieces along the sequence is known
when tracing, so every table below is a constant.

The conv halo. Each piece's window reaches back width - 1 inputs into the pieces before it: every device's pieces'
last inputs (and their segment ids, so no tap reads another document) are all-gathered and each piece takes its
predecessors' (a few tokens a piece; zeros before the first).

The chunk state. The rule is affine in its initial state, column by column of dv: from S_in a piece ends at
S_in -> A S_in + B (A [heads, dk, dk], B [heads, dk, dv]) and outputs o = o_0 + q~ . S_in, where o_0 and B are the
piece's result from a zero state and q~_t = (M_t ... M_1)^T (scale q_t) with M_t = (I - beta_t k_t k_t^T) exp(g_t)
(zero at a document's first token). One chunked call per device computes all of them: its value columns extended by
dk zero columns, its initial state [0 | I] (the extension's state evolves as A, its outputs are q~): one pass, its
value width dv + dk instead of dv (the triangular solve's right-hand side, the state and output matmuls; the [C, C]
blocks unchanged). The pieces' (A, B) are all-gathered and
composed in token order on every device (a few small matmuls); a piece whose first token starts a document gets a
zero state. Each piece adds q~ . S_in to its outputs. Everything is float32, and exact: only the chunk boundaries
differ from one device's, so results agree to float32 rounding. Gradients flow through the same collectives.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxshard.model.layers import ring_attention
from maxshard.model.layers.delta_rule import _einsum, chunked_gated_delta_rule
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import active_mesh_axes, active_mesh_sizes, mesh_axes, partition_spec

__all__ = ["length_axes", "sharded_causal_conv", "sharded_gated_delta_rule", "piece_layout"]


def length_axes() -> tuple[str, ...]:
    """The mesh axes (size > 1) the active rules split the layer's length over (ax.QUERY's, as the layer constrains
    its projections); () without a mesh or with the length whole."""
    return tuple(active_mesh_axes(ax.QUERY)[1])


def _shards(axes: tuple[str, ...]) -> int:
    sizes = active_mesh_sizes()
    return math.prod(sizes[a] for a in axes)


def piece_layout(length: int, shards: int, context: int) -> tuple[int, np.ndarray]:
    """(piece length, previous) for a sequence of `length` split over `shards` devices, in ring attention's balanced
    order over `context` shards (1: token order). Pieces are numbered along the sharded array (device d holds pieces
    d R .. d R + R - 1); previous[p] is the piece just before p in token order, -1 for the first."""
    order = ring_attention.balanced_order(length, context) if context > 1 else np.arange(length)
    local = length // shards
    piece = math.gcd(local, length // (2 * context)) if context > 1 else local
    starts = order[::piece]
    assert all((order[p * piece:(p + 1) * piece] == s + np.arange(piece)).all() for p, s in enumerate(starts))
    in_order = np.argsort(starts)
    previous = np.full(len(starts), -1)
    previous[in_order[1:]] = in_order[:-1]
    return piece, previous


def _layout(length: int, axes: tuple[str, ...]) -> tuple[int, int, np.ndarray]:
    """(pieces per device, piece length, previous) of the active mesh (`piece_layout`)."""
    shards = _shards(axes)
    if length % shards:
        raise ValueError(f"length {length} is not a multiple of its {shards} shards")
    piece, previous = piece_layout(length, shards, ring_attention.context_size())
    return length // shards // piece, piece, previous


def _spec(logical: tuple[str | None, ...], keep: int) -> PartitionSpec:
    """The shard_map spec of an array named `logical`, its first `keep` dimensions (the rest whole)."""
    dims = mesh_axes(logical, nn.get_logical_axis_rules(), active_mesh_sizes())
    return partition_spec(tuple(dims[:keep]) + ((),) * (len(logical) - keep))


def _split(x: jax.Array, pieces: int) -> jax.Array:
    """[b, local, ...] -> [pieces, b, local / pieces, ...]."""
    b, local, *rest = x.shape
    return jnp.moveaxis(x.reshape(b, pieces, local // pieces, *rest), 1, 0)


def _merge(x: jax.Array) -> jax.Array:
    """Inverse of `_split`."""
    pieces, b, piece, *rest = x.shape
    return jnp.moveaxis(x, 0, 1).reshape(b, pieces * piece, *rest)


def _mine(table: np.ndarray | jax.Array, axes: tuple[str, ...], pieces: int) -> jax.Array:
    """This device's rows of a per-piece table [P, ...] (device d's pieces are d R .. d R + R - 1)."""
    index = jax.lax.axis_index(axes)
    return jax.lax.dynamic_slice_in_dim(jnp.asarray(table), index * pieces, pieces)


def _gather(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """[R, ...] per device -> [devices * R, ...]: every piece's, numbered as `piece_layout` numbers them."""
    return jax.lax.all_gather(x, axes, axis=0, tiled=True)


def _history_chain(previous: np.ndarray, depth: int) -> np.ndarray:
    """[pieces, depth]: each piece's `depth` predecessors in token order, nearest last (-1 past the first)."""
    chain = np.full((len(previous), depth), -1)
    for p in range(len(previous)):
        at = p
        for i in range(depth - 1, -1, -1):
            at = previous[at] if at >= 0 else -1
            chain[p, i] = at
    return chain


def sharded_causal_conv(x: jax.Array, kernel: jax.Array, segment_ids: jax.Array,
                        logical: tuple[str | None, ...] = ax.QUERY) -> jax.Array:
    """`gated_deltanet.causal_conv` of x [b, L, heads, dim] (laid out as `logical`, its length sharded), kernel
    [width, heads, dim], segment_ids [b, L], each piece's window reaching into the pieces before it (module
    docstring) -> silu(conv) [b, L, heads, dim], sharded as x."""
    from maxshard.model.layers.gated_deltanet import causal_conv  # deferred: that layer calls this module

    axes = length_axes()
    pieces, piece, previous = _layout(x.shape[1], axes)
    width = kernel.shape[0]
    halo = min(width - 1, piece)  # inputs each piece lends, from its end
    chain = _history_chain(previous, -(-(width - 1) // piece))  # the pieces a window reaches, nearest last
    x_spec = _spec(logical, 3)
    seg_spec = PartitionSpec(*x_spec[:2])

    def local(x, kernel, seg):
        xs, segs = _split(x, pieces), _split(seg, pieces)  # [R, b, piece, h, d], [R, b, piece]
        tails, seg_tails = _gather(xs[:, :, piece - halo:], axes), _gather(segs[:, :, piece - halo:], axes)
        links = _mine(chain, axes, pieces)  # [R, depth]
        found = (links >= 0).reshape(*links.shape, 1, 1, 1, 1)
        hist = jnp.where(found, jnp.take(tails, jnp.maximum(links, 0), axis=0), 0)  # [R, depth, b, halo, h, d]
        hist_seg = jnp.take(seg_tails, jnp.maximum(links, 0), axis=0)  # [R, depth, b, halo]
        b, depth = x.shape[0], links.shape[1]
        hist = jnp.moveaxis(hist, 1, 2).reshape(pieces, b, depth * halo, *x.shape[2:])[:, :, depth * halo
                                                                                        - (width - 1):]
        hist_seg = jnp.moveaxis(hist_seg, 1, 2).reshape(pieces, b, depth * halo)[:, :, depth * halo - (width - 1):]
        conv = jax.vmap(lambda xi, hi, si, hsi: causal_conv(xi, kernel, hi, si, hsi)[0])
        return _merge(conv(xs, hist, segs, hist_seg))

    mapped = jax.shard_map(local, in_specs=(x_spec, PartitionSpec(None, x_spec[2], None), seg_spec),
                           out_specs=x_spec, check_vma=False)
    return mapped(x, kernel, segment_ids)


def _compose(a: jax.Array, b: jax.Array, first: jax.Array, previous: np.ndarray, initial: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """Every piece's incoming state [P, b, h, dk, dv] and the sequence's final state, from the pieces' maps
    S -> a S + b (a [P, b, h, dk, dk], b [P, b, h, dk, dv]) composed in token order. `first` [P, b]: whether the
    piece continues the document of the piece before it (else its state starts from zero)."""
    in_order = [int(np.flatnonzero(previous == -1)[0])]
    while len(in_order) < len(previous):
        in_order.append(int(np.flatnonzero(previous == in_order[-1])[0]))
    incoming = [None] * len(previous)
    state = initial
    for p in in_order:
        if previous[p] >= 0:
            state = jnp.where(first[p][:, None, None, None], state, 0.0)
        incoming[p] = state
        state = _einsum("bhkj,bhjv->bhkv", a[p], state) + b[p]
    return jnp.stack(incoming), state


def _from_zero(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, seg: jax.Array,
               pieces: int, chunk_size: int, scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One device's pieces, each from a zero state, in one chunked call (module docstring): (o_0 [R, b, piece, h,
    dv], q~ [R, b, piece, h, dk], the final states [R, b, h, dk, dv + dk]: B | A)."""
    b, _, heads, dv = v.shape
    dk = k.shape[-1]
    q, k, v, g, beta, seg = (_split(x, pieces).reshape(pieces * b, -1, *x.shape[2:])  # the pieces into the batch
                             for x in (q, k, v, g, beta, seg))
    v = jnp.concatenate([jnp.asarray(v, jnp.float32), jnp.zeros((*v.shape[:3], dk), jnp.float32)], -1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (pieces * b, heads, dk, dk))
    start = jnp.concatenate([jnp.zeros((pieces * b, heads, dk, dv), jnp.float32), eye], -1)
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, segment_ids=seg,
                                          initial_state=start, scale=scale)
    out, final = out.reshape(pieces, b, *out.shape[1:]), final.reshape(pieces, b, *final.shape[1:])
    return out[..., :dv], out[..., dv:], final


def sharded_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                             chunk_size: int, segment_ids: jax.Array | None = None,
                             initial_state: jax.Array | None = None, scale: float | None = None
                             ) -> tuple[jax.Array, jax.Array]:
    """`chunked_gated_delta_rule` with the length sharded as ax.QUERY's under the active rules (q, k as
    ax.KEY_VALUE, v as ax.QUERY, g and beta as its first three dimensions, segment_ids its first two), each device
    on its own tokens, the chunk states passed between pieces (module docstring) -> (out [b, L, value_heads, dv]
    sharded as v, final state [b, value_heads, dk, dv] float32, whole over the length axes)."""
    axes = length_axes()
    batch, length, _, dk = k.shape
    heads, dv = v.shape[2], v.shape[3]
    pieces, _, previous = _layout(length, axes)
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)
    if initial_state is None:
        initial_state = jnp.zeros((batch, heads, dk, dv), jnp.float32)
    kv_spec, q_spec = _spec(ax.KEY_VALUE, 3), _spec(ax.QUERY, 3)
    head_spec, seg_spec = PartitionSpec(*q_spec[:3]), PartitionSpec(*q_spec[:2])
    state_spec = PartitionSpec(q_spec[0], q_spec[2], None, None)
    scale = dk ** -0.5 if scale is None else scale

    def local(q, k, v, g, beta, seg, initial):
        out0, q_read, final = _from_zero(q, k, v, g, beta, seg, pieces, chunk_size, scale)
        seg = _split(seg, pieces)
        ends = _gather(jnp.stack([seg[:, :, 0], seg[:, :, -1]], -1), axes)  # [P, b, 2]: first and last segment
        continues = ends[:, :, 0] == ends[np.maximum(previous, 0), :, 1]  # [P, b]
        maps = _gather(final, axes)  # [P, b, h, dk, dv + dk]: B | A
        incoming, last = _compose(maps[..., dv:], maps[..., :dv], continues, previous, initial)
        s_in = _mine(incoming, axes, pieces)  # [R, b, h, dk, dv]
        return _merge(out0 + _einsum("rbthk,rbhkv->rbthv", q_read, s_in)), last

    mapped = jax.shard_map(local, in_specs=(kv_spec, kv_spec, q_spec, head_spec, head_spec, seg_spec, state_spec),
                           out_specs=(q_spec, state_spec), check_vma=False)
    return mapped(q, k, v, g, beta, segment_ids, initial_state)
