"""The model-family seam (maxshard/spec/blocks.py): the stacks a family is described by are the stacks the model
builds, the FLOP inventory counts the kernels those stacks hold, and dense first layers (DeepSeek-V3's
`first_k_dense_replace`) keep the function under a pipeline.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.errors import ConfigError
from maxshard.model import flops, transformer
from maxshard.spec import blocks
from maxshard.spec.blocks import Layer, Stack
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import pipeline
from maxshard.training.step import Trainer
from tests.helpers import max_relative_difference, mesh_for
from tests.test_pipeline import TOLERANCE, loss_and_grads, packed_batch, random_params, small_config

# Every expert meets every token (k = experts), so every kernel the model holds takes part in a token's matmuls.
DENSE_FIRST = dict(vocab_size=32, emb_dim=16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=48,
                   max_target_length=8, num_experts=4, num_experts_per_tok=4, capacity_factor=-1.0,
                   moe_dropless_impl="dense", first_k_dense_replace=1, moe_mlp_dim=24, num_shared_experts=1)


def test_stacks_describe_each_family() -> None:
    llama = ModelConfig(vocab_size=8, num_layers=4)
    assert blocks.stacks(llama) == (Stack("layers", (Layer("gqa", "dense"),), 4),)
    every_other = ModelConfig(vocab_size=8, num_layers=4, num_experts=4, moe_layer_interval=2)
    assert blocks.stacks(every_other) == (Stack("layers", (Layer("gqa", "dense"), Layer("gqa", "moe")), 2),)
    deepseek = ModelConfig(vocab_size=8, num_layers=61, num_experts=256, first_k_dense_replace=3,
                           attention_type="mla")
    assert blocks.stacks(deepseek) == (Stack("dense_layers", (Layer("mla", "dense"),), 3),
                                       Stack("layers", (Layer("mla", "moe"),), 58))
    assert [layer.mlp for layer in blocks.layers(deepseek)] == ["dense"] * 3 + ["moe"] * 58
    assert deepseek.num_units == 58 and deepseek.num_moe_layers == 58


def _kernels(tree: dict) -> int:
    """Elements of every kernel (2-D and up per layer: not the norms' scales or the embedding table)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return sum(math.prod(leaf.shape) for path, leaf in flat
               if "embedding" not in jax.tree_util.keystr(path) and "scale" not in jax.tree_util.keystr(path))


def test_the_model_builds_its_stacks_and_the_flop_inventory_counts_their_kernels() -> None:
    cfg = ModelConfig(**DENSE_FIRST)
    params = nn.unbox(transformer.abstract_params(cfg))
    decoder = params["decoder"]
    assert set(decoder) == {"dense_layers", "layers"}
    assert decoder["dense_layers"]["mlp"]["wi_0"]["kernel"].shape == (1, 16, 48)  # [layers, embed, mlp_dim]
    moe = decoder["layers"]["layer_0"]["moe"]
    assert moe["wi_0"].shape == (2, 4, 16, 24)  # [units, experts, embed, moe_mlp_dim]
    assert moe["shared"]["wi_0"]["kernel"].shape == (2, 16, 24)
    assert flops.matmul_params(cfg) == _kernels(params)


def test_scanned_and_unrolled_stacks_compute_the_same_function() -> None:
    cfg = ModelConfig(**DENSE_FIRST)
    params = transformer.init_params(cfg, jax.random.key(1))
    unrolled_cfg = dataclasses.replace(cfg, scan_layers=False)
    flat = nn.unbox(params)["decoder"]
    unrolled = {**nn.unbox(params), "decoder": {
        **{f"dense_layers_{i}": jax.tree.map(lambda w, i=i: w[i], flat["dense_layers"]) for i in range(1)},
        **{f"layers_{i}": jax.tree.map(lambda w, i=i: w[i], flat["layers"]) for i in range(2)}}}
    tokens = jnp.arange(8, dtype=jnp.int32)[None] % 32
    ones, positions = jnp.ones_like(tokens), jnp.arange(8, dtype=jnp.int32)[None]
    scanned_logits = jax.jit(transformer.Transformer(cfg).apply)({"params": nn.unbox(params)}, tokens, ones, positions)
    unrolled_logits = jax.jit(transformer.Transformer(unrolled_cfg).apply)({"params": unrolled}, tokens, ones,
                                                                            positions)
    np.testing.assert_allclose(scanned_logits, unrolled_logits, rtol=1e-5, atol=1e-5)


