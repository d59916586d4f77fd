"""Token embedding [vocab, embed] (optionally reused as the output head). RoPE lives in layers/rope.py."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.parallel import axis_names as ax

__all__ = ["Embed"]


class Embed(nn.Module):
    """`init_stddev`: the table's initial spread. 1 for a lookup alone (the pre-norm layers take any scale); a table
    that is also the output head takes features**-0.5, so that its logits of a unit-RMS hidden start at unit
    spread and the first loss near log(vocab_size) (at 1, the 1b preset's first loss was 717 nats against 10.4)."""

    vocab_size: int
    features: int
    dtype: jnp.dtype = jnp.float32
    weight_dtype: jnp.dtype = jnp.float32
    init_stddev: float = 1.0

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=self.init_stddev), (ax.VOCAB, ax.EMBED)),
            (self.vocab_size, self.features),
            self.weight_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """[batch, length] int -> [batch, length, embed]."""
        return jnp.asarray(jnp.take(self.embedding, ids, axis=0), self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output head: [batch, length, embed] -> logits [batch, length, vocab]."""
        return jnp.einsum("ble,ve->blv", x, jnp.asarray(self.embedding, self.dtype))
