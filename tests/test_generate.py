"""Generation with the KV cache: every decode step's logits equal the full forward pass's for the same prefix
(dense, grouped-query and MoE models, prompts of different lengths in one batch), greedy tokens are the same on
every layout, greedy is deterministic, sampling is reproducible by seed and top_k=1 is greedy.

Models are randomly initialised tiny ones (no training needed: the cache must reproduce whatever function the
weights compute). Tolerance 1e-5 on float32 logits of order 1-10: the cached path sums the same products in another
order, so bit equality is not expected; a wrong position, a stale or missing slot, or a mask off by one moves logits
by orders of magnitude more. Each engine compiles its prefill and decode once per module (fixtures).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.generation.decode import Engine, Result, decode_model
from maxshard.generation.sampling import Sampling, allowed_tokens, sample
from maxshard.model.transformer import Transformer, abstract_params
from maxshard.parallel import sharding
from maxshard.training.step import mesh_context
from tests.helpers import layout_overrides, mesh_for, tiny_config

PROMPT_LENGTHS = (3, 9, 5)  # BOS + tokens, one batch: right-padded to 9
NEW_TOKENS = 6
EOS, PAD = 2, 0
MODELS = {
    "dense": (),
    "gqa": ("num_kv_heads=2",),
    "moe": ("num_experts=4", "num_experts_per_tok=2", "moe_layer_interval=2", "capacity_factor=1.0"),
}


def _config(model: str, *layout: str):
    return tiny_config(*MODELS[model], *layout_overrides(layout), num_devices=_devices(layout))


def _devices(layout: tuple[str, ...]) -> int:
    return int(np.prod([int(item.split("=")[1]) for item in layout])) if layout else 1


def _host_params(cfg) -> dict:
    """Random weights drawn on the host (no init program to compile): kernels ~ N(0, 1/emb_dim), the embedding
    ~ N(0, 1), norm scales 1 + N(0, 0.1); any weights serve, the cache must reproduce what they compute."""
    rng = np.random.default_rng(1)

    def leaf(path: tuple, shape: jax.ShapeDtypeStruct) -> np.ndarray:
        name = sharding.path_name(path)
        if name.endswith("scale"):
            return (1 + 0.1 * rng.standard_normal(shape.shape)).astype(np.float32)
        std = 1.0 if name.endswith("embedding") else cfg.model.emb_dim**-0.5
        return (std * rng.standard_normal(shape.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, nn.unbox(abstract_params(cfg.model)))


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[1, *rng.integers(3, vocab, n - 1).tolist()] for n in PROMPT_LENGTHS]


def _engine(cfg, host_params: dict) -> Engine:
    mesh, rules = mesh_for(cfg), sharding.flax_rules(cfg)
    shardings = sharding.tree_shardings(abstract_params(cfg.model), mesh, rules)
    allowed = allowed_tokens(cfg.model.vocab_size, 259, (PAD, 1))
    return Engine(cfg.model, mesh, rules, jax.device_put(host_params, shardings), allowed)


def _generate(engine: Engine, sampling: Sampling = Sampling(), seed: int = 0, keep_logits: bool = False) -> Result:
    return engine.generate(_prompts(259), NEW_TOKENS, EOS, PAD, sampling, seed, keep_logits=keep_logits)


def _full_forward(cfg, host_params: dict, sequences: list[list[int]]) -> np.ndarray:
    """Logits [batch, length, vocab] of the training path on one device (right-padded, padding in segment 0)."""
    length = max(map(len, sequences))
    tokens = np.array([s + [PAD] * (length - len(s)) for s in sequences], np.int32)
    segments = (np.arange(length)[None] < np.array([len(s) for s in sequences])[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
    model = Transformer(decode_model(cfg.model))  # MoE: dropless, as generation routes
    with mesh_context(mesh_for(cfg), sharding.flax_rules(cfg)):
        return np.asarray(jax.jit(model.apply)({"params": host_params}, tokens, segments, positions))


# --------------------------------------------------------------------------------------------- cache == full forward


@pytest.fixture(scope="module")
def dense():
    """(config, host params, engine, greedy result with logits) of the dense model on one device."""
    cfg = _config("dense")
    params = _host_params(cfg)
    engine = _engine(cfg, params)
    return cfg, params, engine, _generate(engine, keep_logits=True)


LOGIT_CASES = {  # model: the layout it decodes on (the reference forward always runs on one device)
    "dense": (),
    "gqa": ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
    "moe": ("ici_expert_parallelism=2", "ici_fsdp_parallelism=4"),
}


@pytest.mark.parametrize("model", sorted(LOGIT_CASES))
def test_every_decode_step_equals_the_full_forward_pass(model, dense):
    if model == "dense":
        cfg, params, _, result = dense
    else:
        cfg = _config(model, *LOGIT_CASES[model])
        params = _host_params(_config(model))
        result = _generate(_engine(cfg, params), keep_logits=True)
    prompts = _prompts(259)
    full = _full_forward(_config(model), params, [p + t for p, t in zip(prompts, result.tokens)])
    checked = 0
    for b, (prompt, new) in enumerate(zip(prompts, result.tokens)):
        for i in range(len(new)):  # the logits that chose new token i sit at position len(prompt) - 1 + i
            np.testing.assert_allclose(result.step_logits[i][b], full[b, len(prompt) - 1 + i], rtol=0, atol=1e-5)
            checked += 1
    assert checked == len(prompts) * NEW_TOKENS  # random weights never chose EOS here: every step was compared
    assert np.abs(full).max() > 0.1  # the logits are not trivially zero


def test_generation_stops_at_any_of_several_eos_ids(dense):
    """Several EOS ids (Qwen's generation_config.json lists two): each sequence ends at the first of any of them."""
    _, _, engine, reference = dense
    stops = (reference.tokens[0][2], reference.tokens[1][1])  # tokens the greedy run chose, as stop ids
    result = engine.generate(_prompts(259), NEW_TOKENS, stops, PAD)
    for row, full in zip(result.tokens, reference.tokens):
        ends = [i for i, t in enumerate(full) if t in stops]
        assert row == (full[: ends[0] + 1] if ends else full)
    assert len(result.tokens[0]) <= 3 and len(result.tokens[1]) <= 2


# --------------------------------------------------------------------------------------------- refilled rows


def _many_prompts(count: int = 10) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[1, *rng.integers(3, 259, int(n)).tolist()] for n in rng.integers(2, 9, count)]


