"""Causal self-attention with grouped-query heads, RoPE and packed-document (segment) masking.

Shapes: x [batch, length, embed]; q [batch, length, heads, head_dim]; k, v [batch, length, kv_heads, head_dim].
Query heads are grouped over kv heads: heads = kv_heads * group. With `qk_norm` (Qwen3) each query and key head is
RMS-normalised over head_dim (one learned [head_dim] scale each) before RoPE; with `qk_norm_all_heads` (OLMo 2/3) the
whole query [heads x head_dim] and the whole key [kv_heads x head_dim] are each one RMSNorm (scales [heads, head_dim]
and [kv_heads, head_dim]), as transformers' q_norm over q_proj's output. Logits and softmax are float32. The score,
softmax and value math is `attention_ops.attend`, one of several implementations (the `attention` key).
For generation (the "cache" collection mutable in an apply) k/v go to the KV cache and the queries attend over it
(layers/kv_cache.py); otherwise, as in training, over this call's own k/v.

Local/global models (spec/blocks.py): a `local` layer sees only the last `sliding_window` keys (and uses
`rope_local_max_timescale`, unscaled, when set: Gemma 3); `attn_logit_softcapping` caps the scaled logits (Gemma 2);
`query_pre_attn_scalar` replaces head_dim in the softmax scale (Gemma); `attention_sinks` adds a learned logit per
query head, "sinks" [heads], to each softmax's denominator (GPT-OSS); `attention_bias` puts biases on q, k, v and
the output (GPT-OSS), `qkv_bias` on q, k and v only (GLM-4.5).

Llama 4: a local layer with `attention_chunk_size` attends within its chunk (query p sees keys of positions
p // size x size .. p), the chunk boundaries cutting the packed documents' segments (`chunked_segments`), so every
kernel applies it as it applies documents, and a window of the chunk's size (a superset of it) lets each kernel
skip the key blocks before it; a layer with `rope=False` (`rope_layers`) rotates nothing and, with
`nope_temperature_scale`, scales its queries by a temperature that grows with the position (`nope_temperature`);
`qk_l2_norm` divides the rotated q and k of the RoPE layers by their RMS over head_dim, without a scale.

Qwen3-Next / Qwen3.5: with `attention_output_gate` the query projection is twice as wide, each head's
[query (head_dim), gate (head_dim)] side by side as transformers' q_proj rows hold them (one kernel
[embed, heads, 2 x head_dim], so a checkpoint's q_proj maps as it is and a LoRA on "q" adapts both halves, as PEFT's
on q_proj does); the attention output is multiplied by sigmoid(gate) before the output projection. With
`partial_rotary_factor` < 1 RoPE turns only the first head_dim x factor features of each head (layers/rope.py).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import kv_cache, rope
from maxshard.model.layers.attention_ops import attend
from maxshard.model.layers.linears import DenseGeneral
from maxshard.model.layers.norms import RMSNorm, rms_normalized
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = ["Attention", "local_block", "chunked_segments", "nope_temperature"]


def local_block(window: int) -> int:
    """The largest block a local layer of `window` keys uses: window / 8 rounded down to a power of two, at least
    128 (a TPU lane width, splash's smallest block)."""
    return max(128, 1 << max((window // 8).bit_length() - 1, 0))


def chunked_segments(segment_ids: jax.Array, positions: jax.Array, chunk: int) -> jax.Array:
    """[batch, length] segment ids that also differ across chunk boundaries: (document, position // chunk) as one
    int32 id, so "same segment" is "same document and same chunk". Positions restart with each document, so a
    packed document is chunked as it would be alone."""
    chunks = segment_ids.shape[1] // chunk + 1  # positions stay below the row's length
    return segment_ids.astype(jnp.int32) * chunks + positions.astype(jnp.int32) // chunk


def nope_temperature(positions: jax.Array, scale: float, floor: int) -> jax.Array:
    """[batch, length, 1, 1] float32: log(floor((p + 1) / floor) + 1) x scale + 1 at each position p, the factor on
    a NoPE layer's queries (1 up to position floor - 2, then growing slowly)."""
    steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / floor)
    return (jnp.log1p(steps) * scale + 1.0)[..., None, None]


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype
    local: bool = False  # a sliding-window or chunked layer (spec/blocks.py)
    rope: bool = True  # rotates its queries and keys (False: NoPE, `rope_layers`)
    gives_kv: bool = False  # also returns its keys and values, for the KV-shared layers after it (Gemma 4)

    def _proj(self, x: jax.Array, heads: int, heads_axis: str, name: str, target: str, width: int = 0) -> jax.Array:
        """One of the q/k/v projections (`target`: its lora_targets name) to heads of `width` (head_dim by
        default), named for the remat policies."""
        dense = DenseGeneral((heads, width or self.cfg.head_dim), (ax.EMBED, heads_axis, ax.KV), 1, self.dtype,
                             self.weight_dtype, self.cfg.lora_rank_of(target), self.cfg.lora_scale,
                             self.cfg.attention_bias or self.cfg.qkv_bias, name=name)
        return checkpoint_name(dense(x), f"{name}_proj")

    @property
    def chunk(self) -> int:
        return self.cfg.attention_chunk_size if self.local else 0

    @property
    def span(self) -> int:
        """The last keys a query may see, its own included (`ModelConfig.local_span`: the window, or the chunk,
        which lies within a query's last `chunk` positions, so a chunked layer is also a window of that size, which
        lets every kernel skip the key blocks before it; the cut segments keep the chunk exact); 0 for a global
        layer."""
        return self.cfg.local_span if self.local else 0

    def _blocks(self) -> tuple[int, int]:
        """(block_q, block_kv) of the blockwise and splash kernels. A local layer's blocks shrink to
        `local_block(window)` when that is smaller: a query block needs the window plus its own length of keys, in
        whole key blocks, so blocks of B cost about (window + B) / window of the window-proportional ideal (1.5x at
        a 1k window with 512-token blocks, 1.125x with 128: benchmarks/attention_window.py)."""
        q, kv = self.cfg.attention_block_q, self.cfg.attention_block_kv
        if not self.span:
            return q, kv
        small = local_block(self.span)
        fits = self.cfg.max_target_length % small == 0
        return (min(q, small), min(kv, small)) if fits else (q, kv)

    def _rope(self) -> tuple[np.ndarray, float]:
        """(inverse frequencies, cos/sin scale) of this layer: a local layer with its own base runs plain RoPE."""
        cfg = self.cfg
        if self.local and cfg.rope_local_max_timescale:
            return rope.inverse_frequencies(rope.rotary_dim(cfg), cfg.rope_local_max_timescale), 1.0
        return rope.frequencies_for(cfg), rope.cos_sin_scale(cfg)  # YaRN scales both (rope.py)

    def _scale(self) -> float:
        cfg = self.cfg
        return cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else rope.softmax_scale(cfg, cfg.head_dim)

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, shared_kv: tuple | None = None
                 ) -> jax.Array | tuple[jax.Array, tuple]:
        """[batch, length, embed] -> [batch, length, embed]. A KV-shared layer (`shared_kv`: what the layer it
        reuses gave) projects only its queries; with `gives_kv` the output comes with (keys, values, mask): this
        call's keys and values (mask None), or in generation the cache's with their mask."""
        cfg = self.cfg
        q, gate = self._query(x)
        if cfg.qk_norm:  # Qwen3: each head normalised over head_dim (OLMo: all heads at once), before RoPE
            q = self._qk_norm(q, "query_norm", ax.HEADS)
        projected = None if shared_kv else constrain(self._proj(x, cfg.num_kv_heads, ax.KV_HEADS, "key", "k"),
                                                     ax.KEY_VALUE)
        k = self._qk_norm(projected, "key_norm", ax.KV_HEADS) if cfg.qk_norm and not shared_kv else projected
        q, k = self._positioned(q, k, positions)
        q = q * self._scale()
        if shared_kv:
            return self._attend(q, gate, *shared_kv, segment_ids, positions)
        if cfg.global_values_from_keys:  # Gemma 4's attention_k_eq_v (this config is the layer's own: spec/blocks.py)
            v = projected
        else:
            v = constrain(self._proj(x, cfg.num_kv_heads, ax.KV_HEADS, "value", "v"), ax.KEY_VALUE)
        if cfg.value_norm:  # Gemma 4: each value head over head_dim, no scale
            v = rms_normalized(v, cfg.norm_epsilon)
        mask = None
        if kv_cache.decoding(self):  # generation: this call's k/v join the cache; queries attend over it
            k, v, mask = kv_cache.KVCache(self.dtype, self.span, self.chunk, name="cache")(k, v, positions)
        out = self._attend(q, gate, k, v, mask, segment_ids, positions)
        return (out, (k, v, mask)) if self.gives_kv else out

    def _attend(self, q: jax.Array, gate: jax.Array | None, k: jax.Array, v: jax.Array, mask: jax.Array | None,
                segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """The attention of the rotated, scaled q over k and v: the cache's under `mask` in generation, else this
        call's (its kernel, `attention`) -> the output projection."""
        cfg = self.cfg
        sinks = self._sinks() if cfg.attention_sinks else None
        softcap = cfg.attn_logit_softcapping
        if mask is not None:
            return self._output(kv_cache.attend(q, k, v, mask, self.dtype, softcap, sinks), gate)
        if self.chunk:
            segment_ids = chunked_segments(segment_ids, positions, self.chunk)
        out = attend(q, k, v, segment_ids, segment_ids, cfg.attention, *self._blocks(), window=self.span,
                     softcap=softcap, sinks=sinks)
        return self._output(out, gate)

    def _positioned(self, q: jax.Array, k: jax.Array | None, positions: jax.Array
                    ) -> tuple[jax.Array, jax.Array | None]:
        """q and k (None in a KV-shared layer) with their positions applied: rotated (then L2-normalised with
        `qk_l2_norm`), or in a NoPE layer unrotated, the queries scaled by `nope_temperature` where it is set."""
        cfg = self.cfg
        if not self.rope:
            if not cfg.nope_temperature_scale:
                return q, k
            temperature = nope_temperature(positions, cfg.nope_temperature_scale, cfg.nope_temperature_floor)
            return jnp.asarray(q * temperature, q.dtype), k
        inv_freq, cos_sin = self._rope()
        q, k = (None if a is None else rope.apply_rope(a, positions, inv_freq, cos_sin) for a in (q, k))
        if cfg.qk_l2_norm:
            q, k = (None if a is None else rms_normalized(a, cfg.norm_epsilon) for a in (q, k))
        return q, k

    def _qk_norm(self, x: jax.Array, name: str, heads_axis: str) -> jax.Array:
        """q or k [batch, length, heads, head_dim] RMS-normalised per head, or over all heads with
        `qk_norm_all_heads`."""
        cfg = self.cfg
        axes = (heads_axis, ax.KV) if cfg.qk_norm_all_heads else (ax.NORM,)
        return RMSNorm(cfg.norm_epsilon, self.dtype, self.weight_dtype, cfg.norm_unit_offset, axes, name=name)(x)

    def _query(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(q [batch, length, heads, head_dim], the output gate of the same shape or None): with
        `attention_output_gate` one projection to [query, gate] per head, split."""
        cfg = self.cfg
        if not cfg.attention_output_gate:
            return constrain(self._proj(x, cfg.num_heads, ax.HEADS, "query", "q"), ax.QUERY), None
        both = self._proj(x, cfg.num_heads, ax.HEADS, "query", "q", 2 * cfg.head_dim)
        q, gate = jnp.split(both, 2, axis=-1)
        return constrain(q, ax.QUERY), constrain(gate, ax.QUERY)

    def _sinks(self) -> jax.Array:
        """GPT-OSS's per-head sink logits [heads] (float32 in the softmax)."""
        init = nn.with_logical_partitioning(nn.initializers.zeros, (ax.HEADS,))
        return jnp.asarray(self.param("sinks", init, (self.cfg.num_heads,), self.weight_dtype), jnp.float32)

    def _output(self, out: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """[batch, length, heads, head_dim] (times sigmoid(gate) when gated) -> the output projection
        [batch, length, embed]."""
        out = constrain(out, ax.QUERY)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.astype(out.dtype))
        proj = DenseGeneral((self.cfg.emb_dim,), (ax.HEADS, ax.KV, ax.EMBED), 2, self.dtype, self.weight_dtype,
                            self.cfg.lora_rank_of("o"), self.cfg.lora_scale, self.cfg.attention_bias, name="out")
        return checkpoint_name(proj(out), "out_proj")
