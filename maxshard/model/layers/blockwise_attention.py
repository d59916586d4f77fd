"""Blockwise (flash) attention in pure JAX: online softmax over key/value blocks, memory linear in length.

Shapes: q [batch, q_len, kv_heads, group, head_dim] (query heads grouped over kv heads), k and v
[batch, kv_len, kv_heads, head_dim] (v's head_dim may differ from q's and k's: the output takes v's), segment ids
[batch, len], token indices [len] (int32, one per position, shared by the batch). Query t may see key s when
`kv_index[s] <= q_index[t]` (causal) and both segment ids are equal (packed documents). Scores are float32; q is
expected pre-scaled by 1/sqrt(head_dim).

The algorithm. Dot-product attention materialises scores [q_len, kv_len] per head. Here the queries are cut into
blocks of `block_q` rows and the keys into blocks of `block_kv` columns; for one query block the key blocks are
visited in order, keeping per row a running maximum m, a running sum l of exp(score - m) and an unnormalised output
acc = sum exp(score - m) v. When block j raises the maximum from m to m', the old sum and output are rescaled by
exp(m - m'):

    m' = max(m, max_j s)      l' = l exp(m - m') + sum_j exp(s - m')      acc' = acc exp(m - m') + exp(s - m') v_j

After the last block, out = acc / l and the row's log-sum-exp is lse = m + log l. Worked example, one row with
scores (1, 3 | 2, 0) in two blocks: block 1 gives m = 3, l = e^-2 + 1; block 2 keeps m = 3, adds e^-1 + e^-3; so
l = e^-2 + 1 + e^-1 + e^-3, exactly the softmax denominator over all four scores divided by e^3. Only
[block_q, block_kv] scores exist at a time, so memory is linear in length.

Backward (custom VJP, so no per-block scores are stored): the forward keeps q, k, v, out and lse (one float32 per
row and head). The backward revisits the blocks and recomputes p = exp(s - lse), the exact softmax, then with
D = rowsum(dout * out):  dv = p^T dout,  dp = dout v^T,  ds = p (dp - D),  dq = ds k,  dk = ds^T q. A cotangent
on lse itself (ring attention merges partial results through it) adds p * dlse to ds, i.e. D becomes D - dlse.
Outer loop over key blocks (dk, dv of the block are carried), inner loop over query blocks (each adds its dq
contribution into a full-size float32 dq carried through both loops): memory stays linear in the backward too.
The forward's loops (and the backward's inner one) are `while_loop`s, not scans (see `_loop`): under remat a scan
would store per-block residuals, quadratic memory.

Local/global options. A sliding `window` W adds kv index > q index - W to the mask. A `softcap` c replaces each
score x by c tanh(x / c) before the mask; the backward multiplies ds by the derivative 1 - tanh^2. `sinks` (one
logit per query head) start every row's running maximum at the sink and its sum at 1, so the sink sits in l and
lse and never in acc; the backward's p = exp(s - lse) is then already the softmax with the sink, and the sink's own
gradient is -sum over rows of p_sink D (`sink_grad`).

Skipped blocks. A block pair whose every key comes after every query (min kv index > max q index) or, with a window,
before every query's window (max kv index <= min q index - W) is skipped: each loop over key (forward) or query
(backward) blocks runs only over the span of needed blocks (`_span`) and `lax.cond` skips any unneeded pair inside
it, so causal attention does about half the work and a local layer's work grows with its window, not the length
(benchmarks/attention_window.py). Lengths that are not a multiple of the block size are padded (padded keys get an
index no query reaches; padded query rows are computed and discarded), so any block size works; a block longer than
the sequence shrinks to the sequence.

Masked scores use float32's lowest value, as the dot-product reference does (not -inf), so a fully masked row
gives a uniform average rather than NaN; only padded rows are fully masked here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["blockwise_attention", "forward", "backward", "sink_grad", "merge", "NEG"]

NEG = float(jnp.finfo(jnp.float32).min)
_PAD_KV_INDEX = jnp.iinfo(jnp.int32).max  # a padded key comes after every query: always masked


def _pad_to(x: jax.Array, axis: int, size: int, value: int | float = 0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
    """Splits `axis` into [n, block] and moves n to the front: [..., n*block, ...] -> [n, ..., block, ...]."""
    shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1 :]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of `_blocks`: [n, ..., block, ...] -> [..., n*block, ...] (axis is the block axis in the result)."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])


def block_size(length: int, block: int) -> int:
    """The block actually used: the configured one, or the whole sequence when that is shorter."""
    return min(block, length)


def _mask(q_seg: jax.Array, kv_seg: jax.Array, q_idx: jax.Array, kv_idx: jax.Array, window: int) -> jax.Array:
    """[batch, 1, 1, bq, bk] bool: causal by token index, inside the same document and, with `window` > 0,
    inside the window (kv index > q index - window)."""
    visible = kv_idx[None, :] <= q_idx[:, None]  # [bq, bk]
    if window:
        visible &= kv_idx[None, :] > q_idx[:, None] - window
    same = q_seg[:, :, None] == kv_seg[:, None, :]  # [batch, bq, bk]
    return (visible[None] & same)[:, None, None]


def _scores(q: jax.Array, k: jax.Array, mask: jax.Array, softcap: float) -> tuple[jax.Array, jax.Array | None]:
    """([batch, kv_heads, group, bq, bk] float32 masked scores of q [b, bq, h, g, d] and k [b, bk, h, d], and with
    `softcap` the tanh of the uncapped scores over the cap, which the backward's chain rule needs: capped
    s = c tanh(x / c) has ds/dx = 1 - tanh^2; taken before masking, as masked NEG squared would overflow)."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)
    if not softcap:
        return jnp.where(mask, s, NEG), None
    t = jnp.tanh(s / softcap)
    return jnp.where(mask, softcap * t, NEG), t


