"""The kernel initialiser every projection shares (DenseGeneral, the MLP's stacked kernels, LoRA's A)."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["default_kernel_init"]


def default_kernel_init(num_in: int) -> nn.initializers.Initializer:
    """Truncated-normal fan-in scaling over the first `num_in` (contracted) dimensions."""

    def init(key: jax.Array, shape: Sequence[int], dtype: jnp.dtype = jnp.float32) -> jax.Array:
        in_axes = tuple(range(num_in))
        out_axes = tuple(range(num_in, len(shape)))
        return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axes, out_axes)(
            key, shape, dtype
        )

    return init
