"""Gated DeltaNet (layers/gated_deltanet.py) and the gated delta rule (layers/delta_rule.py).

Against transformers (tests/fixtures/deltanet/, tools/make_deltanet_fixtures.py): the layer's output with
`Qwen3NextGatedDeltaNet`'s and `Qwen3_5GatedDeltaNet`'s weights, mapped by the tables below, within 1e-4; the rule's
outputs and final states against `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`.
Against itself: chunked == recurrent (float32, 1e-5) with and without documents, at a length no chunk divides; a
packed row equals each document run alone; generation through the cache (a right-padded prefill, then one token at
a time) equals the full forward pass; gradients finite and the chunked form's equal the recurrent form's; the
chunked form's compiled temporary memory grows linearly with length. A bad head count is one ConfigError line.

HF -> maxshard parameter names of one gated DeltaNet layer (E = hidden_size, hk/hv key/value heads, dk/dv their
widths, K = linear_conv_kernel_dim, g = hv // hk; torch Linear weights are [out, in]):

    Qwen3-Next in_proj_qkvz [hk * (2 dk + 2 g dv), E]: .T viewed [E, hk, 2 dk + 2 g dv], per key head q | k | v | z
        -> query/kernel [E, hk, dk], key/kernel [E, hk, dk], value/kernel, z/kernel [E, hv, dv] (v, z [E, hk, g dv]
           reshaped: value head = key head * g + j)
    Qwen3-Next in_proj_ba [hk * 2 g, E]: .T viewed [E, hk, 2 g], b | a -> b/kernel, a/kernel [E, hv]
    Qwen3.5 in_proj_qkv [2 hk dk + hv dv, E]: .T split q | k | v -> query/kernel, key/kernel, value/kernel
    Qwen3.5 in_proj_z [hv dv, E], in_proj_b, in_proj_a [hv, E]: .T -> z/kernel [E, hv, dv], b/kernel, a/kernel
    conv1d.weight [2 hk dk + hv dv, 1, K]: [:, 0, :].T split q | k | v -> query_conv [K, hk, dk], key_conv,
        value_conv [K, hv, dv]
    A_log [hv] -> A_log;  dt_bias [hv] -> dt_bias;  norm.weight [dv] -> norm/scale (plain scale, not 1 + w)
    out_proj.weight [E, hv dv]: .T viewed [hv, dv, E] -> out/kernel
"""

from __future__ import annotations

import functools
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.errors import ConfigError
from maxshard.model.layers import kv_cache
from maxshard.model.layers.delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule
from maxshard.model.layers.gated_deltanet import GatedDeltaNet, l2_normalize
from maxshard.spec.model_config import ModelConfig
from tests.helpers import tiny_config

FIXTURES = Path(__file__).parent / "fixtures" / "deltanet"
TOLERANCE = 1e-5


