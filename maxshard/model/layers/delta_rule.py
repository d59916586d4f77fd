"""The gated delta rule (Gated DeltaNet, Yang et al.), as pure JAX functions: a chunked form for training and prefill,
a token-by-token recurrent form for decoding. Both compute, per value head, with a float32 state S [dk, dv]:

    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (scale q_t)

q, k [batch, length, key_heads, dk] (L2-normalised by the caller: layers/gated_deltanet.py), v [batch, length,
value_heads, dv], g (log decay, <= 0) and beta (write strength) [batch, length, value_heads]. Value heads repeat key
heads: value head j reads key head j // (value_heads / key_heads), as transformers' torch_*_gated_delta_rule do.

Packed documents. With `segment_ids` [batch, length] the state starts from zero at each token whose segment differs
from the one before it, so every document is computed as if alone; `initial_state` [batch, value_heads, dk, dv]
continues the document of the first token. The final state is the last document's.

The chunked form. The sequence is cut into chunks of C tokens (padded inside to a multiple of C with tokens that
neither decay nor write, so the padding changes nothing). Within a chunk, with cumulative log decays G_i and the
pairwise decays D_ij = exp(G_i - G_j) for j <= i in the same document (0 otherwise), the chunk's writes are the
solution of one unit lower-triangular system (the UT transform, as transformers and FLA compute it):
    (I + strict_lower(beta_i k_i.k_j D_ij)) [U | W] = [beta v | beta k exp(G) r]
where r_i says whether token i continues the document the incoming state belongs to. Then a lax.scan over chunks
carries the state: v' = U - W S, o = (q exp(G) r) S + (q k^T * D) v', S <- exp(G_last) r_last S + (k exp(G_last - G)
same_last)^T v'. All of this is vectorised over chunks before the scan ([chunks, C, C] blocks, memory linear in
length: B * H * length * C floats); the scan keeps only the state-dependent matmuls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["chunked_gated_delta_rule", "recurrent_gated_delta_rule", "document_starts"]

# Every product of the rule at full float32 precision: GPUs (TF32) and TPUs (one bfloat16 pass) multiply float32 at
# reduced precision by default, and the state carries each product's error through the whole sequence. The rule's
# products are a small part of the layer's (its projections dominate), so exactness costs little.
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def document_starts(segment_ids: jax.Array | None, length: int, batch: int) -> jax.Array:
    """[batch, length] bool: True where a token starts a new document (its segment differs from the previous
    token's). The first token never does: it continues the initial state."""
    if segment_ids is None:
        return jnp.zeros((batch, length), bool)
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((batch, 1), bool), changed], axis=1)


def _prepare(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, scale: float | None
             ) -> tuple[jax.Array, ...]:
    """float32 q (scaled), k repeated to the value heads, v, g, beta."""
    key_heads, value_heads = k.shape[2], v.shape[2]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    group = value_heads // key_heads
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q, k = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (q, k))
    q, k, v, g, beta = (jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta))
    return q * scale, k, v, g, beta


def _initial(initial_state: jax.Array | None, batch: int, heads: int, dk: int, dv: int) -> jax.Array:
    if initial_state is None:
        return jnp.zeros((batch, heads, dk, dv), jnp.float32)
    return jnp.asarray(initial_state, jnp.float32)


