"""LoRA: a trainable low-rank correction beside a frozen projection, y = x @ W + (alpha / rank) * (x @ A) @ B.

A is [*in_dims, rank] and B is [rank, *out_dims], created in the projection's own scope next to its kernel
(`.../query/lora_a`, `.../query/lora_b`), so checkpoints and conversion find them by the kernel's path. Each is named
with logical axes: A's input dims take the kernel's input names and B's output dims its output names, so every
layout shards an adapter as it shards the weight it corrects, and the rank dim (`lora_rank`) stays whole.

A starts like a kernel (fan-in scaled) and B at zero, so a fresh adapter leaves the model exactly as loaded. The
product runs as two thin matmuls and is never merged into W during training: the frozen W then needs no gradient,
and the backward pass skips its weight-gradient matmul (`maxshard/model/trainable.py` keeps only adapters trainable).
Flax draws each parameter's init from its own path, so adding adapters leaves the base parameters' init unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.model.layers.initializers import default_kernel_init
from maxshard.parallel import axis_names as ax

__all__ = ["ADAPTER_PARAMS", "adapter_output"]

ADAPTER_PARAMS = ("lora_a", "lora_b")  # the leaf names of adapter parameters: what trains under LoRA


def adapter_output(module: nn.Module, x: jax.Array, in_axes: Sequence[str], out_axes: Sequence[str],
                   features: Sequence[int], rank: int, scale: float, dtype: jnp.dtype,
                   weight_dtype: jnp.dtype) -> jax.Array:
    """scale * (x @ A) @ B, with A and B created as params of `module` (call from inside its compact method).

    `x` [..., *in_dims] contracts its trailing len(in_axes) dims; the result is [..., *features]."""
    num_in = len(in_axes)
    in_shape = tuple(x.shape[-num_in:])
    a = module.param("lora_a", nn.with_logical_partitioning(default_kernel_init(num_in), (*in_axes, ax.LORA_RANK)),
                     (*in_shape, rank), weight_dtype)
    b = module.param("lora_b", nn.with_logical_partitioning(nn.initializers.zeros_init(), (ax.LORA_RANK, *out_axes)),
                     (rank, *features), weight_dtype)
    x = jnp.asarray(x, dtype)
    low = jax.lax.dot_general(x, jnp.asarray(a, dtype), ((tuple(range(x.ndim - num_in, x.ndim)),
                                                           tuple(range(num_in))), ((), ())))
    out = jax.lax.dot_general(low, jnp.asarray(b, dtype), (((low.ndim - 1,), (0,)), ((), ())))
    return out * jnp.asarray(scale, dtype)
