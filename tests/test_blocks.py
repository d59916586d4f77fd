"""The model-family seam (maxshard/model/blocks.py): the stacks a family is described by are the stacks the model
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

from maxshard.model import blocks, flops, transformer
from maxshard.model.blocks import Layer, Stack
from maxshard.model.config import ModelConfig
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
    scanned_logits = transformer.Transformer(cfg).apply({"params": nn.unbox(params)}, tokens, ones, positions)
    unrolled_logits = transformer.Transformer(unrolled_cfg).apply({"params": unrolled}, tokens, ones, positions)
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
