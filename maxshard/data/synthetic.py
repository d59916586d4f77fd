"""A learnable synthetic task made on device, directly in the batch sharding (no host copy, no file).

Each sequence is an arithmetic progression modulo `period`: token_t = (start + stride * t) % period + offset, with a
random start and stride per sequence. After two tokens the next one is determined, so the loss of a model that
learns falls far below log(period); the uniform-guess loss stays a useful yardstick for benchmarks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

__all__ = ["SyntheticIterator"]


class SyntheticIterator:
    """Yields `{inputs, targets, segment_ids, positions, loss_weights}` [batch, length] as global jax.Arrays."""

    def __init__(self, seed: int, batch: int, length: int, vocab_size: int, sharding: NamedSharding) -> None:
        self._key = jax.random.key(seed)
        self._step = 0
        period = min(vocab_size - 3, 256)
        self._make = jax.jit(
            lambda key: _progressions(key, batch, length, period),
            out_shardings={k: sharding for k in ("inputs", "targets", "segment_ids", "positions", "loss_weights")},
        )

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