def _needed(q_idx: jax.Array, kv_idx: jax.Array, window: int) -> jax.Array:
    """Whether a block pair may hold a visible score: some key at or before some query (causal) and, with a window,
    some key after the earliest query minus the window. `q_idx` [..., bq] and `kv_idx` [..., bk] may carry leading
    axes (one predicate per block pair, broadcast)."""
    needed = jnp.min(kv_idx, axis=-1) <= jnp.max(q_idx, axis=-1)
    if window:
        needed &= jnp.max(kv_idx, axis=-1) > jnp.min(q_idx, axis=-1) - window
    return needed


def _span(needed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first, one past the last) index where the bool vector `needed` holds; (0, 0) when it holds nowhere. The loops
    run over this span only, so a skipped block outside it costs not even a predicate; inside it `cond` still
    guards each block (the needed blocks of a ring's chunk pair need not be contiguous)."""
    n = needed.shape[0]
    any_needed = jnp.any(needed)
    first = jnp.argmax(needed).astype(jnp.int32)
    last = (n - jnp.argmax(needed[::-1])).astype(jnp.int32)
    return jnp.where(any_needed, first, 0), jnp.where(any_needed, last, 0)


def _prepare(q, k, v, q_seg, kv_seg, q_idx, kv_idx, block_q, block_kv):
    """Pads to whole blocks and splits into [n_blocks, ...]; returns the blocked arrays and the padded lengths."""
    bq, bk = block_size(q.shape[1], block_q), block_size(k.shape[1], block_kv)
    lq, lk = -(-q.shape[1] // bq) * bq, -(-k.shape[1] // bk) * bk
    qb = _blocks(_pad_to(q, 1, lq), 1, bq)  # [nq, b, bq, h, g, d]
    q_segb = _blocks(_pad_to(q_seg, 1, lq, -1), 1, bq)  # [nq, b, bq]
    q_idxb = _pad_to(q_idx, 0, lq, -1).reshape(-1, bq)  # [nq, bq]
    kb = _blocks(_pad_to(k, 1, lk), 1, bk)  # [nk, b, bk, h, d]
    vb = _blocks(_pad_to(v, 1, lk), 1, bk)
    kv_segb = _blocks(_pad_to(kv_seg, 1, lk, -2), 1, bk)  # [nk, b, bk]
    kv_idxb = _pad_to(kv_idx, 0, lk, _PAD_KV_INDEX).reshape(-1, bk)  # [nk, bk]
    return (qb, q_segb, q_idxb), (kb, vb, kv_segb, kv_idxb)


def _loop(n, body, init, start=0):
    """`body(i, carry)` for i in range(start, n), as a `while_loop`. Not `scan` (nor fori_loop, which becomes a scan):
    when a remat'd layer is differentiated, JAX partially evaluates the forward and a scan saves per-iteration
    residuals of whatever depends only on integers (masks, skip predicates and, through `cond`, scores), which
    stacks [q_blocks, kv_blocks, ...] of them, quadratic memory; a while loop cannot save residuals."""
    start = jnp.asarray(start, jnp.int32)
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])), (start, init))[1]


