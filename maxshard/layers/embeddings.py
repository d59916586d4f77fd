"""Token embedding [vocab, embed] (optionally reused as the output head) and rotary position embedding."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard import axis_names as ax

__all__ = ["Embed", "apply_rope"]


class Embed(nn.Module):
    vocab_size: int
    features: int
    dtype: jnp.dtype = jnp.float32
    weight_dtype: jnp.dtype = jnp.float32

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0), (ax.VOCAB, ax.EMBED)),
            (self.vocab_size, self.features),
            self.weight_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """[batch, length] int -> [batch, length, embed]."""
        return jnp.asarray(jnp.take(self.embedding, ids, axis=0), self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output head: [batch, length, embed] -> logits [batch, length, vocab]."""
        return jnp.einsum("ble,ve->blv", x, jnp.asarray(self.embedding, self.dtype))


def apply_rope(x: jax.Array, positions: jax.Array, max_timescale: float) -> jax.Array:
    """Rotates pairs (first half, second half) of head_dim by position-dependent angles.

    x: [batch, length, heads, head_dim]; positions: [batch, length].
    """
    half = x.shape[-1] // 2
    fraction = jnp.arange(half, dtype=jnp.float32) / half
    timescale = max_timescale**fraction  # [half]
    angle = positions[..., None, None].astype(jnp.float32) / timescale  # [batch, length, 1, half]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(jnp.asarray(x, jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.asarray(rotated, x.dtype)
