"""A learnable synthetic task made on device, directly in the batch sharding (no host copy, no file).

Each sequence is an arithmetic progression modulo `period`: token_t = (start + stride * t) % period + offset, with a
random start and stride per sequence. After two tokens the next one is determined, so the loss of a model that
learns falls far below log(period); the uniform-guess loss stays a useful yardstick for benchmarks.

For a preference objective (`objectives/kinds.py`: rows of pairs) each row holds whole pairs of halves of
`PAIR_HALF` + 1 tokens: a prompt (the first `PAIR_HALF` / 2 tokens of a progression) then, in the chosen half, the
progression's continuation, and in the rejected half random tokens; only reply targets weigh 1. A model learns to
prefer the continuation, which it can tell from the prompt alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from maxshard.objectives.kinds import FIELDS

__all__ = ["SyntheticIterator", "PAIR_HALF"]

PAIR_HALF = 16  # targets per half of a synthetic preference pair (fewer when the row is shorter)


class SyntheticIterator:
    """Yields `{inputs, targets, segment_ids, positions, loss_weights}` [batch, length] as global jax.Arrays."""

    def __init__(self, seed: int, batch: int, length: int, vocab_size: int, sharding: NamedSharding,
                 rows: str = "documents") -> None:
        """`rows`: what a row holds, the objective's `kinds.Kind.rows` ("documents" or "pairs")."""
        self._key = jax.random.key(seed)
        self._step = 0
        period = min(vocab_size - 3, 256)
        make = _progressions if rows == "documents" else _pairs
        self._make = jax.jit(lambda key: make(key, batch, length, period),
                             out_shardings={k: sharding for k in FIELDS})

    def __iter__(self) -> "SyntheticIterator":
        return self

    def __next__(self) -> dict[str, jax.Array]:
        batch = self._make(jax.random.fold_in(self._key, self._step))
        self._step += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"step": self._step}

    def set_state(self, state: dict[str, Any]) -> None:
        self._step = int(state["step"])

    def stats(self) -> dict[str, int]:
        """No data metrics: nothing is read."""
        return {}


def _progressions(key: jax.Array, batch: int, length: int, period: int) -> dict[str, jax.Array]:
    start_key, stride_key = jax.random.split(key)
    start = jax.random.randint(start_key, (batch, 1), 0, period)
    stride = jax.random.randint(stride_key, (batch, 1), 1, 8)
    t = jnp.arange(length + 1)[None, :]
    tokens = ((start + stride * t) % period + 3).astype(jnp.int32)  # [batch, length + 1]; ids 0-2 are special
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": jnp.ones((batch, length), jnp.int32),
        "positions": positions,
        "loss_weights": jnp.ones((batch, length), jnp.float32),
    }


def _pairs(key: jax.Array, batch: int, length: int, period: int) -> dict[str, jax.Array]:
    """Rows of whole preference pairs (module docstring); the rest of a row is padding (segment 0, weight 0)."""
    half = min(PAIR_HALF, length // 2)
    count, prompt = length // (2 * half), max(half // 2, 1)
    keys = jax.random.split(key, 3)
    start = jax.random.randint(keys[0], (batch, count, 1), 0, period)
    stride = jax.random.randint(keys[1], (batch, count, 1), 1, 8)
    t = jnp.arange(half + 1)
    chosen = (start + stride * t) % period + 3  # [batch, count, half + 1]
    noise = jax.random.randint(keys[2], (batch, count, half + 1), 0, period) + 3
    rejected = jnp.where(t < prompt, chosen, noise)
    tokens = jnp.stack([chosen, rejected], axis=2).astype(jnp.int32)  # [batch, count, 2, half + 1]
    shape = (batch, count, 2, half)
    segments = jnp.broadcast_to(jnp.arange(1, 2 * count + 1).reshape(count, 2, 1), shape)
    weights = jnp.broadcast_to((t[1:] >= prompt).astype(jnp.float32), shape)
    positions = jnp.broadcast_to(jnp.arange(half), shape)
    pad = length - 2 * count * half

    def row(a: jax.Array, dtype: jnp.dtype) -> jax.Array:
        return jnp.pad(a.reshape(batch, -1).astype(dtype), ((0, 0), (0, pad)))

    return {
        "inputs": row(tokens[..., :-1], jnp.int32),
        "targets": row(tokens[..., 1:], jnp.int32),
        "segment_ids": row(segments, jnp.int32),
        "positions": row(positions, jnp.int32),
        "loss_weights": row(weights, jnp.float32),
    }
