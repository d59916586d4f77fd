"""Model structure: FLOP and parameter counts by hand, scan == unrolled, every remat policy == no remat."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from maxshard import data
from maxshard.model import flops as model_flops
from maxshard.spec import remat
from maxshard.model import transformer as model
from maxshard.run import loading
from maxshard.training.step import Trainer
from tests.helpers import loss_and_grads, max_relative_difference, mesh_for, tiny_config


def test_flops_per_token_by_hand():
    cfg = tiny_config("emb_dim=64", "num_heads=4", "num_kv_heads=2", "head_dim=16", "mlp_dim=128", "num_layers=2")
    assert cfg.vocab_size == 384 and cfg.max_target_length == 32
    attention_kernels = 64 * 4 * 16 + 64 * 2 * 16 + 64 * 2 * 16 + 4 * 16 * 64  # q, k, v, out = 12288
    mlp_kernels = 3 * 64 * 128  # wi_0, wi_1, wo = 24576
    head = 64 * 384  # 24576
    matmul = 2 * (attention_kernels + mlp_kernels) + head  # 98304
    attention = 6 * 2 * 32 * 4 * 16 / 2 * 2  # 3 (fwd+bwd) x 2 matmuls x 2 FLOP x L x H x D / 2 (causal), per layer
    assert model_flops.flops_per_token(cfg.model) == 6 * matmul + attention == 614400


def test_matmul_params_are_the_kernels_of_the_real_model():
    """The hand formula agrees with the parameter tree: everything but the embedding table and norm scales."""
    cfg = tiny_config("num_kv_heads=2")
    embedding = cfg.vocab_size * cfg.emb_dim
    norms = (2 * cfg.num_layers + 1) * cfg.emb_dim
    assert model.param_count(cfg.model) == model_flops.matmul_params(cfg.model) + embedding + norms
    tied = dataclasses.replace(cfg.model, logits_via_embedding=True)
    assert model.param_count(tied) == model.param_count(cfg.model) - cfg.emb_dim * cfg.vocab_size


def _loss_and_grads(cfg, params, batch):
    return loss_and_grads(Trainer(cfg, mesh_for(cfg)), params, batch)


@pytest.fixture(scope="module")
def scanned():
    cfg = tiny_config("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "remat_policy=none")
    trainer = Trainer(cfg, mesh_for(cfg))
    params = jax.device_get(trainer.init_state().params)
    batch = jax.device_get(next(data.make_input(cfg, trainer.mesh)))
    loss, grads = _loss_and_grads(cfg, params, batch)
    return cfg, params, batch, loss, grads


def _unstack(tree, num_layers):
    """Scanned params {layers: [n, ...]} -> unrolled {layers_0: ..., layers_1: ...}."""
    decoder = {f"layers_{i}": jax.tree.map(lambda x: x[i], tree["decoder"]["layers"]) for i in range(num_layers)}
    return {**tree, "decoder": decoder}


def test_unrolled_layers_equal_scanned(scanned):
    cfg, params, batch, loss, grads = scanned
    unrolled_cfg = loading.replace(cfg, scan_layers=False)
    unrolled_params = _unstack(params, cfg.num_layers)
    unrolled_loss, unrolled_grads = _loss_and_grads(unrolled_cfg, unrolled_params, batch)
    np.testing.assert_allclose(unrolled_loss, loss, rtol=1e-6)
    assert max_relative_difference(unrolled_grads, _unstack(grads, cfg.num_layers)) < 1e-5


@pytest.mark.parametrize("policy", [p for p in remat.NAMES if p != "none"])
def test_remat_policy_changes_nothing_numerically(scanned, policy):
    """Every policy of maxshard/spec/remat.py, the offload ones included (they compile and run on XLA:CPU, which keeps
    the offloaded values where they are)."""
    cfg, params, batch, loss, grads = scanned
    remat_loss, remat_grads = _loss_and_grads(loading.replace(cfg, remat_policy=policy), params, batch)
    np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
    assert max_relative_difference(remat_grads, grads) < 1e-5
