"""The ragged expert-parallel exchange of dropless MoE (`moe_exchange: ragged`): every device sends each expert shard
only the rows routed to it, with `jax.lax.ragged_all_to_all`, and computes only the rows it received.

Why. The fixed exchange (`moe_grouped._dropless_exchange`) reserves T x min(k, E_l) rows for every destination, so
each of the P devices receives, and runs its grouped matmul over, P x T x min(k, E_l) rows: min(P, E / k) times
the T x k rows a balanced routing brings it (4x for tiny_moe under expert=4). A static-shaped matmul executes, and
XLA counts, its buffer, not the rows in it. Here the receive buffer is sized by the routing's balanced share.

Sizes from the counts. Each device counts its rows per global expert, sizes [E] (its T x k assignments sorted by
expert, padding last and uncounted); an all_gather over the expert axes gives every device the whole matrix
counts [P sources, E] (P x E int32: the all_to_all of the counts that the receivers need, plus what each sender
needs to know where its rows land among the other senders'). From it every device computes the same tables, with
no further communication:

    taken[s, r, j]    rows of source s for local expert j of receiver r that fit r's buffer (overflow below)
    at[s, r, j]       where that block starts in r's buffer: expert-major, then source, so the buffer arrives sorted
                      by local expert and its grouped matmul takes it as it is (no second sort)
    start[s, r, j]    where that block starts among s's sorted rows (exclusive cumsum of counts[s])

Device d sends, one slice per (receiver r, local expert j), rows start[d, r, j] .. + taken[d, r, j] to at[d, r, j]
of r, and receives taken[s, d, j] rows from each source s; its local group sizes are sum_s taken[s, d, :]. The
results go back by the same collective with the roles swapped (receivers send at[s, d, j] to start[s, d, j]),
into a zero buffer of T x k rows: a row that was not sent comes back zero.

The buffer, static as XLA needs it. R = the balanced share T x k times `moe_ragged_buffer_factor`, rounded up to a
multiple of 8, at most the worst case P x T x min(k, E_l) (a token's k choices are distinct experts, so at most
min(k, E_l) of them sit on one device; MaxText sizes its buffer the same two ways, `ragged_buffer_factor`).
A factor <= 0 (the default) takes the worst case, which no routing can overflow; generation always does
(`decode.decode_model`).

Overflow, never silent. When the rows routed to a device exceed R, its blocks are taken source-major (all of source
0's rows, then source 1's, ...) until R is full and the rest stay home: those assignments get nothing from that
expert, as a drop at capacity would (the token's residual and its other choices carry it), and each one counts in
the layer's `dropped` statistic, reported as moe/dropped_fraction. Which rows go first is fixed by the device
order, so the result is deterministic.

Worked example: P = 2 devices, E = 4 experts (E_l = 2: e0 e1 on device 0, e2 e3 on device 1), R = 5 rows.

    counts [sources, experts]     device 0: [3, 2, 2, 1]      device 1: [1, 1, 3, 1]
    to device 0 (e0 e1)           source 0: 3 + 2 = 5 rows, all taken; source 1: 1 + 1 = 2 rows over R: none taken
    to device 1 (e2 e3)           source 0: 2 + 1 = 3 rows, all taken; source 1: 3 + 1 = 4 rows, 2 taken (its
                                  first 2 of 3 for e2; its 1 for e3 does not fit)
    device 1's buffer (at)        e2: source 0 at 0 (2 rows), source 1 at 2 (2 rows) | e3: source 0 at 4 (1 row)
    dropped                       2 (source 1 -> device 0) + 1 (source 1 -> device 1, e2) + 1 (e3) = 4 of 14 rows
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxshard.model.layers.ragged_all_to_all import ragged_all_to_all

__all__ = ["Slices", "Plan", "buffer_rows", "taken", "buffer_offsets", "plan", "exchange"]


def buffer_rows(tokens: int, k: int, experts: int, shards: int, factor: float) -> int:
    """Rows of one device's receive buffer: `factor` x the balanced share tokens x k, rounded up to a multiple of
    8, at most the worst case (which `factor` <= 0 takes: shards x tokens x min(k, experts / shards))."""
    worst = shards * tokens * min(k, experts // shards)
    if factor <= 0:
        return worst
    return min(worst, -(-math.ceil(factor * tokens * k) // 8) * 8)


def taken(counts: jax.Array, rows: int) -> jax.Array:
    """counts [P sources, E] -> [P sources, P receivers, E_l]: what of each block fits its receiver's `rows`,
    blocks taken source-major (source 0's for every local expert, then source 1's, ...)."""
    p = counts.shape[0]
    blocks = counts.reshape(p, p, -1)  # [source, receiver, local]
    queue = blocks.transpose(1, 0, 2).reshape(p, -1)  # per receiver, source-major
    filled = jnp.minimum(jnp.cumsum(queue, axis=1), rows)
    fits = jnp.diff(filled, axis=1, prepend=jnp.zeros_like(filled[:, :1]))
    return fits.reshape(blocks.shape).transpose(1, 0, 2)


def buffer_offsets(fits: jax.Array) -> jax.Array:
    """[P sources, P receivers, E_l] rows taken -> where each block starts in its receiver's buffer: expert-major,
    then source, so every receiver's buffer is sorted by local expert."""
    per_receiver = fits.transpose(1, 2, 0)  # [receiver, local, source]
    flat = per_receiver.reshape(fits.shape[1], -1)
    starts = (jnp.cumsum(flat, axis=1) - flat).reshape(per_receiver.shape)
    return starts.transpose(2, 0, 1)


class Slices(NamedTuple):
    """One direction of `jax.lax.ragged_all_to_all` on one device, one slice per (peer, local expert): [P x E_l]."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


class Plan(NamedTuple):
    """The ragged exchange of one device: there, back, its buffer's rows per local expert, its rows left home."""

    there: Slices
    back: Slices
    local_sizes: jax.Array  # [E_l] rows per local expert in this device's buffer, sorted by local expert
    unsent: jax.Array  # scalar int32: this device's routed rows that did not fit their receiver's buffer


def plan(counts: jax.Array, device: jax.Array, rows: int) -> Plan:
    """The exchange of device `device` (its index on the expert axes) from the gathered counts [P, E]."""
    fits = taken(counts, rows)  # [source, receiver, local]
    at = buffer_offsets(fits)
    start = (jnp.cumsum(counts, axis=1) - counts).reshape(fits.shape)
    mine, to_me = fits[device], fits[:, device]  # [receiver, local], [source, local]
    there = Slices(start[device].ravel(), mine.ravel(), at[device].ravel(), to_me.ravel())
    back = Slices(at[:, device].ravel(), to_me.ravel(), start[:, device].ravel(), mine.ravel())
    unsent = jnp.sum(counts[device]) - jnp.sum(mine)
    return Plan(there, back, jnp.sum(to_me, axis=0), unsent.astype(jnp.int32))


def exchange(x: jax.Array, rows: int, slices: Slices, axis: tuple[str, ...]) -> jax.Array:
    """x [n, embed] -> [rows, embed]: the slices of x sent, the slices received written into zeros (XLA's
    ragged-all-to-all on TPU and GPU, an emulation on CPU: `ragged_all_to_all.py`)."""
    out = jnp.zeros((rows, x.shape[1]), x.dtype)
    return ragged_all_to_all(x, out, *slices, axis_name=axis)
