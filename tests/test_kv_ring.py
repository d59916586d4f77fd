"""The local layers' KV cache is a ring of `window` slots: a right-padded prefill (prompts longer and shorter than the
window in one batch) and token-by-token decode past the window give what `attention_ops.dot_product` with the same
window computes over the whole sequence, with soft-capping and sinks too; its size does not follow max_length. Then
a tiny local/global model through the generation engine (sharded, fsdp=4 x tensor=2): greedy tokens and every step's
logits equal its training forward pass's far past the window, and its compiled decode step grows with the global
layers only.

Tolerance 1e-5 on float32 attention outputs of order 1: the cached path sums the same products in another order
(the ring holds keys out of position order); a stale slot, a key outside the window or a lost prompt key moves an
output by orders of magnitude more.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.model.layers import attention_ops, kv_cache
from tests.helpers import layout_overrides, tiny_config
from tests.test_generate import EOS, PAD, _engine, _full_forward, _host_params

PROMPT_LENGTHS = (2, 7, 11)  # shorter than, longer than, and almost three times the window; padded to 11
NEW_TOKENS = 9  # every row decodes past the window, and the ring wraps during decode
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
WINDOW = 4


class _Layer(nn.Module):
    """One layer's cached attention as layers/attention.py runs it: k/v into the cache, queries over what it gives."""

    window: int
    softcap: float = 0.0

    @nn.compact
    def __call__(self, q, k, v, positions, sinks=None):
        keys, values, mask = kv_cache.KVCache(jnp.float32, window=self.window, name="cache")(k, v, positions)
        return kv_cache.attend(q, keys, values, mask, jnp.float32, self.softcap, sinks)


def _new_cache(layer: _Layer, batch: int, max_length: int):
    """The cache generation starts from: the shapes of a [batch, max_length] pass, zeros (generation/decode.py)."""
    x = jnp.zeros((batch, max_length, KV_HEADS, HEAD_DIM))
    q = jnp.zeros((batch, max_length, HEADS, HEAD_DIM))
    positions = jnp.broadcast_to(jnp.arange(max_length), (batch, max_length))
    shapes = jax.eval_shape(lambda: layer.apply({}, q, x, x, positions, mutable=[kv_cache.COLLECTION])[1])
    shapes = shapes[kv_cache.COLLECTION]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), nn.unbox(shapes))


CASES = {  # name: (window, softcap, sinks)
    "local": (WINDOW, 0.0, False),
    "local_softcap_sinks": (WINDOW, 5.0, True),
    "window_over_max_length": (64, 0.0, False),  # a ring of max_length slots: never wraps
    "global": (0, 0.0, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_past_the_window_equal_dot_product(case):
    window, softcap, with_sinks = CASES[case]
    batch, prompt = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)
    total = prompt + NEW_TOKENS  # max_length of the cache and the reference's length
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, total, h, HEAD_DIM)), jnp.float32)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    sinks = jnp.asarray(rng.standard_normal(HEADS), jnp.float32) if with_sinks else None
    segments = jnp.ones((batch, total), jnp.int32)  # row b's sequence is positions 0 .. len_b + NEW_TOKENS - 1
    reference = np.asarray(attention_ops.dot_product(q, k, v, segments, segments, window, softcap, sinks))

    layer = _Layer(window, softcap)
    cache = _new_cache(layer, batch, total)
    expected_slots = min(window, total) if window else total
    assert cache["cache"]["key"].shape == (batch, KV_HEADS, expected_slots, HEAD_DIM)
    step = jax.jit(lambda cache, *args: layer.apply({kv_cache.COLLECTION: cache}, *args, sinks,
                                                    mutable=[kv_cache.COLLECTION]))

    # prefill: right-padded prompts, padding at position -1 holding garbage k/v that must never be seen
    lengths = np.array(PROMPT_LENGTHS)
    real = np.arange(prompt)[None, :] < lengths[:, None]
    positions = jnp.asarray(np.where(real, np.arange(prompt)[None, :], -1), jnp.int32)
    garbage = jnp.asarray(100 * rng.standard_normal((batch, prompt, KV_HEADS, HEAD_DIM)), jnp.float32)
    pad = jnp.asarray(real)[:, :, None, None]
    k_in, v_in = (jnp.where(pad, x[:, :prompt], garbage) for x in (k, v))
    out, state = step(cache, q[:, :prompt], k_in, v_in, positions)
    cache = state[kv_cache.COLLECTION]
    out = np.asarray(out)
    for b, n in enumerate(PROMPT_LENGTHS):
        np.testing.assert_allclose(out[b, :n], reference[b, :n], rtol=0, atol=1e-5)

    for i in range(NEW_TOKENS):  # row b's token at position len_b + i
        at = jnp.asarray(lengths + i, jnp.int32)
        take = lambda x: jnp.take_along_axis(x, at[:, None, None, None], axis=1)  # noqa: E731
        out, state = step(cache, take(q), take(k), take(v), at[:, None])
        cache = state[kv_cache.COLLECTION]
        np.testing.assert_allclose(np.asarray(out)[:, 0], reference[np.arange(batch), lengths + i], rtol=0,
                                   atol=1e-5)



