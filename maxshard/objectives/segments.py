"""Sums over the documents of packed rows: what preference pairs, KTO's examples and GRPO's completions are made
of."""

from __future__ import annotations

import jax

__all__ = ["segment_sums", "halves"]


def segment_sums(values: jax.Array, segment_ids: jax.Array, count: int) -> jax.Array:
    """[batch, length] -> [batch, count]: column s - 1 sums `values` over segment s of its row (segments 1..count;
    padding, segment 0, is left out). Row by row, so no sum ever mixes rows: gradient accumulation, which splits
    the batch by rows, and a batch sharded by rows leave every sum whole."""
    per_row = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=count + 1))
    return per_row(values, segment_ids)[:, 1:]


def halves(values: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[batch, length] -> (sums over odd segments, sums over even segments), [batch, slots] each, slot p - 1 for
    segments 2p - 1 and 2p: the two halves of a row's preference pairs (or KTO's examples)."""
    slots = (values.shape[1] + 1) // 2  # a segment holds a token at least: segment ids <= length <= 2 x slots
    summed = segment_sums(values, segment_ids, 2 * slots)  # [batch, 2 x slots]: segments 1, 2, 3, ...
    return summed[:, 0::2], summed[:, 1::2]