def _fixture(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz") as data:
        return dict(data)


def _config(fixture: dict[str, np.ndarray], chunk: int = 4) -> ModelConfig:
    c = {key.split("/", 1)[1]: value.item() for key, value in fixture.items() if key.startswith("config/")}
    return ModelConfig(vocab_size=32, emb_dim=c["hidden_size"], norm_epsilon=c["rms_norm_eps"],
                       linear_num_key_heads=c["linear_num_key_heads"],
                       linear_num_value_heads=c["linear_num_value_heads"],
                       linear_key_head_dim=c["linear_key_head_dim"], linear_value_head_dim=c["linear_value_head_dim"],
                       linear_conv_kernel_dim=c["linear_conv_kernel_dim"], delta_chunk_size=chunk)


def _shared(w: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """The parameters both layouts store alike: the conv kernel split q | k | v, the decay, the norm, out_proj."""
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    conv = w["conv1d.weight"][:, 0, :].T  # [K, channels]
    width = conv.shape[0]
    return {"query_conv": conv[:, :hk * dk].reshape(width, hk, dk),
            "key_conv": conv[:, hk * dk:2 * hk * dk].reshape(width, hk, dk),
            "value_conv": conv[:, 2 * hk * dk:].reshape(width, hv, dv),
            "A_log": w["A_log"], "dt_bias": w["dt_bias"], "norm": {"scale": w["norm.weight"]},
            "out": {"kernel": w["out_proj.weight"].T.reshape(hv, dv, cfg.emb_dim)}}


def from_qwen3_next(w: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Qwen3NextGatedDeltaNet's weights -> GatedDeltaNet's parameters (module docstring's table)."""
    e, hk, hv, dk, dv = (cfg.emb_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim)
    g = hv // hk
    qkvz = w["in_proj_qkvz.weight"].T.reshape(e, hk, 2 * dk + 2 * g * dv)
    ba = w["in_proj_ba.weight"].T.reshape(e, hk, 2 * g)
    kernels = {"query": qkvz[..., :dk], "key": qkvz[..., dk:2 * dk],
               "value": qkvz[..., 2 * dk:2 * dk + g * dv].reshape(e, hv, dv),
               "z": qkvz[..., 2 * dk + g * dv:].reshape(e, hv, dv),
               "b": ba[..., :g].reshape(e, hv), "a": ba[..., g:].reshape(e, hv)}
    return _shared(w, cfg) | {name: {"kernel": k} for name, k in kernels.items()}


def from_qwen3_5(w: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Qwen3_5GatedDeltaNet's weights -> GatedDeltaNet's parameters (module docstring's table)."""
    e, hk, hv, dk, dv = (cfg.emb_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim)
    qkv = w["in_proj_qkv.weight"].T
    kernels = {"query": qkv[:, :hk * dk].reshape(e, hk, dk), "key": qkv[:, hk * dk:2 * hk * dk].reshape(e, hk, dk),
               "value": qkv[:, 2 * hk * dk:].reshape(e, hv, dv), "z": w["in_proj_z.weight"].T.reshape(e, hv, dv),
               "b": w["in_proj_b.weight"].T, "a": w["in_proj_a.weight"].T}
    return _shared(w, cfg) | {name: {"kernel": k} for name, k in kernels.items()}


CONVERTERS = {"qwen3_next": from_qwen3_next, "qwen3_5": from_qwen3_5}


def _layer(cfg: ModelConfig) -> GatedDeltaNet:
    return GatedDeltaNet(cfg, jnp.float32, jnp.float32)


@functools.cache
def _forward(cfg: ModelConfig):
    """The layer's jitted forward pass (params, x, segment_ids, positions) -> out, one per config."""
    return jax.jit(_layer(cfg).apply)


def _params(name: str) -> tuple[ModelConfig, dict, dict[str, np.ndarray]]:
    fixture = _fixture(name)
    cfg = _config(fixture)
    weights = {k.split("/", 1)[1]: v for k, v in fixture.items() if k.startswith("weight/")}
    return cfg, CONVERTERS[name](weights, cfg), fixture


def _segments_and_positions(batch: int, length: int) -> tuple[jax.Array, jax.Array]:
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    return jnp.ones((batch, length), jnp.int32), positions


@pytest.mark.parametrize("name", sorted(CONVERTERS))
def test_layer_equals_transformers(name: str) -> None:
    cfg, params, fixture = _params(name)
    x = jnp.asarray(fixture["x"])
    layer = _layer(cfg)
    shapes = jax.eval_shape(lambda: layer.init(jax.random.key(0), x, *_segments_and_positions(*x.shape[:2])))
    expected = jax.tree.map(lambda s: s.shape, nn.unbox(shapes["params"]))
    assert jax.tree.map(np.shape, params) == expected  # the table covers every parameter, in its shape
    out = _forward(cfg)({"params": params}, x, *_segments_and_positions(*x.shape[:2]))
    np.testing.assert_allclose(out, fixture["out"], atol=1e-4, rtol=1e-4)


def test_rule_equals_transformers() -> None:
    f = _fixture("rule")
    q, k = l2_normalize(f["q"]), l2_normalize(f["k"])
    args = (q, k, f["v"], f["g"], f["beta"])
    chunked = jax.jit(functools.partial(chunked_gated_delta_rule, chunk_size=4))
    chunk_out, chunk_state = chunked(*args, initial_state=f["initial_state"])
    rec_out, rec_state = jax.jit(recurrent_gated_delta_rule)(*args, initial_state=f["initial_state"])
    for got, want in ((chunk_out, "chunk_out"), (chunk_state, "chunk_state"), (rec_out, "recurrent_out"),
                      (rec_state, "recurrent_state")):
        np.testing.assert_allclose(got, f[want], atol=TOLERANCE, rtol=TOLERANCE, err_msg=want)


def _rule_inputs(batch: int = 2, length: int = 19, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6,
                 seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q, k = l2_normalize(normal(batch, length, hk, dk)), l2_normalize(normal(batch, length, hk, dk))
    g = -jax.nn.softplus(normal(batch, length, hv))
    return q, k, normal(batch, length, hv, dv), g, jax.nn.sigmoid(normal(batch, length, hv))


# three documents per row at different places, one starting at a chunk's first token (8) in row 0
SEGMENTS = jnp.asarray([[1] * 8 + [2] * 6 + [3] * 5, [1] * 3 + [2] * 13 + [3] * 3], jnp.int32)


@pytest.mark.parametrize("segments", [None, SEGMENTS], ids=["one_document", "packed"])
def test_chunked_equals_recurrent(segments: jax.Array | None) -> None:
    """Length 19 in chunks of 8 (padded inside to 24), with an initial state."""
    args = _rule_inputs()
    state = 0.1 * jnp.asarray(np.random.default_rng(1).standard_normal((2, 4, 8, 6)), jnp.float32)
    chunked = jax.jit(functools.partial(chunked_gated_delta_rule, chunk_size=8))
    chunk_out, chunk_state = chunked(*args, segment_ids=segments, initial_state=state)
    rec_out, rec_state = jax.jit(recurrent_gated_delta_rule)(*args, segment_ids=segments, initial_state=state)
    np.testing.assert_allclose(chunk_out, rec_out, atol=TOLERANCE, rtol=TOLERANCE)
    np.testing.assert_allclose(chunk_state, rec_state, atol=TOLERANCE, rtol=TOLERANCE)
    if segments is not None:  # the reset is real: without it the later documents read the earlier ones' state
        unreset, _ = recurrent_gated_delta_rule(*args, initial_state=state)
        assert np.abs(np.asarray(unreset - rec_out)[:, 8:]).max() > 1e-3


def test_packed_row_equals_documents_alone() -> None:
    """The layer (conv and rule) on a packed row equals each document on its own."""
    cfg, params, _ = _params("qwen3_5")
    forward = _forward(cfg)
    bounds = ((0, 5), (5, 6), (6, 13))  # a one-token document in the middle; chunks of 4 cut the others
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 13, cfg.emb_dim)), jnp.float32)
    segments = jnp.asarray([[i + 1 for i, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)]], jnp.int32)
    _, positions = _segments_and_positions(1, 13)
    packed = forward({"params": params}, x, segments, positions)
    for lo, hi in bounds:
        alone = forward({"params": params}, x[:, lo:hi], *_segments_and_positions(1, hi - lo))
        np.testing.assert_allclose(packed[:, lo:hi], alone, atol=TOLERANCE, rtol=TOLERANCE)


def test_decode_through_the_cache_equals_the_full_forward() -> None:
    """A right-padded prefill (row 1 has 3 real tokens of 6, its padding random), then one token at a time at each
    row's own position: every output equals the full forward pass at that position."""
    cfg, params, _ = _params("qwen3_next")
    layer = _layer(cfg)
    batch, prompt, total = 2, 6, 12
    x = jnp.asarray(np.random.default_rng(3).standard_normal((batch, total, cfg.emb_dim)), jnp.float32)
    full = _forward(cfg)({"params": params}, x, *_segments_and_positions(batch, total))
    lengths = jnp.asarray([prompt, 3])

    def call(cache, tokens, positions):
        out, state = layer.apply({"params": params, kv_cache.COLLECTION: cache}, tokens, jnp.ones_like(positions),
                                 positions, mutable=[kv_cache.COLLECTION])
        return out, state[kv_cache.COLLECTION]

    shapes = jax.eval_shape(lambda: layer.apply({"params": params}, x, *_segments_and_positions(batch, total),
                                                mutable=[kv_cache.COLLECTION])[1][kv_cache.COLLECTION])
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), nn.unbox(shapes))
    index = jnp.arange(prompt)[None, :]
    prompt_positions = jnp.where(index < lengths[:, None], index, -1)
    noise = jnp.asarray(np.random.default_rng(4).standard_normal(x[:, :prompt].shape), jnp.float32)
    prompts = jnp.where((prompt_positions >= 0)[..., None], x[:, :prompt], noise)  # padding must not leak
    step = jax.jit(call)
    out, cache = step(cache, prompts, prompt_positions)
    np.testing.assert_allclose(out[0], full[0, :prompt], atol=TOLERANCE, rtol=TOLERANCE)
    np.testing.assert_allclose(out[1, :3], full[1, :3], atol=TOLERANCE, rtol=TOLERANCE)
    positions = lengths
    for _ in range(total - prompt):
        tokens = jnp.take_along_axis(x, positions[:, None, None], axis=1)
        out, cache = step(cache, tokens, positions[:, None])
        want = jnp.take_along_axis(full, positions[:, None, None], axis=1)
        np.testing.assert_allclose(out, want, atol=TOLERANCE, rtol=TOLERANCE)
        positions = positions + 1


def test_gradients_chunked_equal_recurrent() -> None:
    """d(sum(out * cos(out)) + the final state's sum)/d(q, k, v, g, beta), packed documents, length 19 in chunks of
    8; and the layer's parameter gradients are finite."""
    args = _rule_inputs(length=19)

    def loss(rule, *xs):
        out, state = rule(*xs)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(state)

    chunked = functools.partial(chunked_gated_delta_rule, chunk_size=8, segment_ids=SEGMENTS)
    recurrent = functools.partial(recurrent_gated_delta_rule, segment_ids=SEGMENTS)
    argnums = tuple(range(1, 6))
    got = jax.jit(jax.grad(loss, argnums), static_argnums=0)(chunked, *args)
    want = jax.jit(jax.grad(loss, argnums), static_argnums=0)(recurrent, *args)
    for a, b in zip(got, want):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)

    cfg, params, fixture = _params("qwen3_next")
    x = jnp.asarray(fixture["x"])
    forward = _forward(cfg)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(forward({"params": p}, x, *_segments_and_positions(*x.shape[:2])) ** 2)
                             ))(params)
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in leaves)
    assert all(np.abs(np.asarray(leaf)).max() > 0 for leaf in leaves)  # every parameter moves the output


def test_chunked_memory_grows_linearly() -> None:
    """Forward and backward of the chunked form compiled at 1k and 4k tokens: temporary memory x ~4, far below the
    x16 a length x length score matrix would take."""

    def temp_bytes(length: int) -> int:
        q = jax.ShapeDtypeStruct((1, length, 1, 16), jnp.float32)
        v = jax.ShapeDtypeStruct((1, length, 1, 16), jnp.float32)
        gate = jax.ShapeDtypeStruct((1, length, 1), jnp.float32)
        segments = jax.ShapeDtypeStruct((1, length), jnp.int32)

        def loss(q, k, v, g, beta, segments):
            return jnp.sum(chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=64, segment_ids=segments)[0])

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(q, q, v, gate, gate, segments).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    ratio = temp_bytes(4096) / temp_bytes(1024)
    assert 2 < ratio < 6, ratio


def test_value_heads_not_a_multiple_of_key_heads_is_one_line() -> None:
    with pytest.raises(ConfigError, match="linear_num_value_heads=6 must be a multiple of linear_num_key_heads=4"):
        tiny_config("linear_num_key_heads=4", "linear_num_value_heads=6")
