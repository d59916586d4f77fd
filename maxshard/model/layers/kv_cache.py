"""The KV cache of generation: each global attention layer keeps the keys and values of every position it has
seen; each local (sliding-window or chunked) layer only those of the last `window` positions, in a ring.

Layout. One layer's cache is keys and values of [batch, kv_heads, slots, head_dim], named
("cache_batch", "cache_kv_heads", "cache_length", "cache_kv") so `logical_axis_rules` lay it out like the
attention activations it feeds (batch over data/fsdp/expert, kv heads over tensor/autoregressive). A global layer
has slots = max_length, a local one slots = min(window, max_length). nn.scan stacks the layers' caches into
[layers, batch, kv_heads, slots, head_dim] under the "cache" collection. Latent attention (layers/mla.py) keeps
instead one latent [batch, max_length, kv_lora_rank] and one RoPE key [batch, max_length, qk_rope_head_dim] per layer
(`LatentCache`), written as a global layer's.

Global layers: slot = position. Prompts are right-padded, so the token at position p of a sequence always lives in
slot p: a call writes its k/v at slots `positions` (contiguous per sequence: a prefill of [batch, prompt] from 0, or
one decode token at each sequence's own length) and its queries attend to every slot <= their own position. Per
sequence the cache therefore holds exactly the keys and values the full forward pass computes for the same prefix,
at the same RoPE positions. Slots beyond a sequence's position hold stale values (the padding of a shorter prompt,
or zeros) and are masked; the decode step that reaches such a slot overwrites it before anything attends to it.

Local layers: a ring, slot = position % slots. A query at position i sees keys i - window < j <= i (as
`attention_ops.scores_mask` in training), so keys older than the window are never read again: keeping them would
make the cache, and the memory a long generation needs, grow with the text for nothing (Gemma 3 has 5 local layers
per global one). A slot's position is not stored: every row writes positions 0, 1, 2, ... in order, so once it has
written up to position `last` slot s holds last - ((last - s) mod slots), or nothing while that is negative
(`_ring_positions`), and the mask is causal and inside the window in position space. Two things follow:
- a right-padded prefill must write each row's last real tokens, not the batch's last columns (a short prompt's
  tokens would be overwritten by the padding after them), so the prefill marks its padding with position -1
  (generation/decode.py) and a row writes only its tokens of position >= 0;
- a prompt longer than the window overwrites, in the ring, keys that its own earlier queries still see, so a call of
  more than one token attends over the ring as it was before the call plus its own k/v (slots + T keys), and only
  then is written; a decode step (T = 1) attends over the ring as written (`window` keys).

Chunked layers (Llama 4) are rings of `chunk` slots: a query at position p sees the keys from p // chunk x chunk
to p, all within the last `chunk` positions, so the ring holds them and the mask also keeps the query's own chunk.

Why a masked write over the whole cache and not a dynamic slice: sequences are at different positions, so the
write index differs per row; `where(slot takes a new token)` is elementwise, needs no scatter and partitions under
any layout of the cache, and it costs one pass over the cache, as the attention that reads it. The ring's write is
the same select with another index per slot.

Attention reads the cache with plain float32 logits and softmax (masked slots at the float32 minimum give exactly
zero weight), one query or a prompt's worth of queries against the cache's slots.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.model.layers.attention_ops import capped, softmax_with_sinks
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = ["COLLECTION", "CACHE_AXES", "KVCache", "LatentCache", "decoding", "attend"]

COLLECTION = "cache"
CACHE_AXES = (ax.CACHE_BATCH, ax.CACHE_KV_HEADS, ax.CACHE_LENGTH, ax.CACHE_KV)  # [batch, kv_heads, length, head_dim]


def decoding(module: nn.Module) -> bool:
    """True when `module` runs for generation: the "cache" collection is mutable in an apply (never during init,
    where every collection is mutable and the training path must build the parameters)."""
    return module.is_mutable_collection(COLLECTION) and not module.is_initializing()


def _zeros(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jnp.zeros(shape, dtype)


def _put(cache: jax.Array, new: jax.Array, offset: jax.Array, axis: int = 2) -> jax.Array:
    """cache [b, ..., S, ...] with each slot s of row b replaced by new[b, ..., offset[b, s], ...] where offset is in
    [0, T) (T: new's length on `axis`) and kept where it is not: one elementwise select over the cache, no scatter.
    `axis` is the slot axis (2 in [b, h, S, d], 1 in latent attention's [b, S, width])."""
    slots, length = cache.shape[axis], new.shape[axis]
    inside = (offset >= 0) & (offset < length)
    shape = [1] * cache.ndim
    shape[0], shape[axis] = cache.shape[0], slots  # [b, 1, S, 1] or [b, S, 1]
    index = jnp.clip(offset, 0, length - 1).reshape(shape)
    picked = jnp.take_along_axis(new, index, axis=axis)  # new's rows at the cache's slots
    return jnp.where(inside.reshape(shape), picked, cache)


def _write(cache: jax.Array, new: jax.Array, start: jax.Array, axis: int = 2) -> jax.Array:
    """cache [b, ..., S, ...] with new [b, ..., T, ...] written at slots start[b] .. start[b] + T - 1 of each row
    (slot = position)."""
    return _put(cache, new, jnp.arange(cache.shape[axis])[None, :] - start[:, None], axis)


def _ring_positions(last: jax.Array, slots: int) -> jax.Array:
    """[b] -> [b, slots] int32: the position each slot of a ring holds once positions 0 .. last[b] have been
    written (slot = position % slots, the latest one wins), -1 where none has been (last[b] < slot)."""
    held = last[:, None] - jnp.mod(last[:, None] - jnp.arange(slots)[None, :], slots)
    return jnp.where(held >= 0, held, -1).astype(jnp.int32)


class KVCache(nn.Module):
    """Writes one call's keys and values into the layer's cache and returns the keys and values its queries attend
    over, with their mask.

    The cache is created (zeros) by the first call, from that call's length `max_length`: generation creates it
    with a [batch, max_length] shape pass (see maxshard/generation/decode.py) and then only writes into it. A global
    layer keeps `max_length` slots (slot = position); a local one (`window` > 0) a ring of min(window, max_length)
    slots (slot = position % slots), whatever `max_length` is (module docstring).
    """

    dtype: jnp.dtype
    window: int = 0  # a local layer: queries see only the last `window` positions (attention_ops.scores_mask)
    chunk: int = 0  # a chunked layer (window = chunk): queries see only the keys of their own chunk

    @nn.compact
    def __call__(
        self, k: jax.Array, v: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """k, v [batch, T, kv_heads, head_dim]; positions [batch, T], contiguous per row from positions[:, 0], -1 on
        a prefill's right padding -> (keys, values [batch, S, kv_heads, head_dim], mask [batch, 1, 1, T, S] bool).
        S is max_length for a global layer; for a local one the ring's slots, or for a call of T > 1 tokens the
        ring's slots followed by the call's own T keys."""
        batch, length, kv_heads, head_dim = k.shape
        init = nn.with_logical_partitioning(_zeros, CACHE_AXES)
        slots = min(self.window, length) if self.window else length  # used only where the cache is created
        shape = (batch, kv_heads, slots, head_dim)
        keys = self.variable(COLLECTION, "key", init, shape, self.dtype)
        values = self.variable(COLLECTION, "value", init, shape, self.dtype)
        new = [jnp.asarray(x, self.dtype).transpose(0, 2, 1, 3) for x in (k, v)]  # [b, kv_heads, T, d]
        if self.window:
            return self._ring(keys, values, new, positions)
        start = positions[:, 0]
        for var, fresh in zip((keys, values), new):
            var.value = constrain(_write(var.value, fresh, start), CACHE_AXES)
        slot = jnp.arange(keys.value.shape[2])
        mask = slot[None, None, :] <= positions[:, :, None]  # [b, T, S]: causal in slot (= position) space
        return keys.value.transpose(0, 2, 1, 3), values.value.transpose(0, 2, 1, 3), mask[:, None, None]

    def _ring(self, keys: Any, values: Any, new: list[jax.Array], positions: jax.Array
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The local layer's call: each row writes its last `slots` real tokens into the ring; a decode step
        (T = 1) attends over the ring as written, a longer call over the ring as it was plus its own k/v."""
        slots = keys.value.shape[2]
        start = positions[:, 0]
        last = start + jnp.sum(positions >= 0, axis=1) - 1  # [b]: the last real position of this call
        before = _ring_positions(start - 1, slots)  # [b, S]: what each slot holds before this call
        after = _ring_positions(last, slots)
        old = (keys.value, values.value)
        for var, fresh in zip((keys, values), new):  # slot s takes the token at position after[s] if it is new
            var.value = constrain(_put(var.value, fresh, after - start[:, None]), CACHE_AXES)
        if positions.shape[1] == 1:
            held, key_positions = (keys.value, values.value), after
        else:  # a prompt longer than the ring overwrites keys its own earlier queries still see
            held = tuple(jnp.concatenate([o, fresh], axis=2) for o, fresh in zip(old, new))
            key_positions = jnp.concatenate([before, jnp.where(positions >= 0, positions, -1)], axis=1)
        query, key = positions[:, :, None], key_positions[:, None, :]
        mask = (key >= 0) & (key <= query) & (key > query - self.window)  # [b, T, S]: causal and inside the window
        if self.chunk:
            mask &= key // self.chunk == query // self.chunk
        return held[0].transpose(0, 2, 1, 3), held[1].transpose(0, 2, 1, 3), mask[:, None, None]


class LatentCache(nn.Module):
    """Latent attention's cache (layers/mla.py): per token the normalised key/value latent [kv_lora_rank] and the
    rotated RoPE key [qk_rope_head_dim] that every head shares, written as KVCache writes (slot = position).

    Layout [batch, max_length, width], named ax.LATENT_CACHE: no heads dimension (every head reads all of it), so
    tensor parallelism repeats it on each device of a tensor group; nn.scan stacks it into [layers, ...].
    """

    dtype: jnp.dtype

    @nn.compact
    def __call__(self, latent: jax.Array, rope_key: jax.Array, positions: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """latent [batch, T, rank], rope_key [batch, T, rope]; positions [batch, T] contiguous per row ->
        (latents [batch, max_length, rank], rope keys [batch, max_length, rope], mask [batch, T, max_length])."""
        init = nn.with_logical_partitioning(_zeros, ax.LATENT_CACHE)
        start, written = positions[:, 0], []
        for name, new in (("latent", latent), ("rope_key", rope_key)):
            var = self.variable(COLLECTION, name, init, new.shape, self.dtype)
            var.value = constrain(_write(var.value, jnp.asarray(new, self.dtype), start, axis=1), ax.LATENT_CACHE)
            written.append(var.value)
        slots = jnp.arange(written[0].shape[1])
        return written[0], written[1], slots[None, None, :] <= positions[:, :, None]


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, dtype: Any, softcap: float = 0.0,
           sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention of q [b, T, heads, d] (RoPE'd and scaled) over the cache's keys/values
    [b, S, kv_heads, d] with mask [b, 1, 1, T, S] -> [b, T, heads, d]; logits and softmax in float32. The values'
    head width may differ (latent attention's prefill, layers/mla.py): the output takes theirs. `softcap` and
    `sinks` as in training (attention_ops.attend)."""
    batch, length, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)  # [b, T, kv_heads, group, d]
    logits = capped(jnp.einsum("bqhgd,bkhd->bhgqk", q, keys, preferred_element_type=jnp.float32), softcap)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = softmax_with_sinks(logits, None if sinks is None else sinks.reshape(kv_heads, heads // kv_heads))
    out = jnp.einsum("bhgqk,bkhd->bqhgd", jnp.asarray(probs, dtype), values)
    return out.reshape(batch, length, heads, values.shape[-1])