DEEPSEEK_LIKE = ("num_experts=4", "num_experts_per_tok=2", "capacity_factor=-1", "first_k_dense_replace=1",
                 "num_layers=5", "moe_mlp_dim=64", "num_shared_experts=1",
                 "load_balance_loss_weight=0")  # its f x P is not linear in the batch: a pipeline's microbatches see
# other shares than the whole batch (tests/test_pipeline.py compares that with gradient accumulation instead)


def test_dense_first_layers_run_before_the_pipeline_with_the_same_loss_and_gradients() -> None:
    """pipeline=2 x fsdp=4 (the MoE stack of 4 units in 2 stages, the dense layer before it) against fsdp=8."""
    reference_cfg = small_config(*DEEPSEEK_LIKE)
    trainer = Trainer(reference_cfg, mesh_for(reference_cfg))
    params, batch = random_params(trainer), packed_batch(reference_cfg, trainer.mesh)
    ref_loss, ref_grads = loss_and_grads(reference_cfg, params, batch)
    cfg = small_config(*DEEPSEEK_LIKE, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
                       "num_layers_per_pipeline_stage=2")
    assert cfg.model.pipeline.units == 4
    loss, grads = loss_and_grads(cfg, pipeline.from_scanned(params, cfg.model.pipeline), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(grads), ref_grads) < TOLERANCE


def test_attention_patterns_make_repeating_units_and_a_last_stack() -> None:
    """Gemma 3 (62 layers, 5 local then 1 global): 10 units of 6 and the 2 local layers left over; GPT-OSS (MoE in
    every layer, local and global alternating): units of 2; a window in every layer (Mistral): one local layer."""
    local, glob = Layer("gqa", "dense", local=True), Layer("gqa", "dense")
    gemma3 = ModelConfig(vocab_size=8, num_layers=62, sliding_window=1024,
                         attention_pattern=("local",) * 5 + ("global",))
    assert blocks.stacks(gemma3) == (Stack("layers", (local,) * 5 + (glob,), 10), Stack("last_layers", (local,) * 2, 1))
    assert gemma3.num_units == 10 and [layer.local for layer in blocks.layers(gemma3)][-3:] == [False, True, True]
    gpt_oss = ModelConfig(vocab_size=8, num_layers=24, num_experts=32, sliding_window=128,
                          attention_pattern=("local", "global"))
    assert blocks.stacks(gpt_oss) == (Stack("layers", (Layer("gqa", "moe", True), Layer("gqa", "moe")), 12),)
    assert gpt_oss.num_units == 12 and gpt_oss.num_moe_layers == 24
    mistral = ModelConfig(vocab_size=8, num_layers=4, sliding_window=4096, attention_pattern=("local",))
    assert blocks.stacks(mistral) == (Stack("layers", (local,), 4),)
    assert not blocks.stacks(dataclasses.replace(gemma3, sliding_window=0))[0].unit[0].local  # no window: global


# Every option of the local/global families at once, at a window (3) shorter than the documents of packed_batch.
LOCAL_GLOBAL = ("num_layers=5", "sliding_window=3", "attention_pattern=local,global", "post_norms=true",
                "norm_unit_offset=true", "mlp_activation=gelu_tanh", "attn_logit_softcapping=2.0",
                "final_logit_softcapping=3.0", "query_pre_attn_scalar=8", "attention_sinks=true",
                "attention_bias=true", "embed_scale=true", "qk_norm=true", "rope_local_max_timescale=100",
                "rope_scaling_type=linear", "rope_scaling_factor=2", "attention=dot_product")


# GPT-OSS's own: sinks and q/k/v/o biases on alternating windows, MoE in every layer with router and expert biases
# and the clamped SwiGLU (a limit low enough to clamp), dropless
GPT_OSS_LIKE = ("num_layers=5", "sliding_window=3", "attention_pattern=local,global", "attention_sinks=true",
                "attention_bias=true", "num_experts=4", "num_experts_per_tok=2", "capacity_factor=-1",
                "moe_mlp_dim=64", "moe_bias=true", "mlp_activation=clamped_swiglu", "swiglu_limit=0.5",
                "load_balance_loss_weight=0", "router_z_loss_weight=0",  # per-microbatch means, as DEEPSEEK_LIKE's
                "attention=dot_product")


