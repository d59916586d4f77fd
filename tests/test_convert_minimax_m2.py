"""MiniMax-M2 through the Hugging Face converter: logits and greedy tokens equal transformers', a layout of experts,
tensor and FSDP equals one device, the round trip is bit for bit, and the preset is the published shape.

The fixture (tests/fixtures/minimax_m2/minimax_m2, tools/make_minimax_m2_fixtures.py with transformers 5.24) has 2
layers of 8 experts, top-2 by sigmoid scores plus a random selection bias (block_sparse_moe.e_score_correction_bias),
the chosen scores renormalised; q/k norms over all heads (qk_norm_all_heads) and RoPE on half of each head
(partial_rotary_factor 0.5). Every piece is a switch maxshard's model has: the family is one row of
convert/families.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from test_convert import (REPO, TOLERANCE, apply, exports_bit_for_bit, family_fixtures,
                          greedy_tokens_equal_transformers, layout_matches_one_device, logits_match_transformers)

from maxshard import config
from maxshard.convert import hf_config, layout
from maxshard.model import transformer as model
from maxshard.run import loading
from maxshard.spec.model_config import architecture_keys
from maxshard.training.step import Trainer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "minimax_m2"
SOURCE = FIXTURES / "minimax_m2"
EXTRA = ("remat_policy=full",)  # the function is under test, which no remat policy changes


converted, one_device = family_fixtures(SOURCE, *EXTRA)


def reference() -> tuple[np.ndarray, np.ndarray]:
    return np.load(SOURCE / "tokens.npy"), np.load(SOURCE / "logits.npy")


# --------------------------------------------------------------------------------------------- import


def test_logits_match_transformers(one_device):
    logits_match_transformers(one_device, SOURCE)


def test_restores_under_expert_tensor_and_fsdp_with_one_devices_logits(converted, one_device, tmp_path):
    """expert=2 x tensor=2 x fsdp=2: the experts and their selection biases split over expert, the heads (and the
    all-heads q/k norm scales) over tensor; equal to one device within 1e-5 and to transformers within 1e-4."""
    extra = ("ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2")
    layout_matches_one_device(converted, one_device, SOURCE, tmp_path, *extra, *EXTRA)


def _with_norm_scales(params, scale):
    """params with each q/k norm scale [heads, head_dim] replaced by scale(that array)."""
    def swap(path, x):
        return scale(x) if any(n in jax.tree_util.keystr(path) for n in ("query_norm", "key_norm")) else x
    return jax.tree_util.tree_map_with_path(swap, params)


def test_selection_bias_norm_scope_and_partial_rope_are_needed_for_those_logits(one_device):
    """Each MiniMax-M2 piece moves the logits far beyond the tolerance: the selection biases zeroed (other experts
    chosen), RoPE on whole heads, and q/k norms per head instead of over all heads (the same scales: every head's
    row set to the first head's, so only the statistics' scope differs)."""
    trainer, state = one_device
    tokens, want = reference()
    unbiased = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 0 if "router_bias" in jax.tree_util.keystr(path) else x, state.params)
    assert np.max(np.abs(apply(trainer, unbiased, tokens) - want)) > 100 * TOLERANCE
    whole = Trainer(loading.replace(trainer.cfg, partial_rotary_factor=1.0), trainer.mesh)
    assert np.max(np.abs(apply(whole, state.params, tokens) - want)) > 100 * TOLERANCE
    per_head = Trainer(loading.replace(trainer.cfg, qk_norm_all_heads=False), trainer.mesh)
    over_all = apply(trainer, _with_norm_scales(state.params, lambda x: x * 0 + x[..., :1, :]), tokens)
    each = apply(per_head, _with_norm_scales(state.params, lambda x: x[..., 0, :]), tokens)
    assert np.max(np.abs(over_all - each)) > 100 * TOLERANCE


def test_greedy_generation_gives_transformers_tokens(converted, tmp_path):
    """transformers' 16 greedy tokens, each decode step routed as transformers routes it."""
    assert json.loads((SOURCE / "generate.json").read_text())["max_new_tokens"] == 16
    greedy_tokens_equal_transformers(converted, SOURCE, tmp_path, *EXTRA)


def test_keys_and_tensors_are_the_checkpoints():
    """The sigmoid router with its selection bias, the norms over all heads and the half-turned heads are read from
    the checkpoint; the experts are Mixtral's w1/w3/w2 under block_sparse_moe, the bias beside the router."""
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    assert (keys["moe_router"], keys["moe_router_bias"], keys["moe_renormalize_top_k"], keys["num_experts"],
            keys["num_experts_per_tok"], keys["qk_norm_all_heads"], keys["partial_rotary_factor"],
            keys["capacity_factor"]) == ("sigmoid", True, True, 8, 2, True, 0.5, -1.0)
    family = hf_config.family({"architectures": ["MiniMaxM2ForCausalLM"]})
    hf_names = {p.entry.hf for p in layout.params_of(layout.model_config(keys), family)}
    assert {"model.layers.{i}.block_sparse_moe.e_score_correction_bias",
            "model.layers.{i}.block_sparse_moe.gate.weight", "model.layers.{i}.self_attn.q_norm.weight"} <= hf_names


def test_the_released_rotary_dim_reads_as_its_share_of_the_head():
    """MiniMax-M2's released config.json gives RoPE's share as rotary_dim (features), not partial_rotary_factor;
    transformers reads it as rotary_dim / head_dim, and so does maxshard."""
    source = hf_config.read(str(SOURCE))
    released = {**source, "rope_parameters": {k: v for k, v in source["rope_parameters"].items()
                                              if k != "partial_rotary_factor"}, "rotary_dim": 4}
    assert hf_config.model_keys(released) == hf_config.model_keys(source)


# --------------------------------------------------------------------------------------------- export


def test_round_trip_is_bit_identical(converted, tmp_path):
    exported, original = exports_bit_for_bit(converted, SOURCE, tmp_path)
    for field in ("architectures", "model_type", "num_local_experts", "tie_word_embeddings"):
        assert exported[field] == original[field], field


def test_export_without_a_template_is_minimax_m2():
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    exported = hf_config.to_hf(keys, "float32")
    assert exported["architectures"] == ["MiniMaxM2ForCausalLM"] and hf_config.model_keys(exported) == keys


# --------------------------------------------------------------------------------------------- preset


def test_preset_is_the_published_shape():
    """configs/models/minimax_m2.yml is the network of MiniMaxM2Config() with the release's rotary_dim 64
    (tests/fixtures/minimax_m2/defaults/), every architecture key alike, ~229B parameters (eval_shape only)."""
    cfg = loading.model_config(config.finalize(config.parse([str(REPO / "configs" / "base.yml"),
                                                             "model_name=minimax_m2"]), 1))
    released = {**json.loads((FIXTURES / "defaults" / "minimax_m2.json").read_text()),
                "architectures": ["MiniMaxM2ForCausalLM"], "rotary_dim": 64}
    want = layout.model_config(hf_config.model_keys(released))
    for key in architecture_keys():
        if key != "max_target_length":  # the context trained at is the run's choice
            assert getattr(cfg, key) == getattr(want, key), key
    assert 2.2e11 <= model.param_count(cfg) <= 2.4e11
