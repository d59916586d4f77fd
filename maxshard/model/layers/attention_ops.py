"""The attention kernels behind one function, `attend`: one function per row of `maxshard/spec/attention_kinds.py`,
named as the row (which says where each runs, whether it is fused, how it takes the documents).

Inputs are post-RoPE and pre-scaled: q [batch, q_len, heads, head_dim] (already multiplied by 1/sqrt(head_dim)),
k and v [batch, kv_len, kv_heads, head_dim], segment ids [batch, q_len] and [batch, kv_len]; the output is
[batch, q_len, heads, head_dim] in v's dtype. Every implementation applies the same mask: causal (query t sees keys
up to t; with kv_len > q_len the queries are the last q_len positions) and inside one document (equal segment ids).
Grouped-query heads: heads = kv_heads x group, query head h reads kv head h // group. Value heads may be narrower
or wider than query/key heads (latent attention, layers/mla.py): the output takes v's width; kernels that need one
width get zero-padded inputs (`one_width`).

Sharding. Inside attention the activations take their own logical names (`activation_attn_*`): whole length
(or `context` shards for ring attention, layers/ring_attention.py) and heads over the tensor axes *and* `sequence`.
Outside, sequence parallelism shards the length; constraining q, k, v here makes XLA move them from length-sharded
to head-sharded with one all-to-all each, and the output back, so no device gathers the whole K/V.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import jax
import jax.numpy as jnp

from maxshard.spec import attention_kinds
from maxshard.model.layers import blockwise_attention as bw
from maxshard.model.layers import ring_attention
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = ["attend", *attention_kinds.NAMES, "document_starts", "token_indices", "one_width", "scores_mask", "capped",
           "softmax_with_sinks"]


def token_indices(q_len: int, kv_len: int) -> tuple[jax.Array, jax.Array]:
    """Causal token indices ([q_len], [kv_len]): the queries are the last q_len of the kv_len positions."""
    return jnp.arange(kv_len - q_len, kv_len, dtype=jnp.int32), jnp.arange(kv_len, dtype=jnp.int32)


def target_platform() -> str:
    """The platform this trace compiles for: the active mesh's devices when a mesh is set (an ahead-of-time compile
    for a TPU topology from a CPU host), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.default_backend() if mesh.empty else mesh.abstract_device.platform


def _grouped(q: jax.Array, kv_heads: int) -> jax.Array:
    """[b, q, heads, d] -> [b, q, kv_heads, group, d]."""
    b, length, heads, dim = q.shape
    return q.reshape(b, length, kv_heads, heads // kv_heads, dim)


def scores_mask(q_len: int, kv_len: int, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                window: int = 0) -> jax.Array:
    """[batch, q, kv] bool: causal, inside one document, and with `window` > 0 inside the last `window` keys
    (query i sees keys j with i - window < j <= i, token indices as `token_indices`)."""
    q_idx, kv_idx = token_indices(q_len, kv_len)
    visible = kv_idx[None, :] <= q_idx[:, None]  # [q, kv]
    if window:
        visible &= kv_idx[None, :] > q_idx[:, None] - window
    return visible[None] & (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])


def capped(logits: jax.Array, softcap: float) -> jax.Array:
    """Gemma 2's attention-logit soft-cap: softcap * tanh(logits / softcap), on the scaled logits (0: none)."""
    return softcap * jnp.tanh(logits / softcap) if softcap else logits


