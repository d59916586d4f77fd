"""RMSNorm with a learned scale named ("norm",). Statistics in float32 whatever the compute dtype.

With `unit_offset` (Gemma) the normalised value is multiplied by (1 + scale), the scale starting at 0: the same
function at init, and the parameter Gemma's checkpoints store. `axes` names the scale's logical axes and so how many
trailing dims the statistics run over: one by default (("norm",)); OLMo 2/3's q/k norm runs over all heads of a
[batch, length, heads, head_dim] tensor, a scale [heads, head_dim] sharded as the heads are. `rms_normalized` is
the same statistics without a scale (Llama 4's L2 q/k norm)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.parallel import axis_names as ax

__all__ = ["RMSNorm", "rms_normalized"]


class RMSNorm(nn.Module):
    epsilon: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    weight_dtype: jnp.dtype = jnp.float32
    unit_offset: bool = False
    axes: tuple[str, ...] = (ax.NORM,)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        dims = tuple(range(-len(self.axes), 0))
        shape = x.shape[-len(self.axes):]
        scale = self.param("scale", nn.with_logical_partitioning(init, self.axes), shape, self.weight_dtype)
        normed = _normalized(x, dims, self.epsilon)
        scale32 = jnp.asarray(scale, jnp.float32)
        return jnp.asarray(normed * (1.0 + scale32 if self.unit_offset else scale32), self.dtype)


def _normalized(x: jax.Array, dims: tuple[int, ...], epsilon: float) -> jax.Array:
    """x / sqrt(mean(x^2 over dims) + epsilon), in float32."""
    x32 = jnp.asarray(x, jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=dims, keepdims=True) + epsilon)


def rms_normalized(x: jax.Array, epsilon: float) -> jax.Array:
    """x divided by its RMS over the last dim (statistics in float32), no scale, in x's dtype."""
    return jnp.asarray(_normalized(x, (-1,), epsilon), x.dtype)
