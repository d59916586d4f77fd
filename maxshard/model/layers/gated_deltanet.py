"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5, as transformers'
`Qwen3NextGatedDeltaNet` computes it. It takes the place of `Attention` (same fields and call), so a decoder layer
calls either.

    q, k [b, L, key_heads, dk], v, z [b, L, value_heads, dv], b, a [b, L, value_heads]  (projections of x)
    q, k, v <- silu(causal depthwise conv of width linear_conv_kernel_dim), each channel on its own
    q, k    <- L2-normalised over dk (eps 1e-6 inside the root, as FLA); q is scaled by dk ** -0.5 in the rule
    g = -exp(A_log) * softplus(a + dt_bias) (log decay per value head), beta = sigmoid(b) (write strength)
    o = gated delta rule (layers/delta_rule.py), float32 state [value_heads, dk, dv] per sequence
    out = out_proj(RMSNorm(o) * silu(z))   (the norm over dv, a plain learned scale, never 1 + w)

Value heads repeat key heads (value head j reads key head j // (value_heads / key_heads)), so with the heads over
`tensor` each device holds whole groups: key heads are named like attention's kv heads, value heads like its query
heads. The convolution's kernel is kept per projection ([width, heads, dim]), so it shards with its heads.

Packed documents: the convolution reads no token of another document and the rule's state restarts at each
document (segment_ids), so each document computes as if alone.

The length sharded (context or sequence parallelism; under context in ring attention's balanced order): each
device convolves and runs the chunked rule on its own tokens, the conv's halo and the rule's chunk states passed
between the shards (layers/delta_rule_context.py); the same numbers as one device, nothing gathers the sequence.

Generation ("cache" collection mutable, as Attention decides it): the cache holds, per sequence, the conv's last
width - 1 inputs of q, k and v ([batch, width - 1, heads, dim]) and the rule's state ([batch, value_heads, dk, dv],
float32). A call of one token steps the recurrent form; a longer call (the prefill) runs the chunked form from the
cached state. A right-padded prefill marks its padding with position -1 (generation/decode.py): padding tokens
neither decay nor write the state, and each row's conv window ends at its last real token.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxshard.model.layers import delta_rule_context, kv_cache
from maxshard.model.layers.delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule
from maxshard.model.layers.linears import DenseGeneral
from maxshard.model.layers.norms import RMSNorm
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain
from maxshard.spec.model_config import ModelConfig

__all__ = ["GatedDeltaNet", "causal_conv", "l2_normalize", "CONV_CACHE_AXES", "STATE_CACHE_AXES"]

CONV_CACHE_AXES = (ax.CACHE_BATCH, ax.CACHE_LENGTH, ax.CACHE_KV_HEADS, ax.CACHE_KV)  # [batch, width - 1, heads, dim]
STATE_CACHE_AXES = (ax.CACHE_BATCH, ax.CACHE_KV_HEADS, ax.CACHE_KV, None)  # [batch, value_heads, dk, dv]


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 (transformers' and FLA's l2norm)."""
    x = jnp.asarray(x, jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x: jax.Array, kernel: jax.Array, history: jax.Array, segment_ids: jax.Array | None = None,
                history_segments: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """silu of the causal depthwise convolution of x [b, T, heads, dim] with kernel [width, heads, dim] (kernel[-1]
    multiplies the token itself, as torch's conv1d with width - 1 left padding), the window extended to the left by
    `history` [b, width - 1, heads, dim] (zeros in training; the previous shard's inputs with the length sharded:
    layers/delta_rule_context.py). With `segment_ids` [b, T] a token reads no input of another document;
    `history_segments` [b, width - 1] are the history's (None: the first token's). Returns (out [b, T, heads, dim],
    the window of width - 1 inputs as `history` is)."""
    width, length = kernel.shape[0], x.shape[1]
    full = jnp.concatenate([history.astype(x.dtype), x], axis=1)  # [b, width - 1 + T, heads, dim]
    if segment_ids is not None and history_segments is not None:
        seg = jnp.concatenate([history_segments.astype(segment_ids.dtype), segment_ids], axis=1)
    elif segment_ids is not None:
        seg = jnp.pad(segment_ids, [(0, 0), (width - 1, 0)], mode="edge")  # the zero history needs no mask
    out = jnp.zeros(x.shape, jnp.promote_types(x.dtype, kernel.dtype))
    for i in range(width):
        tap = full[:, i:i + length]
        if segment_ids is not None:
            tap = jnp.where((seg[:, i:i + length] == segment_ids)[..., None, None], tap, 0)
        out = out + tap * kernel[i]
    return jax.nn.silu(out).astype(x.dtype), full


def _last_window(full: jax.Array, real: jax.Array, width: int) -> jax.Array:
    """The width - 1 inputs ending at each row's last real token: full [b, width - 1 + T, ...], real [b] tokens."""
    index = real[:, None] + jnp.arange(width - 1)[None, :]  # full's row width - 1 + t holds token t
    return jnp.take_along_axis(full, index.reshape(*index.shape, 1, 1), axis=1)


def _zeros(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jnp.zeros(shape, dtype)


def _uniform(bound: float) -> Any:
    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def _log_uniform(low: float, high: float) -> Any:
    """A_log's initialiser: log of U(low, high), as transformers draws it."""
    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, low, high)).astype(dtype)
    return init