def _at(x: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def forward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, block_q: int, block_kv: int, window: int = 0,
            softcap: float = 0.0, sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(out [b, q_len, h, g, d] in v's dtype, lse [b, h, g, q_len] float32); see the module docstring. `sinks`
    [h, g] float32 start each row's running maximum at the sink and its sum at exp(sink - sink) = 1: a key
    without a value, so the sink is in lse and in the denominator and nowhere in acc."""
    (qb, q_segb, q_idxb), (kb, vb, kv_segb, kv_idxb) = _prepare(q, k, v, q_seg, kv_seg, q_idx, kv_idx,
                                                                block_q, block_kv)
    n_q, batch, bq, heads, group, _ = qb.shape

    def one_q_block(qi, qsi, qii):
        def kv_step(j, carry):
            kj, vj, ksj, kij = _at(kb, j), _at(vb, j), _at(kv_segb, j), _at(kv_idxb, j)

            def compute(carry):
                m, l, acc = carry
                s, _ = _scores(qi, kj, _mask(qsi, ksj, qii, kij, window), softcap)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                correction = jnp.exp(m - m_new)
                p = jnp.exp(s - m_new[..., None])
                l = l * correction + jnp.sum(p, axis=-1)
                pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
                return m_new, l, acc * correction[..., None] + pv

            return jax.lax.cond(_needed(qii, kij, window), compute, lambda c: c, carry)

        stats = (batch, heads, group, bq)
        if sinks is None:
            m0, l0 = jnp.full(stats, NEG), jnp.zeros(stats)
        else:
            m0, l0 = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None], stats), jnp.ones(stats)
        first, last = _span(_needed(qii[None], kv_idxb, window))
        m, l, acc = _loop(last, kv_step, (m0, l0, jnp.zeros((*stats, v.shape[-1]))), start=first)
        l_safe = jnp.where(l == 0, 1.0, l)  # no key block visited: out 0, lse NEG
        out = jnp.einsum("bhgqd->bqhgd", acc / l_safe[..., None]).astype(v.dtype)
        lse = jnp.where(l == 0, NEG, m + jnp.log(l_safe))
        return out, lse

    def q_step(i, carry):
        out_i, lse_i = one_q_block(_at(qb, i), _at(q_segb, i), _at(q_idxb, i))
        return carry[0].at[i].set(out_i), carry[1].at[i].set(lse_i)

    out_shape = (*qb.shape[:-1], v.shape[-1])  # [nq, b, bq, h, g, value head_dim]
    init = (jnp.zeros(out_shape, v.dtype), jnp.zeros((n_q, batch, heads, group, bq), jnp.float32))
    out, lse = _loop(n_q, q_step, init)  # [nq, b, bq, h, g, d], [nq, b, h, g, bq]
    q_len = q.shape[1]
    return _unblocks(out, 1)[:, :q_len], _unblocks(lse, 3)[..., :q_len]


def _delta(out, lse, dout, dlse) -> jax.Array:
    """D = rowsum(dout * out) - dlse [b, h, g, q] float32: what every softmax weight's gradient subtracts."""
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", dout.astype(jnp.float32), out.astype(jnp.float32))
    return delta if dlse is None else delta - dlse


def sink_grad(sinks: jax.Array, lse: jax.Array, out, dout, dlse=None) -> jax.Array:
    """d loss / d sinks [h, g] float32, summed over this call's rows (batch and queries).

    The sink takes weight p_sink = exp(sink - lse) of row r and gives no value: out = sum_j p_j v_j with
    p_j = exp(s_j - lse), lse = log(sum_j e^s_j + e^sink). d p_j / d sink = -p_j p_sink, so
    d out / d sink = -p_sink out and d lse / d sink = p_sink: d sink = sum_r p_sink (dlse - dout . out) =
    -sum_r p_sink D with the backward's D."""
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, :, None] - lse)  # [b, h, g, q]
    return -jnp.sum(p_sink * _delta(out, lse, dout, dlse), axis=(0, 3))


