"""Multi-head latent attention (DeepSeek-V2/V3, `attention_type: mla`): keys and values come from one small latent
per token, so generation caches that latent instead of every head's keys and values.

Shapes (H heads; r = kv_lora_rank, n = qk_nope_head_dim, p = qk_rope_head_dim, v = v_head_dim):

    query      x [b, L, embed] -> (q_lora_rank: query_down, RMSNorm) -> query -> [b, L, H, n + p]
    latent     x -> kv_down -> [b, L, r + p] = (c, k_rope): c RMS-normalised (kv_down_norm), k_rope ONE RoPE key
               [b, L, p] that every head shares
    keys       [key(c) [b, L, H, n], k_rope]         values  value(c) [b, L, H, v]
    scores     q . k * softmax_scale(n + p)          output  out([b, L, H, v]) -> [b, L, embed]

RoPE rotates only the p features (rope.py; YaRN's frequencies, cos/sin factor and softmax mscale included). Training
runs any `attention` implementation on these q [H, n + p], k [H, n + p], v [H, v] heads (attention_ops.attend: the
kernels that need one head width get zero-padded values).

Generation caches per token and layer the normalised latent c and the rotated k_rope: r + p values
(kv_cache.LatentCache), not 2 x H x head_dim. The key and value projections are absorbed (DeepSeek-V2's trick):

    q_nope . key(c) = (q_nope . W_key) . c          sum_s p_s value(c_s) = (sum_s p_s c_s) . W_value

so a query is moved into the latent space ([b, T, H, r]) and scores against the cached latents directly, and the
attention's latent output goes through W_value afterwards; no key or value head is expanded from the cache. A
prefill of a long prompt, where expanding the cache's keys and values once costs fewer FLOPs than scoring every
query in the latent space, expands them instead (`_expanding_is_cheaper`).

Parameters (under the layer's "attention"; [in, out] layout as DenseGeneral keeps them; Hugging Face's
DeepseekV3Attention names in brackets, whose Linear weights are [out, in]):

    query_down       kernel [embed, q_lora_rank]                    [q_a_proj]          (q_lora_rank > 0)
    query_down_norm  scale  [q_lora_rank]                           [q_a_layernorm]     (q_lora_rank > 0)
    query            kernel [q_lora_rank or embed, H, n + p]        [q_b_proj or q_proj]
    kv_down          kernel [embed, r + p]                          [kv_a_proj_with_mqa]
    kv_down_norm     scale  [r]                                     [kv_a_layernorm]
    key              kernel [r, H, n]                               [kv_b_proj rows h*(n+v) .. h*(n+v)+n-1 of head h]
    value            kernel [r, H, v]                               [kv_b_proj rows h*(n+v)+n .. (h+1)*(n+v)-1]
    out              kernel [H, v, embed]                           [o_proj]

The p RoPE columns of query (per head) and of kv_down come from Hugging Face in DeepSeek's interleaved pair order
and are reordered with `rope.deinterleaved(p)` (rope.py). LoRA (`lora_targets`): q adapts query_down and query, k
adapts key, v adapts value, o adapts out; kv_down, shared by keys and values, takes none. The names query, key,
value and out are attention.py's, so the remat policies (`query_proj`, `key_proj`, `value_proj`, `out_proj`: the
per-head projections; the latents are recomputed) and quantization's module rules apply as they are.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import kv_cache, rope
from maxshard.model.layers.attention_ops import attend
from maxshard.model.layers.linears import DenseGeneral
from maxshard.model.layers.norms import RMSNorm
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = ["LatentAttention", "cache_width"]


def cache_width(cfg: ModelConfig) -> int:
    """Values generation caches per token and layer: the latent and the shared RoPE key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