def test_refilled_rows_give_every_prompt_the_tokens_of_one_batch(dense):
    """`rows=4` for 10 prompts: finished rows take waiting prompts, and each prompt's greedy tokens are those of
    all 10 in one batch, with sequences ending early (stop ids the one-batch run chose at different steps) and at
    the token limit; the decode steps are fewer than three rounds of four prompts would take."""
    _, _, engine, _ = dense
    prompts, new = _many_prompts(), 10
    whole = engine.generate(prompts, new, EOS, PAD)
    stops = (whole.tokens[0][1], whole.tokens[3][4], whole.tokens[7][6])
    reference = engine.generate(prompts, new, stops, PAD)
    lengths = sorted(len(t) for t in reference.tokens)
    assert lengths[0] <= 3 and lengths[-1] == new  # early stops and the limit both happen
    refilled = engine.generate(prompts, new, stops, PAD, rows=4)
    assert refilled.tokens == reference.tokens
    rounds = sum(max(len(t) for t in reference.tokens[i: i + 4]) - 1 for i in range(0, len(prompts), 4))
    assert refilled.decode_steps < rounds and refilled.prefill_seconds > 0
    hot = Sampling(temperature=1.0)
    assert (engine.generate(prompts, new, stops, PAD, hot, seed=5, rows=4).tokens
            == engine.generate(prompts, new, stops, PAD, hot, seed=5, rows=4).tokens)
    one = engine.generate(prompts, 1, stops, PAD, rows=4)
    assert one.tokens == [t[:1] for t in reference.tokens] and one.decode_steps == 0
    with pytest.raises(ValueError, match="keep_logits"):
        engine.generate(prompts, new, stops, PAD, rows=4, keep_logits=True)


