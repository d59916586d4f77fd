"""Multi-head latent attention (layers/mla.py) and YaRN (layers/rope.py) against transformers, every attention
kernel with value heads narrower than query/key heads, the layouts, and generation from the latent cache.

- YaRN: frequencies, cos/sin factor and softmax scale equal transformers' (tests/fixtures/mla/yarn.json, written by
  tools/make_mla_fixtures.py): DeepSeek-V3's constants, two different mscales, a Qwen-style grouped-query case.
- DeepseekV3Attention (eager, float32, interleaved RoPE, YaRN) on random weights: LatentAttention with the weights
  mapped as a converter maps them (rope.deinterleaved on the RoPE columns) gives its output within 1e-5; so does
  attention.py for Qwen3Attention with Qwen's YaRN (grouped-query heads).
- Kernels: cudnn (through XLA, on zero-padded values), tokamax (its XLA path) and splash (interpret mode) with q/k
  heads of 12 and v heads of 6 features against dot_product, outputs and gradients within 1e-5.
- A tiny MLA + YaRN model's loss and gradients under fsdp4 x tensor2 (blockwise) and
  context2 x fsdp4 (ring attention) equal one device's dot_product within 1e-5 (one layer: the layer is what is new).
- Generation under fsdp4 x tensor2: every decode step's logits (absorbed projections over the cached latent)
  equal the full forward within 1e-5; the compiled decode's cache is layers x batch x length x
  (kv_lora_rank + qk_rope_head_dim) x itemsize bytes.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard import config, data
from maxshard.errors import ConfigError
from maxshard.generation.decode import Engine
from maxshard.generation.sampling import allowed_tokens
from maxshard.model import flops, transformer
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import attention_ops as ops
from maxshard.model.layers import mla, rope
from maxshard.model.layers.attention import Attention
from maxshard.model.transformer import Transformer, abstract_params
from maxshard.parallel import sharding
from maxshard.run import loading
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import layout_overrides, max_relative_difference, mesh_for, tiny_config

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "mla"
TOLERANCE = 1e-5
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}  # same numbers

# --------------------------------------------------------------------------------------------- YaRN


@pytest.mark.parametrize("case", ["deepseek_v3", "two_mscales", "qwen_gqa"])
def test_yarn_equals_transformers(case: str) -> None:
    c = json.loads((FIXTURES / "yarn.json").read_text())[case]
    mla_keys = dict(attention_type="mla", qk_nope_head_dim=c["width"] - c["rope_dim"], qk_rope_head_dim=c["rope_dim"])
    model = ModelConfig(vocab_size=8, rope_max_timescale=c["theta"], rope_scaling_type="yarn",
                        rope_scaling_factor=c["factor"], rope_original_max_position=c["original"],
                        yarn_beta_fast=c["beta_fast"], yarn_beta_slow=c["beta_slow"], yarn_mscale=c["mscale"] or 1.0,
                        yarn_mscale_all_dim=c["mscale_all_dim"] or 0.0,
                        **(mla_keys if c["family"] == "deepseek" else dict(head_dim=c["rope_dim"])))
    inv_freq = rope.frequencies_for(model)
    np.testing.assert_allclose(inv_freq, c["inv_freq"], rtol=2e-7)  # transformers computes them in float32
    plain = rope.inverse_frequencies(c["rope_dim"], c["theta"])
    assert inv_freq[0] == plain[0] and inv_freq[-1] == pytest.approx(plain[-1] / c["factor"])  # kept .. divided
    assert rope.cos_sin_scale(model) == pytest.approx(c["attention_factor"], rel=1e-12)
    assert rope.softmax_scale(model, c["width"]) == pytest.approx(c["softmax_scale"], rel=1e-12)


def test_deinterleaved_rope_equals_interleaved_rotation() -> None:
    """DeepSeek's checkpoints rotate pairs (x0, x1), (x2, x3), ..., returned in the half layout (transformers'
    apply_rotary_pos_emb_interleave); the half-layout rotation of the reordered features is the same numbers."""
    rng = np.random.default_rng(0)
    x, positions = rng.normal(size=(1, 3, 2, 8)).astype(np.float32), jnp.array([[0, 5, 11]])
    inv = rope.inverse_frequencies(8, 50.0)
    angle = np.asarray(positions)[..., None, None] * inv  # [1, 3, 1, 4]
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = np.cos(angle), np.sin(angle)
    interleaved = np.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    ours = rope.apply_rope(jnp.asarray(x[..., rope.deinterleaved(8)]), positions, inv)
    np.testing.assert_allclose(np.asarray(ours), interleaved, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------- transformers' MLA


def _from_transformers(w: dict[str, np.ndarray], model: ModelConfig) -> dict:
    """DeepseekV3Attention's weights ([out, in], interleaved RoPE columns) -> LatentAttention's parameters."""
    heads, n, p, v = model.num_heads, model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
    r, order = model.kv_lora_rank, rope.deinterleaved(p)
    query = w.get("q_b_proj.weight", w.get("q_proj.weight"))
    query = query.reshape(heads, n + p, -1)
    query = np.concatenate([query[:, :n], query[:, n:][:, order]], axis=1).transpose(2, 0, 1)
    kv_down = np.concatenate([w["kv_a_proj_with_mqa.weight"][:r], w["kv_a_proj_with_mqa.weight"][r:][order]])
    kv_up = w["kv_b_proj.weight"].reshape(heads, n + v, r)
    params = {"query": {"kernel": query}, "kv_down": {"kernel": kv_down.T},
              "kv_down_norm": {"scale": w["kv_a_layernorm.weight"]},
              "key": {"kernel": kv_up[:, :n].transpose(2, 0, 1)}, "value": {"kernel": kv_up[:, n:].transpose(2, 0, 1)},
              "out": {"kernel": w["o_proj.weight"].T.reshape(heads, v, -1)}}
    if "q_a_proj.weight" in w:
        params.update(query_down={"kernel": w["q_a_proj.weight"].T},
                      query_down_norm={"scale": w["q_a_layernorm.weight"]})
    return params


@pytest.mark.parametrize("case", ["q_lora", "plain_query"])
def test_latent_attention_equals_transformers(case: str) -> None:
    hf = json.loads((FIXTURES / "attention.json").read_text())["deepseek_v3"]
    arrays = np.load(FIXTURES / "attention.npz")
    w = {k.split("/", 1)[1]: arrays[k] for k in arrays.files if k.startswith(case + "/")}
    yarn = hf["rope_parameters"]
    model = ModelConfig(vocab_size=8, emb_dim=hf["hidden_size"], num_heads=hf["num_attention_heads"],
                        attention_type="mla", q_lora_rank=16 if case == "q_lora" else 0,
                        kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
                        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
                        norm_epsilon=hf["rms_norm_eps"], rope_max_timescale=yarn["rope_theta"],
                        rope_scaling_type="yarn", rope_scaling_factor=yarn["factor"],
                        rope_original_max_position=yarn["original_max_position_embeddings"],
                        yarn_beta_fast=yarn["beta_fast"], yarn_beta_slow=yarn["beta_slow"], yarn_mscale=yarn["mscale"],
                        yarn_mscale_all_dim=yarn["mscale_all_dim"])
    layer = mla.LatentAttention(model, jnp.float32, jnp.float32)
    x = w.pop("x")
    expected = w.pop("out")
    positions = np.broadcast_to(np.arange(x.shape[1], dtype=np.int32), x.shape[:2])
    params = _from_transformers(w, model)
    shapes = jax.tree.map(np.shape, nn.unbox(jax.eval_shape(layer.init, jax.random.key(0), x, positions, positions)))
    assert jax.tree.map(np.shape, params) == shapes["params"]  # every parameter mapped, in its shape
    out = jax.jit(layer.apply)({"params": params}, x, np.ones_like(positions), positions)
    assert max_relative_difference(out, expected) < TOLERANCE


def test_grouped_query_attention_with_yarn_equals_transformers_qwen3() -> None:
    """Qwen's long-context YaRN on grouped-query heads (Qwen3Attention: 4 query / 2 kv heads, q/k norm): the
    frequencies and the cos/sin factor 0.1 ln(4) + 1 reach attention.py as they reach transformers."""
    hf = json.loads((FIXTURES / "attention.json").read_text())["qwen3_yarn"]
    arrays = np.load(FIXTURES / "attention.npz")
    w = {k.split("/", 1)[1]: arrays[k] for k in arrays.files if k.startswith("qwen3_yarn/")}
    yarn = hf["rope_parameters"]
    model = ModelConfig(vocab_size=8, emb_dim=hf["hidden_size"], num_heads=hf["num_attention_heads"],
                        num_kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], qk_norm=True,
                        norm_epsilon=hf["rms_norm_eps"], rope_max_timescale=yarn["rope_theta"],
                        rope_scaling_type="yarn", rope_scaling_factor=yarn["factor"],
                        rope_original_max_position=yarn["original_max_position_embeddings"])
    embed, heads, kv_heads, dim = model.emb_dim, model.num_heads, model.num_kv_heads, model.head_dim
    params = {"query": {"kernel": w["q_proj.weight"].T.reshape(embed, heads, dim)},
              "key": {"kernel": w["k_proj.weight"].T.reshape(embed, kv_heads, dim)},
              "value": {"kernel": w["v_proj.weight"].T.reshape(embed, kv_heads, dim)},
              "out": {"kernel": w["o_proj.weight"].T.reshape(heads, dim, embed)},
              "query_norm": {"scale": w["q_norm.weight"]}, "key_norm": {"scale": w["k_norm.weight"]}}
    x = w["x"]
    positions = np.broadcast_to(np.arange(x.shape[1], dtype=np.int32), x.shape[:2])
    out = jax.jit(Attention(model, jnp.float32, jnp.float32).apply)({"params": params}, x, np.ones_like(positions),
                                                                   positions)
    assert rope.cos_sin_scale(model) == pytest.approx(0.1 * np.log(4.0) + 1)
    assert max_relative_difference(out, w["out"]) < TOLERANCE


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_flop_inventory_counts_the_latent_attention_kernels(q_lora_rank: int) -> None:
    """spec/blocks.py's MLA widths (the FLOP count) are the kernels LatentAttention holds (and the head, MLP)."""
    model = ModelConfig(vocab_size=32, emb_dim=16, num_layers=2, num_heads=2, mlp_dim=48, max_target_length=8,
                        attention_type="mla", q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6)
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(abstract_params(model)))[0]
    kernels = sum(leaf.size for path, leaf in flat if jax.tree_util.keystr(path).endswith("['kernel']"))
    assert flops.matmul_params(model) == kernels


