"""Gated feed-forward: wo(act(x @ wi_0, x @ wi_1)); x [batch, length, embed], hidden [.., mlp]. The gate's
activation (`mlp_activation`, `GatedActivation`): SwiGLU silu(gate) * up (Llama, Qwen, DeepSeek), GeGLU with
tanh-approximated GELU (Gemma), or GPT-OSS's clamped SwiGLU; MoE experts (layers/moe*.py) use the same function.

The gate and up projections run as one matmul: their kernels (kept as two parameters, `wi_0` and `wi_1`, as
checkpoints and Hugging Face conversion name them) are stacked into [embed, 2, mlp] for the step. One matmul reads
x once and, in the backward pass, produces x's gradient in one contraction instead of two that are then added
(what it saves: benchmarks/README.md, "Measured with `remat_policy: auto` and the stacked gate/up").
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import lora
from maxshard.model.layers.initializers import default_kernel_init
from maxshard.model.layers.linears import DenseGeneral
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = ["MLP", "GatedActivation", "activation"]


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """hidden = f(gate, up) of a gated MLP, by `mlp_activation`:

    silu:            silu(gate) * up
    gelu_tanh:       gelu_tanh(gate) * up   (PyTorch's gelu(approximate="tanh"))
    clamped_swiglu:  g * sigmoid(alpha * g) * (u + 1), g = min(gate, limit), u = clip(up, -limit, limit)  (GPT-OSS)
    """

    kind: str = "silu"
    limit: float = 7.0
    alpha: float = 1.702

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.kind == "silu":
            return nn.silu(gate) * up
        if self.kind == "gelu_tanh":
            return nn.gelu(gate, approximate=True) * up
        if self.kind == "clamped_swiglu":
            gate, up = jnp.minimum(gate, self.limit), jnp.clip(up, -self.limit, self.limit)
            return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1)
        raise ValueError(f"mlp_activation={self.kind!r}: expected silu, gelu_tanh or clamped_swiglu")


def activation(cfg: ModelConfig) -> GatedActivation:
    """The model's gated activation (`mlp_activation` and its clamp and slope)."""
    return GatedActivation(cfg.mlp_activation, cfg.swiglu_limit, cfg.swiglu_alpha)


class Kernel(nn.Module):
    """A [embed, mlp] kernel named like DenseGeneral's (`<name>/kernel`, same initialiser), returned unapplied,
    with its LoRA adapter's output on `x` beside it (None without one)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    dtype: jnp.dtype
    weight_dtype: jnp.dtype
    lora_rank: int = 0
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        init = nn.with_logical_partitioning(default_kernel_init(1), self.axes)
        kernel = self.param("kernel", init, self.shape, self.weight_dtype)
        if not self.lora_rank:
            return kernel, None
        delta = lora.adapter_output(self, x, self.axes[:1], self.axes[1:], self.shape[1:], self.lora_rank,
                                    self.lora_scale, self.dtype, self.weight_dtype)
        return kernel, delta


class MLP(nn.Module):
    """`lora_ranks`: the LoRA ranks of (gate, up, down), 0 where a projection has no adapter."""

    hidden: int
    dtype: jnp.dtype
    weight_dtype: jnp.dtype
    lora_ranks: tuple[int, int, int] = (0, 0, 0)
    lora_scale: float = 0.0
    gated: GatedActivation = GatedActivation()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        emb = x.shape[-1]
        pairs = [Kernel((emb, self.hidden), (ax.EMBED, ax.MLP), self.dtype, self.weight_dtype, rank, self.lora_scale,
                        name=name)(x) for name, rank in zip(("wi_0", "wi_1"), self.lora_ranks[:2])]
        stacked = jnp.stack([jnp.asarray(k, self.dtype) for k, _ in pairs], axis=1)  # [embed, 2, mlp]
        both = jnp.einsum("...e,ekf->...kf", jnp.asarray(x, self.dtype), stacked)
        if any(delta is not None for _, delta in pairs):  # LoRA: each adapter's output joins its half
            zero = jnp.zeros(both.shape[:-2] + both.shape[-1:], both.dtype)
            both = both + jnp.stack([zero if d is None else d for _, d in pairs], axis=-2)
        both = constrain(both, (ax.BATCH, ax.LENGTH, None, ax.ACT_MLP))
        hidden = constrain(self.gated(both[..., 0, :], both[..., 1, :]), ax.MLP_HIDDEN)
        down = DenseGeneral((emb,), (ax.MLP, ax.EMBED), 1, self.dtype, self.weight_dtype, self.lora_ranks[2],
                            self.lora_scale, name="wo")
        return down(hidden)
