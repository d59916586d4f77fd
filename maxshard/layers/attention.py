"""Causal self-attention with grouped-query heads, RoPE and packed-document (segment) masking.

Shapes: x [batch, length, embed]; q [batch, length, heads, head_dim]; k, v [batch, length, kv_heads, head_dim].
Query heads are grouped over kv heads: heads = kv_heads * group. Logits and softmax are float32. The score,
softmax and value math is `attention_ops.attend`, one of several implementations (the `attention` key).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxshard import axis_names as ax
from maxshard.model_config import ModelConfig
from maxshard.layers.attention_ops import attend
from maxshard.layers.embeddings import apply_rope
from maxshard.layers.linears import DenseGeneral
from maxshard.sharding import constrain

__all__ = ["Attention", "attention_mask"]


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """[batch, 1, 1, q_length, kv_length] bool: causal and inside the same document."""
    length = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]  # [batch, q, kv]
    return (causal[None] & same_doc)[:, None, None]


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    def _proj(self, x: jax.Array, heads: int, heads_axis: str, name: str) -> jax.Array:
        dense = DenseGeneral(
            (heads, self.cfg.head_dim), (ax.EMBED, heads_axis, ax.KV), 1, self.dtype, self.weight_dtype, name=name
        )
        return checkpoint_name(dense(x), f"{name}_proj")

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        kv_heads = cfg.num_kv_heads
        q = constrain(self._proj(x, cfg.num_heads, ax.HEADS, "query"), (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.ACT_KV))
        k = constrain(self._proj(x, kv_heads, ax.KV_HEADS, "key"), (ax.BATCH, ax.LENGTH, ax.ACT_KV_HEADS, ax.ACT_KV))
        v = constrain(self._proj(x, kv_heads, ax.KV_HEADS, "value"), (ax.BATCH, ax.LENGTH, ax.ACT_KV_HEADS, ax.ACT_KV))
        q = apply_rope(q, positions, cfg.rope_max_timescale) * (cfg.head_dim**-0.5)
        k = apply_rope(k, positions, cfg.rope_max_timescale)

        out = attend(q, k, v, segment_ids, segment_ids, cfg.attention, cfg.attention_block_q, cfg.attention_block_kv)
        out = constrain(out, (ax.BATCH, ax.LENGTH, ax.ACT_HEADS, ax.ACT_KV))
        proj = DenseGeneral((cfg.emb_dim,), (ax.HEADS, ax.KV, ax.EMBED), 2, self.dtype, self.weight_dtype, name="out")
        return checkpoint_name(proj(out), "out_proj")
