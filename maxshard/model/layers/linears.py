"""DenseGeneral whose kernel is created in its full, multi-dimensional shape.

Flax's `nn.DenseGeneral` creates a flattened 2-D kernel and reshapes it, which breaks logically partitioned
initialisers for kernels such as [embed, heads, head_dim] under a mesh (the initialiser is called with the flattened
2-D shape and fails: "only valid for values of rank at least 3"). Here the initialiser sees the
real shape, so a kernel is born sharded by its logical names.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.model.layers import lora
from maxshard.model.layers.initializers import default_kernel_init

__all__ = ["DenseGeneral", "default_kernel_init"]  # the initialiser lives in layers/initializers.py


class DenseGeneral(nn.Module):
    """y[..., *features] = x[..., *in] @ kernel[*in, *features], contracting the trailing `num_in` input dims.

    Attributes:
      features: output feature dims, e.g. (heads, head_dim).
      kernel_axes: logical names of the kernel, input dims first, e.g. ("embed", "heads", "kv").
      num_in: how many trailing dims of x are contracted (1 for [.., embed]; 2 for [.., heads, head_dim]).
      lora_rank, lora_scale: a LoRA adapter pair of this rank beside the kernel (0: none; layers/lora.py).
      use_bias: a bias of the output's shape, named by the kernel's output axes (zeros at init).
    """

    features: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    num_in: int = 1
    dtype: jnp.dtype = jnp.float32
    weight_dtype: jnp.dtype = jnp.float32
    lora_rank: int = 0
    lora_scale: float = 0.0
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_shape = x.shape[-self.num_in :]
        shape = tuple(in_shape) + tuple(self.features)
        if len(self.kernel_axes) != len(shape):
            raise ValueError(f"{self.name}: kernel_axes {self.kernel_axes} do not name a kernel of shape {shape}")
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(default_kernel_init(self.num_in), self.kernel_axes),
            shape,
            self.weight_dtype,
        )
        kernel = jnp.asarray(kernel, self.dtype)
        x = jnp.asarray(x, self.dtype)
        batch_dims = x.ndim - self.num_in
        contract = (tuple(range(batch_dims, x.ndim)), tuple(range(self.num_in)))
        y = jax.lax.dot_general(x, kernel, (contract, ((), ())))
        if self.lora_rank:
            n = self.num_in
            y = y + lora.adapter_output(self, x, self.kernel_axes[:n], self.kernel_axes[n:], self.features,
                                        self.lora_rank, self.lora_scale, self.dtype, self.weight_dtype)
        if self.use_bias:
            axes = self.kernel_axes[self.num_in:]
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, axes), tuple(self.features),
                              self.weight_dtype)
            y = y + jnp.asarray(bias, self.dtype)
        return y
