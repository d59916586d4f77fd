"""SwiGLU feed-forward: wo(silu(x @ wi_0) * (x @ wi_1)); x [batch, length, embed], hidden [.., mlp]."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard import axis_names as ax
from maxshard.layers.linears import DenseGeneral
from maxshard.sharding import constrain

__all__ = ["MLP"]


class MLP(nn.Module):
    hidden: int
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        emb = x.shape[-1]
        gate = DenseGeneral((self.hidden,), (ax.EMBED, ax.MLP), 1, self.dtype, self.weight_dtype, name="wi_0")(x)
        up = DenseGeneral((self.hidden,), (ax.EMBED, ax.MLP), 1, self.dtype, self.weight_dtype, name="wi_1")(x)
        hidden = constrain(nn.silu(gate) * up, (ax.BATCH, ax.LENGTH, ax.ACT_MLP))
        return DenseGeneral((emb,), (ax.MLP, ax.EMBED), 1, self.dtype, self.weight_dtype, name="wo")(hidden)