def test_refilled_rows_split_over_fsdp_give_one_device_s_tokens(dense):
    _, params, engine, _ = dense
    prompts = _many_prompts()
    stops = tuple(engine.generate(prompts, 10, EOS, PAD).tokens[i][i % 5] for i in (0, 4, 8))
    split = _engine(_config("dense", "ici_fsdp_parallelism=4"), params)
    assert split.generate(prompts, 10, stops, PAD, rows=4).tokens == engine.generate(prompts, 10, stops, PAD).tokens


# --------------------------------------------------------------------------------------------- layouts


def _shards(entry, mesh_shape) -> int:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return int(np.prod([mesh_shape[a] for a in axes]))


@pytest.mark.parametrize(("layout", "batch_shards", "head_shards"), [
    (("ici_fsdp_parallelism=8",), 8, 1),
    (("ici_tensor_parallelism=8",), 1, 8),
    (("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"), 4, 2),
], ids=["fsdp8", "tensor8", "fsdp4_tensor2"])
def test_greedy_tokens_are_the_same_on_every_layout(layout, batch_shards, head_shards, dense):
    _, params, _, reference = dense
    engine = _engine(_config("dense", *layout), params)
    assert _generate(engine).tokens == reference.tokens
    # ... and the cache [layers, batch, kv_heads, length, head_dim] really is split as the layout says
    specs = sharding.tree_specs(engine.abstract_cache(8, 15), engine.rules, dict(engine.mesh.shape))
    spec = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    assert (_shards(spec[1], engine.mesh.shape), _shards(spec[2], engine.mesh.shape)) == (batch_shards, head_shards)


# --------------------------------------------------------------------------------------------- sampling


def test_greedy_is_deterministic(dense):
    _, _, engine, reference = dense
    assert _generate(engine, seed=1).tokens == _generate(engine, seed=2).tokens == reference.tokens


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy(dense):
    _, _, engine, greedy = dense
    hot = Sampling(temperature=1.0, top_p=0.95)
    first, again, other = (_generate(engine, hot, seed=s).tokens for s in (7, 7, 8))
    assert first == again
    assert first != other and first != greedy.tokens  # sampling really samples
    assert _generate(engine, Sampling(temperature=0.7, top_k=1), seed=7).tokens == greedy.tokens


@jax.jit
def _draws(logits: jax.Array, allowed: jax.Array, knobs: tuple[jax.Array, ...]) -> jax.Array:
    """256 draws [256] from one row of logits [vocab]."""
    rows = jnp.broadcast_to(logits, (256, logits.shape[0]))
    return sample(rows, allowed, jax.random.key(0), *knobs)


def test_filters_keep_what_they_promise():
    """top_k keeps k tokens, top_p the smallest head reaching p, disallowed ids never come out, ties go low."""
    logits = jnp.log(jnp.array([0.05, 0.4, 0.3, 0.2, 0.05]))
    allowed = jnp.array([True, True, True, True, False])
    draws = lambda s: set(np.asarray(_draws(logits, allowed, s.arrays())).tolist())  # noqa: E731
    assert draws(Sampling(1.0, top_k=2)) == {1, 2}
    assert draws(Sampling(1.0, top_p=0.75)) == {1, 2, 3}  # 0.4 + 0.3 < 0.75: the third one is needed
    assert draws(Sampling(5.0)) == {0, 1, 2, 3}  # hot: every allowed id, never the disallowed one
    assert draws(Sampling()) == {1}
    tie = jnp.array([0.0, 2.0, 2.0, 1.0, 0.0])
    assert draws(Sampling()) == {1} and set(np.asarray(_draws(tie, allowed, Sampling(1.0, 1).arrays())).tolist()) == {1}