def softmax_with_sinks(logits: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over the last axis of float32 logits [batch, heads..., q, kv]; with `sinks` (GPT-OSS: one learned logit
    per query head, [heads...] matching the logits' head axes) each row's denominator also holds exp(sink), a
    "key" with no value, so a row may give less than all of its weight to the keys."""
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1)
    sink = jnp.asarray(sinks, jnp.float32)[(None, ...) + (None, None)]  # [1, heads..., 1, 1]
    top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
    weights = jnp.exp(logits - top)
    return weights / (jnp.sum(weights, axis=-1, keepdims=True) + jnp.exp(sink - top))


def dot_product(q, k, v, q_segment_ids, kv_segment_ids, window: int = 0, softcap: float = 0.0,
                sinks: jax.Array | None = None) -> jax.Array:
    """The reference: float32 scores and softmax over the whole key length (with the window, soft-cap and sinks
    of `attend` applied as written there)."""
    batch, q_len, heads, _ = q.shape
    mask = scores_mask(q_len, k.shape[1], q_segment_ids, kv_segment_ids, window)[:, None, None]  # [b, 1, 1, q, kv]
    if k.shape[2] == heads:  # no grouping: 4-D einsums (the group axis of size 1 costs XLA:CPU transposes)
        logits = capped(jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32), softcap)
        probs = softmax_with_sinks(jnp.where(mask[:, :, 0], logits, jnp.finfo(jnp.float32).min), sinks)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.asarray(probs, v.dtype), v)
    kv_heads = k.shape[2]
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", _grouped(q, kv_heads), k, preferred_element_type=jnp.float32)
    logits = jnp.where(mask, capped(logits, softcap), jnp.finfo(jnp.float32).min)
    grouped_sinks = None if sinks is None else sinks.reshape(kv_heads, heads // kv_heads)
    probs = softmax_with_sinks(logits, grouped_sinks)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", jnp.asarray(probs, v.dtype), v)
    return out.reshape(batch, q_len, heads, v.shape[-1])


def blockwise(q, k, v, q_segment_ids, kv_segment_ids, block_q: int = 512, block_kv: int = 512, window: int = 0,
              softcap: float = 0.0, sinks: jax.Array | None = None) -> jax.Array:
    """Online-softmax attention with linear memory (layers/blockwise_attention.py); key blocks wholly outside the
    window are never visited, so a local layer's cost follows its window."""
    batch, q_len, heads, _ = q.shape
    kv_heads = k.shape[2]
    q_idx, kv_idx = token_indices(q_len, k.shape[1])
    out = bw.blockwise_attention(_grouped(q, kv_heads), k, v, q_segment_ids, kv_segment_ids, q_idx, kv_idx,
                                 _grouped_sinks(sinks, kv_heads), block_q, block_kv, window, softcap)
    return out.reshape(batch, q_len, heads, v.shape[-1])


def _grouped_sinks(sinks: jax.Array | None, kv_heads: int) -> jax.Array | None:
    """[heads] -> [kv_heads, group] float32 (query head h = kv head h // group), or None."""
    return None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(kv_heads, -1)


def cudnn(q, k, v, q_segment_ids, kv_segment_ids, implementation: str | None = None, window: int = 0) -> jax.Array:
    """cuDNN flash attention through `jax.nn.dot_product_attention` (grouped heads are native there).

    Causal masking is cuDNN's own (`is_causal`, no mask tensor). Packed documents have no segment-id input in that
    API: the document mask goes in as a boolean `mask` [batch, 1, q, kv] (one copy for all heads, in the compute
    dtype inside cuDNN's bias path), quadratic in length but without the float32 scores of every head;
    `planning/memory.py` counts it. `implementation="xla"` runs the same call through XLA, which is how CPU tests
    check this mapping. By default it is "cudnn" on a GPU backend and "xla" elsewhere: on CPU, the stand-in of a
    GPU config's `attention: cudnn` (spec/attention_kinds.py `cpu_stand_in`), or the planner tracing a GPU run's
    shapes on a CPU host (`jax.eval_shape`, nothing runs).

    A window is the API's `local_window_size` (window - 1 keys left, none right; cuDNN's own sliding window, which
    skips the blocks outside it). That API has no soft-cap and no sinks: attention_kinds.py leaves them out."""
    if implementation is None:
        implementation = "cudnn" if target_platform() == "gpu" else "xla"
    if q.shape[1] != k.shape[1]:
        raise ValueError("attention=cudnn needs q_len == kv_len (training); use dot_product or blockwise to decode")
    same_doc = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]  # [batch, 1, q, kv]
    return jax.nn.dot_product_attention(q, k, v, mask=same_doc, scale=1.0, is_causal=True,
                                        local_window_size=(window - 1, 0) if window else None,
                                        implementation=implementation)


def _splash_kernel(heads: int, q_len: int, kv_len: int, block_q: int, block_kv: int, interpret: bool,
                   window: int = 0, softcap: float = 0.0) -> Callable:
    """One splash MQA kernel (queries of one kv head against it), built anew in every trace.

    A window is splash's `LocalMask` with `window - 1` keys to the left and none to the right, which is causal
    too; its block-sparse mask info lets the kernel skip the key blocks wholly outside the window. The soft-cap is
    the kernel's own `attn_logits_soft_cap` (forward and backward).

    Not cached: the kernel's block-mask arrays are made with jnp inside the trace that asks for it (Flax's scan
    traces its body through a partial-eval trace), so a kernel kept from one trace would leak that trace's tracers
    into the next (seen as UnexpectedTracerError when the planner traced a remat_policy=none model twice). Building
    it takes ~0.3 s at 8k tokens with 512-token blocks."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (q_len, kv_len)
    if window:
        one = splash.LocalMask(shape, window_size=(window - 1, 0), offset=kv_len - q_len)
    else:
        one = splash.CausalMask(shape)
    mask = splash.MultiHeadMask([one for _ in range(heads)])
    sizes = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv, block_q_dkv=block_q,
                              block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv, block_q_dq=block_q,
                              block_kv_dq=block_kv)
    return splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret,
                                  attn_logits_soft_cap=softcap or None)


def splash(q, k, v, q_segment_ids, kv_segment_ids, block_q: int = 512, block_kv: int = 512,
           interpret: bool | None = None, window: int = 0, softcap: float = 0.0,
           sinks: jax.Array | None = None) -> jax.Array:
    """The Pallas splash kernel, one MQA call per (batch row, kv head): its queries are that kv head's group.

    Splash takes [heads, length, head_dim] per row and its own SegmentIds; block sizes must divide the lengths
    (config_ranges checks max_target_length). `interpret` defaults to "not compiling for a TPU"
    (`target_platform`; Pallas interpret mode, slow: the CPU stand-in of a TPU config's `attention: splash`). Sinks
    are the kernel's own (`sinks` [group] per MQA call, with their gradient)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    if interpret is None:
        interpret = target_platform() != "tpu"
    batch, q_len, heads, _ = q.shape
    kv_heads = k.shape[2]
    kernel = _splash_kernel(heads // kv_heads, q_len, k.shape[1], min(block_q, q_len), min(block_kv, k.shape[1]),
                            interpret, window, softcap)
    qg = jnp.einsum("bqhgd->bhgqd", _grouped(q, kv_heads))  # [b, kv_heads, group, q, d]
    kt, vt = jnp.einsum("bkhd->bhkd", k), jnp.einsum("bkhd->bhkd", v)  # [b, kv_heads, kv, d]
    grouped_sinks = _grouped_sinks(sinks, kv_heads)

    def row(qr, kr, vr, qs, ks):  # one batch row: [kv_heads, ...]
        segments = SegmentIds(q=qs, kv=ks)
        if grouped_sinks is None:
            return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=segments))(qr, kr, vr)
        return jax.vmap(lambda qh, kh, vh, sh: kernel(qh, kh, vh, segment_ids=segments, sinks=sh))(
            qr, kr, vr, grouped_sinks)

    out = jax.vmap(row)(qg, kt, vt, q_segment_ids, kv_segment_ids)  # [b, kv_heads, group, q, d]
    return jnp.einsum("bhgqd->bqhgd", out).reshape(batch, q_len, heads, v.shape[-1]).astype(v.dtype)