class LatentAttention(nn.Module):
    """Multi-head latent attention: `Attention`'s call, (x, segment_ids, positions) -> [batch, length, embed]."""

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    def _dense(self, features: tuple[int, ...], axes: tuple[str, ...], num_in: int, name: str,
               target: str | None) -> DenseGeneral:
        rank = self.cfg.lora_rank_of(target) if target else 0
        return DenseGeneral(features, axes, num_in, self.dtype, self.weight_dtype, rank, self.cfg.lora_scale,
                            name=name)

    def _norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.cfg.norm_epsilon, self.dtype, self.weight_dtype, name=name)

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        heads, nope, rope_dim, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        inv_freq, cos_sin = rope.frequencies_for(cfg), rope.cos_sin_scale(cfg)
        scale = rope.softmax_scale(cfg, nope + rope_dim)

        query_in, query_in_axis = x, ax.EMBED
        if cfg.q_lora_rank:
            latent_q = self._dense((cfg.q_lora_rank,), (ax.EMBED, ax.Q_LORA), 1, "query_down", "q")(x)
            query_in = self._norm("query_down_norm")(constrain(latent_q, ax.LATENT_Q))
            query_in_axis = ax.Q_LORA
        q = self._dense((heads, nope + rope_dim), (query_in_axis, ax.HEADS, ax.KV), 1, "query", "q")(query_in)
        q = constrain(checkpoint_name(q, "query_proj"), ax.QUERY)
        q_nope, q_rope = q[..., :nope], rope.apply_rope(q[..., nope:], positions, inv_freq, cos_sin)

        kv = self._dense((rank + rope_dim,), (ax.EMBED, ax.KV_LORA), 1, "kv_down", None)(x)
        kv = constrain(kv, ax.LATENT_KV)
        latent = constrain(self._norm("kv_down_norm")(kv[..., :rank]), ax.LATENT_KV)
        k_rope = rope.apply_rope(kv[..., rank:], positions, inv_freq, cos_sin)  # [b, L, p]: one head for all
        key = self._dense((heads, nope), (ax.KV_LORA, ax.HEADS, ax.KV), 1, "key", "k")
        value = self._dense((heads, cfg.v_head_dim), (ax.KV_LORA, ax.HEADS, ax.KV), 1, "value", "v")

        if kv_cache.decoding(self):  # generation: the latent and RoPE key join the cache
            latents, rope_keys, mask = kv_cache.LatentCache(self.dtype, name="cache")(latent, k_rope, positions)
            if _expanding_is_cheaper(cfg, queries=q.shape[1], cached=latents.shape[1]):  # a long prompt's prefill
                k = jnp.concatenate([key(latents), _shared(rope_keys, heads)], axis=-1)
                q = jnp.concatenate([q_nope, q_rope], axis=-1) * scale
                out = kv_cache.attend(q, k, value(latents), mask[:, None, None], self.dtype)
            else:  # a decode step
                out = self._absorbed(q_nope * scale, q_rope * scale, latents, rope_keys, mask, key, value)
            return self._output(out)

        k_nope = constrain(checkpoint_name(key(latent), "key_proj"), ax.KEY_VALUE)
        v = constrain(checkpoint_name(value(latent), "value_proj"), ax.KEY_VALUE)
        k = jnp.concatenate([k_nope, _shared(k_rope, heads)], axis=-1)
        q = jnp.concatenate([q_nope, q_rope], axis=-1) * scale
        k = constrain(k, ax.KEY_VALUE)
        out = attend(q, k, v, segment_ids, segment_ids, cfg.attention, cfg.attention_block_q, cfg.attention_block_kv)
        return self._output(out)

    def _absorbed(self, q_nope: jax.Array, q_rope: jax.Array, latents: jax.Array, rope_keys: jax.Array,
                  mask: jax.Array, key: DenseGeneral, value: DenseGeneral) -> jax.Array:
        """Attention of scaled q_nope [b, T, H, n] and q_rope [b, T, H, p] over the cache (latents [b, S, r],
        rope_keys [b, S, p], mask [b, T, S]) with the key and value projections absorbed -> [b, T, H, v].
        Logits and softmax in float32, as kv_cache.attend."""
        w_key, w_value = _kernel_of(key, self.dtype), _kernel_of(value, self.dtype)  # [r, H, n], [r, H, v]
        q_latent = constrain(jnp.einsum("bthn,rhn->bthr", q_nope, w_key), ax.ABSORBED_QUERY)
        logits = (jnp.einsum("bthr,bsr->bhts", q_latent, latents, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthp,bsp->bhts", q_rope, rope_keys, preferred_element_type=jnp.float32))
        logits = jnp.where(mask[:, None], logits, jnp.finfo(jnp.float32).min)
        probs = jnp.asarray(jax.nn.softmax(logits, axis=-1), self.dtype)
        out_latent = constrain(jnp.einsum("bhts,bsr->bthr", probs, latents), ax.ABSORBED_QUERY)
        return jnp.einsum("bthr,rhv->bthv", out_latent, w_value)

    def _output(self, out: jax.Array) -> jax.Array:
        """[batch, length, heads, v_head_dim] -> the output projection [batch, length, embed]."""
        out = constrain(out, ax.QUERY)
        proj = self._dense((self.cfg.emb_dim,), (ax.HEADS, ax.KV, ax.EMBED), 2, "out", "o")
        return checkpoint_name(proj(out), "out_proj")


def _shared(rope_key: jax.Array, heads: int) -> jax.Array:
    """The RoPE key [b, L, p] as every head's: [b, L, heads, p] (a broadcast)."""
    return jnp.broadcast_to(rope_key[:, :, None], (*rope_key.shape[:2], heads, rope_key.shape[-1]))


def _expanding_is_cheaper(cfg: ModelConfig, queries: int, cached: int) -> bool:
    """Whether attending `queries` queries over `cached` cache slots costs fewer FLOPs (per sequence and head) with
    keys and values expanded from the cached latents than with the projections absorbed:

        expanded   cached r (n + v)  [key, value]  +  queries cached (n + p + v)  [scores, values]
        absorbed   queries r (n + v) [query, out]  +  queries cached (2 r + p)    [scores, values in latent space]

    A decode step (one query) absorbs; a prefill expands once the prompt is longer than about r (n + v) / (2r - n
    - v) tokens (DeepSeek-V3: 171), as training attends."""
    r, n, p, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    expanded = cached * r * (n + v) + queries * cached * (n + p + v)
    absorbed = queries * r * (n + v) + queries * cached * (2 * r + p)
    return expanded < absorbed


def _kernel_of(dense: DenseGeneral, dtype: Any) -> jax.Array:
    """The weight `dense` multiplies by, [in, *features], its LoRA correction included (scale * A @ B): what
    generation absorbs. Read from the bound module's parameters (created by the training path at init)."""
    params = nn.unbox(dense.variables["params"])
    kernel = jnp.asarray(params["kernel"], dtype)
    if "lora_a" in params:
        a, b = jnp.asarray(params["lora_a"], dtype), jnp.asarray(params["lora_b"], dtype)
        kernel = kernel + jnp.tensordot(a, b, axes=1) * jnp.asarray(dense.lora_scale, dtype)
    return kernel
