"""The decoder block and the stack of blocks (scanned or unrolled, with a configurable remat policy).

Remat policies (`remat_policy`), from most memory to least:
  none               keep every activation for the backward pass (no recompute)
  minimal            save every matmul output, recompute only elementwise work
  save_qkv_out_proj  save the q/k/v and attention-output projections (named with `checkpoint_name`)
  save_qkv_proj      save only the q/k/v projections
  save_out_proj      save only the attention-output projection
  full               save only each layer's input; recompute the whole layer
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard import axis_names as ax
from maxshard.config import Config
from maxshard.layers.attention import Attention
from maxshard.layers.mlp import MLP
from maxshard.layers.norms import RMSNorm
from maxshard.sharding import constrain

__all__ = ["DecoderLayer", "Decoder", "remat_policy"]

_SAVED_NAMES = {
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_out_proj": ("out_proj",),
    "save_qkv_out_proj": ("query_proj", "key_proj", "value_proj", "out_proj"),
}


def remat_policy(name: str) -> Any:
    """The `jax.checkpoint` policy for a `remat_policy` name (None: recompute everything)."""
    if name == "minimal":
        return jax.checkpoint_policies.dots_saveable
    if name in _SAVED_NAMES:
        return jax.checkpoint_policies.save_only_these_names(*_SAVED_NAMES[name])
    return None


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). Returns (x, None) so `nn.scan` can carry x."""

    cfg: Config
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> tuple[jax.Array, None]:
        cfg, dt, wdt = self.cfg, self.dtype, self.weight_dtype
        x = constrain(x, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))
        h = RMSNorm(cfg.norm_epsilon, dt, wdt, name="attention_norm")(x)
        x = x + Attention(cfg, dt, wdt, name="attention")(h, segment_ids, positions)
        h = RMSNorm(cfg.norm_epsilon, dt, wdt, name="mlp_norm")(x)
        x = x + MLP(cfg.mlp_dim, dt, wdt, name="mlp")(h)
        return constrain(x, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED)), None


def _layer_class(cfg: Config) -> type[nn.Module]:
    if cfg.remat_policy == "none":
        return DecoderLayer
    return nn.remat(DecoderLayer, policy=remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)


class Decoder(nn.Module):
    """`num_layers` blocks: one scanned block with a leading "layers" axis, or `layers_0 .. layers_{n-1}`."""

    cfg: Config
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        cfg, layer = self.cfg, _layer_class(self.cfg)
        if cfg.scan_layers:
            stack = nn.scan(
                layer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: ax.LAYERS},
            )
            x, _ = stack(cfg, self.dtype, self.weight_dtype, name="layers")(x, segment_ids, positions)
            return x
        for i in range(cfg.num_layers):
            x, _ = layer(cfg, self.dtype, self.weight_dtype, name=f"layers_{i}")(x, segment_ids, positions)
        return x
