"""Sums over the documents of packed rows: what preference pairs and GRPO's completions are made of."""

from __future__ import annotations

import jax

__all__ = ["segment_sums"]


def segment_sums(values: jax.Array, segment_ids: jax.Array, count: int) -> jax.Array:
    """[batch, length] -> [batch, count]: column s - 1 sums `values` over segment s of its row (segments 1..count;
    padding, segment 0, is left out). Row by row, so no sum ever mixes rows: gradient accumulation, which splits
    the batch by rows, and a batch sharded by rows leave every sum whole."""
    per_row = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=count + 1))
    return per_row(values, segment_ids)[:, 1:]