@pytest.mark.parametrize("options", [LOCAL_GLOBAL, GPT_OSS_LIKE], ids=["gemma_options", "gpt_oss_moe"])
def test_a_local_global_model_keeps_its_function_under_a_pipeline(options) -> None:
    """pipeline=2 x fsdp=4 (the main stack of 2 [local, global] units in 2 stages, the left-over local layer after
    it on every stage) against fsdp=8: the same loss and gradients, with every Gemma option on, and with GPT-OSS's
    MoE layers."""
    reference_cfg = small_config(*options)
    assert [s.name for s in blocks.stacks(reference_cfg.model)] == ["layers", "last_layers"]
    trainer = Trainer(reference_cfg, mesh_for(reference_cfg))
    params, batch = random_params(trainer), packed_batch(reference_cfg, trainer.mesh)
    ref_loss, ref_grads = loss_and_grads(reference_cfg, params, batch)
    cfg = small_config(*options, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
                       "num_layers_per_pipeline_stage=1")
    loss, grads = loss_and_grads(cfg, pipeline.from_scanned(params, cfg.model.pipeline), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(grads), ref_grads) < TOLERANCE
    assert all(np.all(np.isfinite(g)) and np.any(g) for g in jax.tree.leaves(ref_grads))  # sinks, biases: all trained


def test_a_local_layer_sees_only_its_window_and_a_global_layer_everything() -> None:
    """One layer, window 3: changing token 0 moves the logits at positions 0-2 only; as a global layer, all."""
    cfg = ModelConfig(vocab_size=32, emb_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32,
                      max_target_length=8, sliding_window=3, attention_pattern=("local",), attention_sinks=True)
    params = transformer.init_params(cfg, jax.random.key(0))
    tokens = jnp.arange(8, dtype=jnp.int32)[None] + 1
    changed = tokens.at[0, 0].set(0)
    ones, positions = jnp.ones_like(tokens), jnp.arange(8, dtype=jnp.int32)[None]

    def moved(model_cfg: ModelConfig) -> np.ndarray:
        apply = jax.jit(transformer.Transformer(model_cfg).apply)
        a, b = (apply({"params": nn.unbox(params)}, t, ones, positions) for t in (tokens, changed))
        return np.abs(np.asarray(a - b)).max(axis=-1)[0] > 1e-6

    assert moved(cfg).tolist() == [True] * 3 + [False] * 5
    assert moved(dataclasses.replace(cfg, attention_pattern=("global",), sliding_window=0)).all()


def test_scanned_and_unrolled_pattern_stacks_compute_the_same_function() -> None:
    cfg = ModelConfig(vocab_size=32, emb_dim=16, num_layers=5, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32,
                      max_target_length=8, sliding_window=2, attention_pattern=("local", "global"), post_norms=True)
    params = nn.unbox(transformer.init_params(cfg, jax.random.key(1)))
    flat = params["decoder"]
    unrolled = {**params, "decoder": {
        **{f"layers_{i}": jax.tree.map(lambda w, i=i: w[i], flat["layers"]) for i in range(2)},
        "last_layers_0": jax.tree.map(lambda w: w[0], flat["last_layers"])}}
    tokens = jnp.arange(8, dtype=jnp.int32)[None] % 32
    ones, positions = jnp.ones_like(tokens), jnp.arange(8, dtype=jnp.int32)[None]
    scanned = jax.jit(transformer.Transformer(cfg).apply)({"params": params}, tokens, ones, positions)
    plain = jax.jit(transformer.Transformer(dataclasses.replace(cfg, scan_layers=False)).apply)(
        {"params": unrolled}, tokens, ones, positions)
    np.testing.assert_allclose(scanned, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, key", [
    (("attention_pattern=local,global",), "sliding_window"),
    (("sliding_window=4",), "sliding_window"),
    (("attention_pattern=local,sliding", "sliding_window=4"), "attention_pattern"),
    (("attention_pattern=local", "sliding_window=4", "attention_type=mla"), "attention_pattern"),
    (("attn_logit_softcapping=-1",), "attn_logit_softcapping"),
    (("mlp_activation=clamped_swiglu", "swiglu_limit=0"), "swiglu_limit"),
])
def test_bad_local_global_keys_fail_in_one_line_naming_the_key(overrides: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError, match=key) as err:
        small_config(*overrides)
    assert "\n" not in str(err.value)
