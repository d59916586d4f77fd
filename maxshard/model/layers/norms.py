"""RMSNorm with a learned scale named ("norm",). Statistics in float32 whatever the compute dtype.

With `unit_offset` (Gemma) the normalised value is multiplied by (1 + scale), the scale starting at 0: the same
function at init, and the parameter Gemma's checkpoints store."""

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
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", nn.with_logical_partitioning(init, (ax.NORM,)), (x.shape[-1],), self.weight_dtype)
        x32 = jnp.asarray(x, jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        scale32 = jnp.asarray(scale, jnp.float32)
        return jnp.asarray(normed * (1.0 + scale32 if self.unit_offset else scale32), self.dtype)