def _decode_memory(layer: _Layer, batch: int, max_length: int):
    """The compiled decode step's memory figures (cache donated, as generation/decode.py compiles it)."""
    one = lambda heads: jax.ShapeDtypeStruct((batch, 1, heads, HEAD_DIM), jnp.float32)  # noqa: E731
    step = jax.jit(lambda cache, *args: layer.apply({kv_cache.COLLECTION: cache}, *args,
                                                    mutable=[kv_cache.COLLECTION]), donate_argnums=0)
    lowered = step.lower(_new_cache(layer, batch, max_length), one(HEADS), one(KV_HEADS), one(KV_HEADS),
                         jax.ShapeDtypeStruct((batch, 1), jnp.int32))
    return lowered.compile().memory_analysis()


def test_local_cache_bytes_stay_fixed_as_max_length_grows():
    """A local layer's compiled decode step holds the same bytes (cache in and out, temporaries) for a cache of 16
    and of 64 tokens; a global layer's cache grows by exactly its extra slots."""
    batch, lengths = 2, (16, 64)
    local = [_decode_memory(_Layer(WINDOW), batch, n) for n in lengths]
    figures = [(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes) for m in local]
    assert figures[0] == figures[1]
    global_ = [_decode_memory(_Layer(0), batch, n) for n in lengths]
    growth = 2 * batch * KV_HEADS * (lengths[1] - lengths[0]) * HEAD_DIM * 4  # keys and values, float32
    assert global_[1].argument_size_in_bytes - global_[0].argument_size_in_bytes == growth


# --------------------------------------------------------------------------------------------- a local/global model

# 5 layers: a scanned stack of 2 x (local, global), then one more local layer (the `last_layers` stack); the local
# layers with their own RoPE base (Gemma 3), every layer with soft-capping (Gemma 2) and sinks (GPT-OSS)
LOCAL_GLOBAL = ("sliding_window=4", "attention_pattern=[local,global]", "num_layers=5", "num_kv_heads=2",
                "attn_logit_softcapping=5.0", "attention_sinks=true", "rope_local_max_timescale=100",
                "attention=dot_product")
LAYOUT = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
MODEL_PROMPTS = (2, 11, 6)  # BOS + tokens: within, well past and just past the window
MODEL_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def local_global():
    """(1-device config, host params, engine on fsdp=4 x tensor=2, prompts, greedy result with every step's logits)."""
    cfg = tiny_config(*LOCAL_GLOBAL, num_devices=1)
    params = _host_params(cfg)
    engine = _engine(tiny_config(*LOCAL_GLOBAL, *layout_overrides(LAYOUT), num_devices=8), params)
    rng = np.random.default_rng(2)
    prompts = [[1, *rng.integers(3, 259, n - 1).tolist()] for n in MODEL_PROMPTS]
    result = engine.generate(prompts, MODEL_NEW_TOKENS, EOS, PAD, keep_logits=True)
    return cfg, params, engine, prompts, result


def test_local_global_model_generates_what_its_full_forward_pass_predicts(local_global):
    """Greedy generation through the engine (sharded cache, rings in the local layers) equals the argmax of the
    training forward pass over prompt + generated tokens, and every step's logits equal that pass's, far past the
    window."""
    cfg, params, engine, prompts, result = local_global
    full = _full_forward(cfg, params, [p + t for p, t in zip(prompts, result.tokens)])
    for b, (prompt, new) in enumerate(zip(prompts, result.tokens)):
        assert len(new) == MODEL_NEW_TOKENS  # random weights never chose EOS: every step is compared
        at = len(prompt) - 1 + np.arange(len(new))  # the positions whose logits chose the new tokens
        assert at[-1] >= 2 * cfg.model.sliding_window
        np.testing.assert_allclose(np.stack([s[b] for s in result.step_logits]), full[b, at], rtol=0, atol=1e-5)
        allowed = np.asarray(engine.allowed)  # the ids generation may emit (not the byte vocabulary's padding)
        assert new == np.where(allowed, full[b, at], -np.inf).argmax(-1).tolist()


def test_local_global_model_decode_memory_grows_with_its_global_layers_only(local_global):
    """The engine's cache and compiled decode step for 19 and 51 tokens: the local layers' caches are rings of
    `window` slots both times, and the step's per-device argument and output bytes (weights and the donated cache)
    grow by exactly the global layers' extra slots."""
    cfg, _, engine, _, _ = local_global
    rows = 4  # the generation above: 3 prompts padded to fsdp=4's multiple
    lengths = (max(MODEL_PROMPTS) + MODEL_NEW_TOKENS, max(MODEL_PROMPTS) + MODEL_NEW_TOKENS + 32)
    for n in lengths:  # [layers, batch, kv_heads, slots, head_dim]
        decoder = nn.unbox(engine.abstract_cache(rows, n))["decoder"]
        local = (decoder["layers"]["layer_0"], decoder["last_layers"])
        assert {x.shape[3] for x in jax.tree.leaves(local)} == {cfg.model.sliding_window}
        assert {x.shape[3] for x in jax.tree.leaves(decoder["layers"]["layer_1"])} == {n}
    figures = [engine.compile_decode(rows, n)[1].memory_analysis() for n in lengths]
    # keys and values x 2 global layers x rows x 2 kv heads x 32 slots x head_dim 8 x float32, over 8 devices
    extra = 2 * 2 * rows * 2 * (lengths[1] - lengths[0]) * 8 * 4 // 8
    assert figures[1].argument_size_in_bytes - figures[0].argument_size_in_bytes == extra
    assert figures[1].output_size_in_bytes - figures[0].output_size_in_bytes == extra