class GatedDeltaNet(nn.Module):
    """The gated DeltaNet token mixer (module docstring): x [batch, length, embed] -> [batch, length, embed].

    Parameters: query, key [embed, key_heads, dk]; value, z [embed, value_heads, dv]; b, a [embed, value_heads];
    query_conv, key_conv [width, key_heads, dk], value_conv [width, value_heads, dv]; A_log, dt_bias
    [value_heads]; norm/scale [dv]; out [value_heads, dv, embed]. Cache (generation): query_conv, key_conv,
    value_conv [batch, width - 1, heads, dim]; state [batch, value_heads, dk, dv] float32.
    """

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    def _dense(self, x: jax.Array, features: tuple[int, ...], axes: tuple[str, ...], name: str,
               target: str = "") -> jax.Array:
        """One input projection [b, L, embed] -> [b, L, *features]; `target` its lora_targets name, if any."""
        cfg = self.cfg
        rank = cfg.lora_rank_of(target) if target else 0
        return DenseGeneral(features, axes, 1, self.dtype, self.weight_dtype, rank, cfg.lora_scale, name=name)(x)

    def _conv_kernel(self, name: str, heads: int, dim: int, heads_axis: str) -> jax.Array:
        width = self.cfg.linear_conv_kernel_dim
        init = nn.with_logical_partitioning(_uniform(width ** -0.5), (None, heads_axis, ax.KV))  # torch's bound
        return jnp.asarray(self.param(name, init, (width, heads, dim), self.weight_dtype), self.dtype)

    def _head_param(self, name: str, init: Any) -> jax.Array:
        heads = self.cfg.linear_num_value_heads
        boxed = nn.with_logical_partitioning(init, (ax.HEADS,))
        return jnp.asarray(self.param(name, boxed, (heads,), self.weight_dtype), jnp.float32)

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        kh, vh = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        q = checkpoint_name(self._dense(x, (kh, dk), (ax.EMBED, ax.KV_HEADS, ax.KV), "query", "q"), "query_proj")
        k = checkpoint_name(self._dense(x, (kh, dk), (ax.EMBED, ax.KV_HEADS, ax.KV), "key", "k"), "key_proj")
        v = checkpoint_name(self._dense(x, (vh, dv), (ax.EMBED, ax.HEADS, ax.KV), "value", "v"), "value_proj")
        z = self._dense(x, (vh, dv), (ax.EMBED, ax.HEADS, ax.KV), "z")
        b = self._dense(x, (vh,), (ax.EMBED, ax.HEADS), "b")
        a = self._dense(x, (vh,), (ax.EMBED, ax.HEADS), "a")
        q, k = constrain(q, ax.KEY_VALUE), constrain(k, ax.KEY_VALUE)
        v, z = constrain(v, ax.QUERY), constrain(z, ax.QUERY)
        kernels = {name: self._conv_kernel(f"{name}_conv", heads, dim, axis) for name, heads, dim, axis in (
            ("query", kh, dk, ax.KV_HEADS), ("key", kh, dk, ax.KV_HEADS), ("value", vh, dv, ax.HEADS))}

        beta = jax.nn.sigmoid(jnp.asarray(b, jnp.float32))
        g = -jnp.exp(self._head_param("A_log", _log_uniform(0.01, 16.0))) * jax.nn.softplus(
            jnp.asarray(a, jnp.float32) + self._head_param("dt_bias", nn.initializers.ones))

        projected = dict(query=q, key=k, value=v)
        if kv_cache.decoding(self):
            return self._output(self._decode(projected, kernels, g, beta, positions), z)
        return self._output(self._train(projected, kernels, g, beta, segment_ids), z)

    def _train(self, projected: dict[str, jax.Array], kernels: dict[str, jax.Array], g: jax.Array,
               beta: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """Training (and any call without a cache): the conv from zeros and the chunked rule, per document."""
        if delta_rule_context.length_axes():  # the length sharded: each device its own tokens, states passed
            return self._train_sharded(projected, kernels, g, beta, segment_ids)
        width = self.cfg.linear_conv_kernel_dim
        mixed = {}
        for name, t in projected.items():
            history = jnp.zeros((t.shape[0], width - 1, *t.shape[2:]), t.dtype)
            mixed[name] = causal_conv(t, kernels[name], history, segment_ids)[0]
        out, _ = chunked_gated_delta_rule(l2_normalize(mixed["query"]), l2_normalize(mixed["key"]), mixed["value"],
                                          g, beta, chunk_size=self.cfg.delta_chunk_size, segment_ids=segment_ids)
        return out

    def _train_sharded(self, projected: dict[str, jax.Array], kernels: dict[str, jax.Array], g: jax.Array,
                       beta: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """`_train` with the length sharded (context or sequence parallelism, in whatever order the sequence
        arrives): the conv's halo and the rule's chunk states cross devices (layers/delta_rule_context.py)."""
        if segment_ids is None:
            segment_ids = jnp.zeros(projected["value"].shape[:2], jnp.int32)
        layouts = dict(query=ax.KEY_VALUE, key=ax.KEY_VALUE, value=ax.QUERY)
        mixed = {name: delta_rule_context.sharded_causal_conv(t, kernels[name], segment_ids, layouts[name])
                 for name, t in projected.items()}
        out, _ = delta_rule_context.sharded_gated_delta_rule(
            l2_normalize(mixed["query"]), l2_normalize(mixed["key"]), mixed["value"], g, beta,
            chunk_size=self.cfg.delta_chunk_size, segment_ids=segment_ids)
        return out

    def _decode(self, projected: dict[str, jax.Array], kernels: dict[str, jax.Array], g: jax.Array,
                beta: jax.Array, positions: jax.Array) -> jax.Array:
        """Generation: the conv windows and the rule's state come from the cache and go back to it."""
        cfg = self.cfg
        width = cfg.linear_conv_kernel_dim
        batch, length = positions.shape
        real = jnp.sum(positions >= 0, axis=1)  # [b]: a prefill's right padding is at -1
        mixed = {}
        for name, t in projected.items():
            init = nn.with_logical_partitioning(_zeros, CONV_CACHE_AXES)
            window = self.variable(kv_cache.COLLECTION, f"{name}_conv", init, (batch, width - 1, *t.shape[2:]),
                                   self.dtype)
            mixed[name], full = causal_conv(t, kernels[name], window.value)
            window.value = constrain(_last_window(full, real, width), CONV_CACHE_AXES)
        shape = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        init = nn.with_logical_partitioning(_zeros, STATE_CACHE_AXES)
        state = self.variable(kv_cache.COLLECTION, "state", init, shape, jnp.float32)
        live = positions >= 0
        g, beta = jnp.where(live[..., None], g, 0.0), jnp.where(live[..., None], beta, 0.0)  # padding: no effect
        args = (l2_normalize(mixed["query"]), l2_normalize(mixed["key"]), mixed["value"], g, beta)
        if length == 1:
            out, final = recurrent_gated_delta_rule(*args, initial_state=state.value)
        else:
            out, final = chunked_gated_delta_rule(*args, chunk_size=cfg.delta_chunk_size, initial_state=state.value)
        state.value = constrain(final, STATE_CACHE_AXES)
        return out

    def _output(self, out: jax.Array, z: jax.Array) -> jax.Array:
        """RMSNorm(o) * silu(z), [b, L, value_heads, dv] -> the output projection [b, L, embed]."""
        cfg = self.cfg
        normed = RMSNorm(cfg.norm_epsilon, jnp.float32, self.weight_dtype, name="norm")(constrain(out, ax.QUERY))
        gated = jnp.asarray(normed * jax.nn.silu(jnp.asarray(z, jnp.float32)), self.dtype)
        proj = DenseGeneral((cfg.emb_dim,), (ax.HEADS, ax.KV, ax.EMBED), 2, self.dtype, self.weight_dtype,
                            cfg.lora_rank_of("o"), cfg.lora_scale, name="out")
        return checkpoint_name(proj(gated), "out_proj")
