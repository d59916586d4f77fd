"""The per-layer seam's proof: a token-mixer kind that exists only in this file (a module with its own parameters and
one registry row) trains through a run's config and Trainer and is counted by the FLOP inventory, with no other file of
the project changed for it. What a new kind costs is what this file holds: `CausalConv` and `ROW`.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from maxshard import data
from maxshard.model import flops, transformer
from maxshard.model.layers.linears import DenseGeneral
from maxshard.parallel import axis_names as ax
from maxshard.spec import blocks, mixer_kinds
from maxshard.spec.blocks import Layer, Stack
from maxshard.spec.model_config import ModelConfig
from maxshard.training.step import Trainer
from tests.helpers import mesh_for, tiny_config

KERNEL = 3  # the convolution's width: a token sees itself and the 2 before it in its document


class CausalConv(nn.Module):
    """A depthwise causal convolution over embed within each document, then a projection: y_t = W (sum_j c_j *
    x_{t-j}), the terms j whose token is in another document (segment_ids) left out."""

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        length = x.shape[1]
        init = nn.with_logical_partitioning(nn.initializers.normal(0.5), (None, ax.EMBED))
        taps = jnp.asarray(self.param("taps", init, (KERNEL, x.shape[-1]), self.weight_dtype), self.dtype)
        mixed = jnp.zeros_like(x)
        for j in range(KERNEL):
            shifted = jnp.pad(x, ((0, 0), (j, 0), (0, 0)))[:, :length]
            same = jnp.pad(segment_ids, ((0, 0), (j, 0)), constant_values=-1)[:, :length] == segment_ids
            mixed = mixed + taps[j] * jnp.where(same[..., None], shifted, 0)
        out = DenseGeneral((x.shape[-1],), (ax.MLP, ax.EMBED), 1, self.dtype, self.weight_dtype, name="out")
        return checkpoint_name(out(mixed), "out_proj")


ROW = mixer_kinds.Mixer(
    "causal_conv", f"{__name__}:CausalConv", "conv_mixer", "recurrent",
    params=lambda cfg: {"qkv": 0, "out": cfg.emb_dim * cfg.emb_dim},
    flops=lambda cfg, window: 2 * KERNEL * cfg.emb_dim,
    summary="a test's toy: depthwise causal convolution and a projection", remat_names=("out_proj",))
TYPES = "layer_types=causal_conv,full_attention,causal_conv,full_attention"


@pytest.fixture(scope="module", autouse=True)
def registered():
    mixer_kinds.register(ROW)
    yield
    mixer_kinds.unregister(ROW.name)


def test_the_toy_kind_builds_its_stacks_and_the_flop_inventory_counts_it() -> None:
    """2 units of [causal_conv, attention]; its parameters under its scope; matmul parameters are the kernels the
    model holds; the non-matmul FLOPs are attention's plus 2 x kernel x embed for each toy layer."""
    cfg = tiny_config("num_layers=4", TYPES).model
    toy, full = Layer("causal_conv", "dense"), Layer("gqa", "dense")
    assert blocks.stacks(cfg) == (Stack("layers", (toy, full), 2),)
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(transformer.abstract_params(cfg)))[0]
    paths = {jax.tree_util.keystr(p): leaf.shape for p, leaf in flat}
    assert paths["['decoder']['layers']['layer_0']['conv_mixer']['taps']"] == (2, KERNEL, cfg.emb_dim)
    assert not any("layer_0']['attention'" in p for p in paths)
    kernels = sum(math.prod(s) for p, s in paths.items() if not any(n in p for n in ("embedding", "scale", "taps")))
    assert flops.matmul_params(cfg) == kernels
    attention = mixer_kinds.kind("gqa").flops(cfg, 0)
    assert flops.attention_flops(cfg) == round(2 * attention + 2 * 2 * KERNEL * cfg.emb_dim)


def test_the_toy_kind_trains_a_step_under_fsdp_and_tensor() -> None:
    """A run's config (the checks admit the registered spelling), its Trainer on fsdp=4 x tensor=2, init and one
    train step: the loss is finite and the step moves the toy's own parameters."""
    cfg = tiny_config("num_layers=2", "layer_types=causal_conv,full_attention", "ici_fsdp_parallelism=4",
                      "ici_tensor_parallelism=2", global_batch=8)
    trainer = Trainer(cfg, mesh_for(cfg))
    state = trainer.init_state()
    before = jax.device_get(nn.unbox(state.params))["decoder"]["layers"]["layer_0"]["conv_mixer"]
    state, metrics = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))(state, next(data.make_input(
        cfg, trainer.mesh)))
    after = jax.device_get(nn.unbox(state.params))["decoder"]["layers"]["layer_0"]["conv_mixer"]
    assert np.isfinite(float(metrics["loss"]))
    for name in ("taps", "out"):
        assert not np.allclose(jax.tree.leaves(after[name]), jax.tree.leaves(before[name])), name