def document_starts(segment_ids: jax.Array) -> jax.Array:
    """[batch, length] -> the position where each token's document begins (int32), for kernels that take the
    packed documents as ragged offsets rather than segment ids.

    A document is a run of equal ids. That is what packing makes (data/packing.py numbers a row's documents 1, 2,
    ... in order, padding 0 at the end), and there it is the same mask as equal ids; an id that came back after
    another one would start a new document here, where `dot_product` would join the two."""
    positions = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
    first = jnp.ones_like(segment_ids[:, :1], dtype=bool)
    starts_here = jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(starts_here, positions, 0), axis=1)


@functools.cache
def _tokamax_modules() -> tuple[ModuleType, ModuleType]:
    """Tokamax's attention `api` (its registry of ops: "mosaic_gpu", "xla", ...) and `base` (its Mask), imported on
    first use: only this implementation needs the library.

    Tokamax reads its options through absl flags and, finding them unparsed, parses sys.argv as absl flags: our
    key=value command line passes, but pytest's or a benchmark's --options fail as unknown flags. Marking them
    parsed keeps every tokamax option at its default (heuristic kernel configs on an autotuning-cache miss)."""
    from absl import flags
    from tokamax._src.ops.attention import api, base

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return api, base


def tokamax(q, k, v, q_segment_ids, kv_segment_ids, implementation: str | None = None, window: int = 0,
            softcap: float = 0.0) -> jax.Array:
    """Tokamax's FlashAttention with the packed documents as ragged offsets: no [q, kv] mask or bias anywhere.

    The public `tokamax.dot_product_attention` takes documents only as a dense mask, so this calls the library's
    attention ops directly with its `Mask(k_start=..., is_causal=True)`: query t sees keys from its document's
    start (`document_starts`) up to t. The Mosaic GPU kernel reads k_start per query row, skips the key blocks
    before a query tile's earliest document start in its forward pass, and reads kv head h // group natively
    (grouped-query heads). Each row takes the kv ids' offsets, as q and kv share ids in self-attention.
    `implementation` is tokamax's: "mosaic_gpu" on a GPU backend by default (it needs sm90+ and 16-bit inputs:
    attention_choice.py checks), "xla" (its quadratic reference) elsewhere, which is how CPU tests and the
    planner's shape traces run it.

    A window moves each query's key start up to its window's first key (the later of the two starts), so the
    same offsets carry documents and window and the GPU kernel skips what lies before either; the soft-cap is
    tokamax's `logits_soft_cap`. Tokamax 0.0.12 has no sinks: attention_kinds.py leaves them out."""
    if implementation is None:
        implementation = "mosaic_gpu" if target_platform() == "gpu" else "xla"
    if q.shape[1] != k.shape[1]:
        raise ValueError("attention=tokamax needs q_len == kv_len (training); use dot_product or blockwise to decode")
    api, base = _tokamax_modules()
    starts = document_starts(kv_segment_ids)  # [batch, q]
    if window:
        starts = jnp.maximum(starts, jnp.arange(q.shape[1], dtype=jnp.int32) - (window - 1))
    mask = base.Mask(k_start=starts[:, None, :], is_causal=True)  # [batch, 1 (heads), q]
    return api.IMPLEMENTATIONS[implementation](q, k, v, mask=mask, logits_scale=1.0, logits_soft_cap=softcap or None)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    implementation: str = "dot_product",
    block_q: int = 512,
    block_kv: int = 512,
    window: int = 0,
    softcap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of pre-scaled, rotated q [b, q, heads, d] over k, v [b, kv, kv_heads, d] -> [b, q, heads, d].

    The options of local/global models, each off at its default: `window` > 0 (a local layer: query i sees only
    keys j with i - window < j <= i), `softcap` > 0 (Gemma 2: scaled logits -> softcap * tanh(logits / softcap)
    before the mask), `sinks` [heads] float (GPT-OSS: a learned per-head logit in the softmax's denominator).
    An implementation whose row (attention_kinds.py) lacks an option refuses it here in one line.

    Constrains its inputs and output to the attention-internal layout (module docstring); with a `context` mesh
    axis in that layout it runs ring attention instead (layers/ring_attention.py)."""
    q, k, v = constrain(q, ax.ATTN_QUERY), constrain(k, ax.ATTN_KEY_VALUE), constrain(v, ax.ATTN_KEY_VALUE)
    q_segment_ids, kv_segment_ids = (constrain(s, ax.ATTN_SEGMENTS) for s in (q_segment_ids, kv_segment_ids))
    options = {name: value for name, value in (("window", window), ("softcap", softcap), ("sinks", sinks))
               if value is not None and (name == "sinks" or value)}
    if ring_attention.context_axes():
        _check_options("ring (context parallelism)", attention_kinds.RING_OPTIONS, options)
        out = ring_attention.ring_attend(q, k, v, q_segment_ids, kv_segment_ids, block_q, block_kv, **options)
    else:
        row, kernel = _kernel(implementation, block_q, block_kv)
        _check_options(f"attention={row.name}", row.options, options)
        value_width = v.shape[-1]
        if value_width != q.shape[-1] and not row.value_width:
            q, k, v = one_width(q, k, v)
        statics = {name: value for name, value in options.items() if name != "sinks"}
        kernel = functools.partial(kernel, **statics) if statics else kernel
        args = (q, k, v, q_segment_ids, kv_segment_ids)
        if row.per_device:  # the sinks go in sharded as q's heads, not closed over
            out = ring_attention.manual_over_batch_and_heads(kernel, *args, sinks=sinks)
        else:
            out = kernel(*args, sinks=sinks) if sinks is not None else kernel(*args)
        out = out[..., :value_width]
    return constrain(out, ax.ATTN_QUERY)


def _check_options(what: str, supported: tuple[str, ...], options: dict) -> None:
    missing = [name for name in options if name not in supported]
    if missing:
        raise ValueError(f"{what} cannot take {', '.join(missing)} (sliding_window, attn_logit_softcapping, "
                         f"attention_sinks); use attention=dot_product or blockwise")


def one_width(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k and v zero-padded on head_dim to the widest of them, for kernels that take one head width
    (`Kind.value_width` False: cudnn, where jax.nn.dot_product_attention checks one width) when latent attention's
    query/key heads (qk_nope + qk_rope) and value heads (v_head_dim) differ. Exact: zero features add nothing to
    q.k, and a zero value column gives an output column that `attend` drops; the kernel does the padded width's
    work (DeepSeek-V3: values 128 -> 192, the p.v matmul 1.5x)."""
    width = max(q.shape[-1], k.shape[-1], v.shape[-1])

    def pad(x: jax.Array) -> jax.Array:
        return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])

    return pad(q), pad(k), pad(v)


def _kernel(implementation: str, block_q: int, block_kv: int) -> tuple[attention_kinds.Kind, Callable]:
    """The row of `implementation` and its kernel: this module's function of the row's name, looked up at call time
    (tests and benchmarks wrap them), its blocks bound if the row takes blocks."""
    if implementation not in attention_kinds.NAMES:
        raise ValueError(f"attention implementation {implementation!r}; expected one of "
                         f"{', '.join(attention_kinds.NAMES)}")
    row, kernel = attention_kinds.kind(implementation), globals()[implementation]
    return row, functools.partial(kernel, block_q=block_q, block_kv=block_kv) if row.blocks else kernel