def backward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, out, lse, dout, dlse, block_q: int, block_kv: int,
             window: int = 0, softcap: float = 0.0):
    """(dq, dk, dv) of `forward`, given its out and lse (or a ring's merged ones) and their cotangents. Sinks need
    nothing here (they are in lse, so p below is already the softmax with sinks); their own gradient is
    `sink_grad`."""
    delta = _delta(out, lse, dout, dlse)
    (qb, q_segb, q_idxb), kv_blocks = _prepare(q, k, v, q_seg, kv_seg, q_idx, kv_idx, block_q, block_kv)
    bq = qb.shape[2]
    lq = qb.shape[0] * bq
    dob = _blocks(_pad_to(dout, 1, lq), 1, bq)  # [nq, b, bq, h, g, d]
    lseb = _blocks(_pad_to(lse, 3, lq), 3, bq)  # [nq, b, h, g, bq]
    deltab = _blocks(_pad_to(delta, 3, lq), 3, bq)

    def one_kv_block(dq, kv):
        kj, vj, ksj, kij = kv

        def q_step(i, carry):
            qi, qsi, qii, doi, lsei, deltai = (_at(x, i) for x in (qb, q_segb, q_idxb, dob, lseb, deltab))

            def compute(carry):
                dk, dv, dq = carry
                s, t = _scores(qi, kj, _mask(qsi, ksj, qii, kij, window), softcap)
                p = jnp.exp(s - lsei[..., None])  # [b, h, g, bq, bk]: the exact softmax
                dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqhgd,bkhd->bhgqk", doi, vj, preferred_element_type=jnp.float32)
                ds = p * (dp - deltai[..., None])
                if softcap:  # through c tanh(x / c): times 1 - tanh^2 (0 where masked, as p is)
                    ds = ds * (1.0 - t * t)
                ds = ds.astype(qi.dtype)
                dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds, qi, preferred_element_type=jnp.float32)
                dqi = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kj, preferred_element_type=jnp.float32)
                return dk, dv, dq.at[i].add(dqi)

            return jax.lax.cond(_needed(qii, kij, window), compute, lambda c: c, carry)

        zeros = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32))
        first, last = _span(_needed(q_idxb, kij[None], window))
        dk, dv, dq = _loop(last, q_step, (*zeros, dq), start=first)
        return dq, (dk, dv)

    dq0 = jnp.zeros(qb.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(one_kv_block, dq0, kv_blocks)
    q_len, kv_len = q.shape[1], k.shape[1]
    dq = _unblocks(dq, 1)[:, :q_len].astype(q.dtype)
    return dq, _unblocks(dk, 1)[:, :kv_len].astype(k.dtype), _unblocks(dv, 1)[:, :kv_len].astype(v.dtype)


def merge(out_a, lse_a, out_b, lse_b) -> tuple[jax.Array, jax.Array]:
    """Two partial attentions over disjoint key sets -> the attention over their union (float32 out).

    out [b, q, h, g, d], lse [b, h, g, q]: out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse), lse = logaddexp."""
    lse = jnp.logaddexp(lse_a, lse_b)
    wa = jnp.einsum("bhgq->bqhg", jnp.exp(lse_a - lse))[..., None]
    wb = jnp.einsum("bhgq->bqhg", jnp.exp(lse_b - lse))[..., None]
    return out_a.astype(jnp.float32) * wa + out_b.astype(jnp.float32) * wb, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def blockwise_attention(q, k, v, q_seg, kv_seg, q_idx, kv_idx, sinks, block_q: int, block_kv: int, window: int = 0,
                        softcap: float = 0.0) -> jax.Array:
    """Attention output [b, q_len, kv_heads, group, head_dim]; linear memory forward and backward. `sinks`
    [kv_heads, group] float32 or None."""
    return forward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, block_q, block_kv, window, softcap, sinks)[0]


def _fwd(q, k, v, q_seg, kv_seg, q_idx, kv_idx, sinks, block_q, block_kv, window, softcap):
    out, lse = forward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, block_q, block_kv, window, softcap, sinks)
    return out, (q, k, v, q_seg, kv_seg, q_idx, kv_idx, sinks, out, lse)


def _bwd(block_q, block_kv, window, softcap, residuals, dout):
    q, k, v, q_seg, kv_seg, q_idx, kv_idx, sinks, out, lse = residuals
    dq, dk, dv = backward(q, k, v, q_seg, kv_seg, q_idx, kv_idx, out, lse, dout, None, block_q, block_kv,
                          window, softcap)
    dsinks = None if sinks is None else sink_grad(sinks, lse, out, dout).astype(sinks.dtype)
    return dq, dk, dv, None, None, None, None, dsinks


blockwise_attention.defvjp(_fwd, _bwd)