# --------------------------------------------------------------------------------------------- kernels


def _inputs(length: int, heads: int, kv_heads: int, qk: int, v_dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(1, length, heads, qk)) * qk**-0.5, jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, length, kv_heads, qk)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, length, kv_heads, v_dim)), jnp.float32)
    segments = jnp.asarray(np.sort(rng.integers(0, 3, size=(1, length)), axis=1), jnp.int32)
    return q, k, v, segments


def _value_and_grads(fn, q, k, v, segments):
    def loss(q, k, v):
        out = fn(q, k, v, segments, segments)
        return jnp.sum(out * jnp.cos(out)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(q, k, v).compile(
        FAST_COMPILE)(q, k, v)
    return out, grads


KERNELS = {
    "cudnn": (dict(length=16, heads=4, kv_heads=2, qk=12, v_dim=6), lambda *a: ops.attend(*a, implementation="cudnn")),
    "tokamax": (dict(length=16, heads=4, kv_heads=2, qk=12, v_dim=6),
                lambda *a: ops.attend(*a, implementation="tokamax")),
    "splash": (dict(length=128, heads=2, kv_heads=1, qk=12, v_dim=6),  # interpret mode; one 128-token block
               lambda *a: ops.attend(*a, implementation="splash", block_q=128, block_kv=128)),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernels_take_value_heads_narrower_than_query_key_heads(kernel: str) -> None:
    """`attend` with each implementation equals dot_product, forward and backward: tokamax and splash take the
    narrower values as they are, cudnn gets them zero-padded (`one_width`). Blockwise and ring attention are
    checked in the model below (query/key heads of 12, value heads of 6, two blocks a sequence)."""
    if kernel == "tokamax":
        pytest.importorskip("tokamax")
    if kernel == "splash":
        pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    shape, fn = KERNELS[kernel]
    inputs = _inputs(**shape)
    ref_out, ref_grads = _value_and_grads(ops.dot_product, *inputs)
    out, grads = _value_and_grads(fn, *inputs)
    assert out.shape == (*inputs[0].shape[:3], shape["v_dim"])
    assert max_relative_difference(out, ref_out) < TOLERANCE
    assert max_relative_difference(grads, ref_grads) < TOLERANCE


# --------------------------------------------------------------------------------------------- in the model

MLA = ("attention_type=mla", "q_lora_rank=16", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=4",
       "v_head_dim=6", "num_kv_heads=1",  # unused by mla: any value
       "rope_scaling_type=yarn", "rope_scaling_factor=4", "rope_original_max_position=8", "yarn_beta_fast=4",
       "yarn_mscale_all_dim=1.0", "max_target_length=16", "attention_block_q=8", "attention_block_kv=8",
       "num_layers=1")
LAYOUTS = {
    "fsdp4_tensor2": ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
    # the ring over context shards and the sequence axis splitting the length again, in one program
    "context2_sequence2_fsdp2": ("ici_context_parallelism=2", "ici_sequence_parallelism=2", "ici_fsdp_parallelism=2"),
}


def _config(*overrides: str, num_devices: int = 8):
    return tiny_config(*MLA, *overrides, num_devices=num_devices, global_batch=8)


def _loss_and_grads(trainer: Trainer, params, batch) -> tuple[float, object]:
    with mesh_context(trainer.mesh, trainer.rules):
        grads, sums = jax.jit(trainer._grads).lower(params, batch).compile(FAST_COMPILE)(params, batch)
    return float(sums["loss_sum"] / sums["weight_sum"]), jax.device_get(grads)


def _host_params(model: ModelConfig, lora_b: bool = False) -> dict:
    """Random weights drawn on the host (init's compile costs more than the tests): kernels ~ N(0, 1/emb_dim), the
    embedding ~ N(0, 1), norm scales 1 + N(0, 0.1^2); LoRA's B nonzero only with `lora_b`."""
    rng = np.random.default_rng(1)

    def leaf(path: tuple, shape: jax.ShapeDtypeStruct) -> np.ndarray:
        name = sharding.path_name(path)
        if name.endswith("scale"):
            return (1 + 0.1 * rng.standard_normal(shape.shape)).astype(np.float32)
        std = 1.0 if name.endswith("embedding") else 0.0 if name.endswith("lora_b") and not lora_b else 0.125
        return (std * rng.standard_normal(shape.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, nn.unbox(abstract_params(model)))


@pytest.fixture(scope="module")
def reference():
    """Parameters, a packed batch (two documents a row) and the one-device dot_product loss and gradients."""
    cfg = _config("ici_fsdp_parallelism=1", "attention=dot_product", num_devices=1)
    trainer = Trainer(cfg, mesh_for(cfg))
    params = _host_params(cfg.model)
    rng = np.random.default_rng(0)
    rows, length = cfg.global_batch_size, cfg.max_target_length
    segments = np.where(np.arange(length) < 10, 1, 2)[None].repeat(rows, 0).astype(np.int32)
    positions = np.where(np.arange(length) < 10, np.arange(length), np.arange(length) - 10)[None].repeat(rows, 0)
    tokens = rng.integers(3, 259, size=(rows, length + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
             "positions": positions.astype(np.int32), "loss_weights": np.ones((rows, length), np.float32)}
    return params, batch, _loss_and_grads(trainer, params, batch)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_latent_attention_model_matches_one_device(layout: str, reference) -> None:
    params, batch, (ref_loss, ref_grads) = reference
    cfg = _config(*layout_overrides(LAYOUTS[layout]), "attention=blockwise")
    assert cfg.model.attention_type == "mla"
    trainer = Trainer(cfg, mesh_for(cfg))
    if layout == "fsdp4_tensor2":  # heads over tensor; the up projections' latent over fsdp, not repeated
        attention = nn.get_partition_spec(abstract_params(cfg.model))["decoder"]["layers"]["attention"]
        sizes = dict(trainer.mesh.shape)
        assert sharding.mesh_axes(attention["key"]["kernel"], trainer.rules, sizes) == ((), ("fsdp",), ("tensor",), ())
        assert sharding.mesh_axes(attention["kv_down"]["kernel"], trainer.rules, sizes) == ((), ("fsdp",), ())
    params = jax.device_put(params, trainer.state_shardings.params)
    batch = jax.device_put(batch, trainer.batch_shardings(data.batch_sharding(cfg, trainer.mesh)))
    loss, grads = _loss_and_grads(trainer, params, batch)
    assert loss == pytest.approx(ref_loss, rel=TOLERANCE)
    assert max_relative_difference(grads, ref_grads) < TOLERANCE


# --------------------------------------------------------------------------------------------- generation

# the 14-token prompt makes the prefill expand keys and values from the cached latents (mla._expanding_is_cheaper);
# decode steps absorb the projections
PROMPTS = [[1, 7, 9], [1, 4, 5, 6, 8, 10, 11, 12, 13], [1, 3, 3, 5, 7], [1, *range(20, 33)]]
NEW_TOKENS = 5


def test_decode_from_the_latent_cache_equals_the_full_forward() -> None:
    cfg = _config(*layout_overrides(LAYOUTS["fsdp4_tensor2"]), "lora_rank=2")
    host = _host_params(cfg.model, lora_b=True)  # the absorbed kernels include the adapters' corrections
    mesh, rules = mesh_for(cfg), sharding.flax_rules(cfg)
    placed = jax.device_put(host, sharding.tree_shardings(abstract_params(cfg.model), mesh, rules))
    engine = Engine(cfg.model, mesh, rules, placed, allowed_tokens(cfg.model.vocab_size, 259, (0, 1)))
    result = engine.generate(PROMPTS, NEW_TOKENS, 2, 0, keep_logits=True)

    sequences = [p + t for p, t in zip(PROMPTS, result.tokens)]
    length = max(map(len, sequences))
    tokens = np.array([s + [0] * (length - len(s)) for s in sequences], np.int32)
    segments = (np.arange(length)[None] < np.array([len(s) for s in sequences])[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
    one = _config("ici_fsdp_parallelism=1", "lora_rank=2", num_devices=1)
    with mesh_context(mesh_for(one), sharding.flax_rules(one)):
        full = np.asarray(jax.jit(Transformer(dataclasses.replace(one.model, remat_policy="none")).apply)(
            {"params": host}, tokens, segments, positions))
    checked = 0
    for b, (prompt, new) in enumerate(zip(PROMPTS, result.tokens)):
        for i in range(len(new)):
            np.testing.assert_allclose(result.step_logits[i][b], full[b, len(prompt) - 1 + i], rtol=0, atol=1e-5)
            checked += 1
    assert checked == len(PROMPTS) * NEW_TOKENS and np.abs(full).max() > 0.1

    # the compiled decode step's cache argument: kv_lora_rank + qk_rope_head_dim values per token and layer
    rows, prompt_length = len(PROMPTS), max(map(len, PROMPTS))
    cache_length = prompt_length + NEW_TOKENS
    assert mla._expanding_is_cheaper(cfg.model, prompt_length, cache_length)
    assert not mla._expanding_is_cheaper(cfg.model, 1, cache_length)
    _, _, decode = engine.compile(rows, prompt_length, cache_length)
    cache_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(decode.in_avals[0][1]))
    m = cfg.model
    assert cache_bytes == m.num_layers * rows * cache_length * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    assert mla.cache_width(m) == 20


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(("name", "extra", "count"), [
    ("deepseek_v3", ("mtp_depth=0", "override_model_config=true"), 671_026_419_200),  # the released "671B main model"
    ("deepseek_v3", (), 682_636_487_424),  # with its one prediction module (its embedding and head shared)
    ("moonlight_16b", (), 15_960_110_208),  # Moonlight-16B-A3B: "16B total"
])
def test_presets_have_the_published_parameter_counts(name: str, extra: tuple[str, ...], count: int) -> None:
    """configs/models/deepseek_v3.yml and moonlight_16b.yml load and hold the published models' parameters (what
    `python -m maxshard.plan ... model_name=NAME` prints)."""
    parsed = config.parse(["configs/base.yml", f"model_name={name}", *extra])
    assert transformer.param_count(loading.model_config(config.finalize(parsed, 1))) == count


@pytest.mark.parametrize("overrides,message", [
    (("attention_type=mla", "qk_rope_head_dim=5"), "qk_rope_head_dim must be even"),
    (("attention_type=mla", "qk_norm=true"), "set qk_norm=false"),
    (("kv_lora_rank=0",), "kv_lora_rank must be >= 1"),
    (("rope_scaling_type=yarn", "yarn_beta_fast=1", "yarn_beta_slow=2"), "0 < slow <= fast"),
])
def test_bad_latent_attention_and_yarn_keys_are_one_config_error(overrides, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(*overrides)
