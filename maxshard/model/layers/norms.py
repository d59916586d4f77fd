"""RMSNorm with a learned scale named ("norm",). Statistics in float32 whatever the compute dtype."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.parallel import axis_names as ax

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    epsilon: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    weight_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, (ax.NORM,)), (x.shape[-1],), self.weight_dtype
        )
        x32 = jnp.asarray(x, jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return jnp.asarray(normed * jnp.asarray(scale, jnp.float32), self.dtype)