def recurrent_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                               segment_ids: jax.Array | None = None, initial_state: jax.Array | None = None,
                               scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """The delta rule one token at a time (a lax.scan over length; the decode form) -> (out [batch, length,
    value_heads, dv] float32, final state [batch, value_heads, dk, dv] float32). `scale` multiplies q (None: dk
    ** -0.5)."""
    batch, length = q.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    starts = document_starts(segment_ids, length, batch)
    state = _initial(initial_state, batch, v.shape[2], k.shape[-1], v.shape[-1])

    def step(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, b_t, start = xs  # [b, h, d], [b, h], [b]
        s = jnp.where(start[:, None, None, None], 0.0, s) * jnp.exp(g_t)[..., None, None]
        remembered = _einsum("bhkv,bhk->bhv", s, k_t)
        s = s + _einsum("bhk,bhv->bhkv", k_t, (v_t - remembered) * b_t[..., None])
        return s, _einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, starts))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[batch, length, heads, ...] (length a multiple of chunk) -> [chunks, batch, heads, chunk, ...]; [batch,
    length] -> [chunks, batch, chunk]."""
    batch, length, *rest = x.shape
    x = jnp.moveaxis(x.reshape(batch, length // chunk, chunk, *rest), 1, 0)  # [chunks, batch, chunk, ...]
    return jnp.moveaxis(x, 2, 3) if rest else x


def _pad(x: jax.Array, pad: int, mode: str = "constant") -> jax.Array:
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode=mode) if pad else x


def _segments(segment_ids: jax.Array | None, batch: int, length: int, pad: int) -> jax.Array:
    """[batch, length + pad] int32 segment ids; the padding continues the last document (so the final state is
    that document's)."""
    if segment_ids is None:
        return jnp.zeros((batch, length + pad), jnp.int32)
    return _pad(jnp.asarray(segment_ids, jnp.int32), pad, mode="edge")


def _intra_chunk(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, seg: jax.Array,
                 seg_in: jax.Array) -> tuple[jax.Array, ...]:
    """Everything of a chunk that does not depend on the incoming state, for all chunks at once. Inputs are
    [chunks, batch, heads, C, ...] (seg [chunks, batch, 1, C], seg_in [chunks, batch, 1]: the incoming state's
    document). Returns (q_read, attn, U, W, k_write, state_decay)."""
    chunk = q.shape[-2]
    cum = jnp.cumsum(g, axis=-1)  # [n, b, h, C]: log decay from the chunk's start to each token
    same = seg[..., :, None] == seg[..., None, :]  # [n, b, 1, C, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    live = causal & same
    pair = jnp.exp(jnp.where(live, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # D_ij; 0 off `live`
    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    system = jnp.where(strict, _einsum("...ik,...jk->...ij", k * beta[..., None], k) * pair, 0.0)
    carried = (seg == seg_in[..., None]).astype(jnp.float32)  # [n, b, 1, C]: r_i
    read = jnp.exp(cum) * carried  # how much of the incoming state each token still sees
    rhs = jnp.concatenate([v * beta[..., None], k * (beta * read)[..., None]], axis=-1)
    solved = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True,
                                             unit_diagonal=True)
    u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1]:]
    attn = _einsum("...ik,...jk->...ij", q, k) * pair
    last = cum[..., -1:]
    same_last = (seg == seg[..., -1:]).astype(jnp.float32)
    k_write = k * (jnp.exp(last - cum) * same_last)[..., None]
    state_decay = jnp.exp(last[..., 0]) * carried[..., -1]  # [n, b, h]
    return q * read[..., None], attn, u, w, k_write, state_decay


def chunked_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                             chunk_size: int, segment_ids: jax.Array | None = None,
                             initial_state: jax.Array | None = None, scale: float | None = None
                             ) -> tuple[jax.Array, jax.Array]:
    """The delta rule in chunks of `chunk_size` tokens (training, prefill) -> (out [batch, length, value_heads, dv]
    float32, final state [batch, value_heads, dk, dv] float32); the same numbers as `recurrent_gated_delta_rule`.
    Any length: padded inside to a multiple of the chunk, exactly (module docstring)."""
    batch, length = q.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale)
    state = _initial(initial_state, batch, v.shape[2], k.shape[-1], v.shape[-1])
    chunk = min(chunk_size, length)
    pad = (-length) % chunk
    seg = _segments(segment_ids, batch, length, pad)
    q, k, v, g, beta = (_pad(x, pad) for x in (q, k, v, g, beta))  # padding: g = 0, beta = 0, no write, no decay
    seg_in = jnp.concatenate([seg[:, :1], seg[:, chunk - 1:-1:chunk]], axis=1)  # [b, n]: each chunk's incoming doc
    parts = _intra_chunk(*(_chunks(x, chunk) for x in (q, k, v, g, beta)), _chunks(seg, chunk)[:, :, None],
                         jnp.moveaxis(seg_in, 1, 0)[:, :, None])

    def step(s: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_read, attn, u, w, k_write, decay = xs
        fresh = u - _einsum("bhck,bhkv->bhcv", w, s)
        out = _einsum("bhck,bhkv->bhcv", q_read, s) + _einsum("bhij,bhjv->bhiv", attn, fresh)
        s = s * decay[..., None, None] + _einsum("bhck,bhcv->bhkv", k_write, fresh)
        return s, out

    state, out = jax.lax.scan(step, state, parts)  # out [n, b, h, C, dv]
    chunks, _, heads, _, dv = out.shape
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, chunks * chunk, dv)
    return jnp.moveaxis(out, 1, 2)[:, :length], state
