"""GLM-4.5 through the Hugging Face converter: logits and greedy tokens equal transformers', a layout of experts,
tensor and FSDP equals one device, the round trip is bit for bit, and the preset is the published shape.

The fixture (tests/fixtures/glm4_moe/glm4_moe, tools/make_glm4_moe_fixtures.py with transformers 5.24) has one dense
layer then two MoE layers of 8 experts in 2 groups (the best group kept), top-2 by sigmoid scores plus a random
selection bias, renormalised and scaled by 2.5, beside a shared expert; biases on q, k and v but not the output
(`qkv_bias`), RoPE on half of each head. Its config.json names a multi-token prediction layer that transformers
neither builds nor saves, so it converts without one. Every piece but `qkv_bias` is a switch the model had: the
family is one row of convert/families.py. The optional q/k norms (use_qk_norm) are checked on a second fixture,
glm4_moe_qk_norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from test_convert import (REPO, TOLERANCE, apply, exports_bit_for_bit, family_fixtures,
                          greedy_tokens_equal_transformers, layout_matches_one_device, logits_match_transformers,
                          read_all, start_from_converted)

from maxshard import config
from maxshard.convert import __main__ as cli
from maxshard.convert import hf_config, layout
from maxshard.errors import ConfigError
from maxshard.model import transformer as model
from maxshard.run import loading
from maxshard.spec.model_config import architecture_keys

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "glm4_moe"
SOURCE = FIXTURES / "glm4_moe"
EXTRA = ("remat_policy=full",)  # the function is under test, which no remat policy changes


converted, one_device = family_fixtures(SOURCE, *EXTRA)


def reference() -> tuple[np.ndarray, np.ndarray]:
    return np.load(SOURCE / "tokens.npy"), np.load(SOURCE / "logits.npy")


def _zeroed(params, leaf: str):
    return jax.tree_util.tree_map_with_path(lambda p, x: x * 0 if leaf in jax.tree_util.keystr(p) else x, params)


# --------------------------------------------------------------------------------------------- import


def test_logits_match_transformers(one_device):
    logits_match_transformers(one_device, SOURCE)


def test_restores_under_expert_tensor_and_fsdp_with_one_devices_logits(converted, one_device, tmp_path):
    """expert=2 x tensor=2 x fsdp=2: the experts and their selection biases split over expert, the heads and their
    q/k/v biases over tensor; equal to one device within 1e-5 and to transformers within 1e-4."""
    extra = ("ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2")
    layout_matches_one_device(converted, one_device, SOURCE, tmp_path, *extra, *EXTRA)


def test_the_qkv_biases_and_the_selection_bias_are_needed_for_those_logits(one_device):
    """Zeroing the q/k/v biases, or the selection biases (other experts chosen), moves the logits far beyond the
    tolerance; the output projection has no bias to zero."""
    trainer, state = one_device
    tokens, want = reference()
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
    assert any("'query'" in p and "'bias'" in p for p in paths)
    assert not any("'out'" in p and "'bias'" in p for p in paths)
    for leaf in ("'bias'", "router_bias"):
        assert np.max(np.abs(apply(trainer, _zeroed(state.params, leaf), tokens) - want)) > 100 * TOLERANCE, leaf


def test_greedy_generation_gives_transformers_tokens(converted, tmp_path):
    """transformers' 16 greedy tokens, each decode step routed as transformers routes it."""
    assert json.loads((SOURCE / "generate.json").read_text())["max_new_tokens"] == 16
    greedy_tokens_equal_transformers(converted, SOURCE, tmp_path, *EXTRA)


def test_keys_and_tensors_are_the_checkpoints():
    """DeepSeek-V3's routing keys and names, q/k/v biases without an output bias, half-turned heads."""
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    assert (keys["moe_router"], keys["moe_router_bias"], keys["moe_n_group"], keys["moe_topk_group"],
            keys["moe_routed_scaling_factor"], keys["first_k_dense_replace"], keys["num_shared_experts"],
            keys["qkv_bias"], keys["partial_rotary_factor"]) == ("sigmoid", True, 2, 1, 2.5, 1, 1, True, 0.5)
    family = hf_config.family({"architectures": ["Glm4MoeForCausalLM"]})
    hf_names = {p.entry.hf for p in layout.params_of(layout.model_config(keys), family)}
    assert {"model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.v_proj.bias",
            "model.layers.{i}.mlp.gate.e_score_correction_bias",
            "model.layers.{i}.mlp.shared_experts.gate_proj.weight"} <= hf_names
    assert "model.layers.{i}.self_attn.o_proj.bias" not in hf_names


def test_the_optional_q_k_norms_convert_to_transformers_logits_and_back(tmp_path):
    """use_qk_norm (off in the releases): an RMSNorm over head_dim on each q and k head before RoPE, maxshard's
    qk_norm with the per-head scales self_attn.q_norm / k_norm; the glm4_moe_qk_norm fixture's logits within 1e-4
    and its tensors back bit for bit, config.json's use_qk_norm with them."""
    source = FIXTURES / "glm4_moe_qk_norm"
    out = tmp_path / "converted"
    assert cli.main(["from_hf", str(source), str(out)]) == 0
    assert hf_config.model_keys(hf_config.read(str(source)))["qk_norm"] is True
    tokens, want = np.load(source / "tokens.npy"), np.load(source / "logits.npy")
    trainer, state = start_from_converted(out, tmp_path / "run", *EXTRA)
    np.testing.assert_allclose(apply(trainer, state.params, tokens), want, rtol=0, atol=TOLERANCE)
    assert cli.main(["to_hf", str(out / "checkpoints" / "0"), str(tmp_path / "hf")]) == 0
    back, original = read_all(tmp_path / "hf"), read_all(source)
    assert sorted(back) == sorted(original) and all(back[k].tobytes() == v.tobytes() for k, v in original.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["use_qk_norm"] is True


def test_qkv_bias_beside_attention_bias_is_one_line():
    base = str(REPO / "configs" / "base.yml")
    with pytest.raises(ConfigError, match="qkv_bias: attention_bias already biases"):
        config.finalize(config.parse([base, "model_name=tiny", "qkv_bias=true", "attention_bias=true"]), 1)
    with pytest.raises(ConfigError, match="attention_type=mla has none"):
        config.finalize(config.parse([base, "model_name=tiny", "qkv_bias=true", "attention_type=mla"]), 1)


# --------------------------------------------------------------------------------------------- export


def test_round_trip_is_bit_identical(converted, tmp_path):
    """The template's multi-token prediction layer count is kept, as the source names one it does not hold."""
    exported, original = exports_bit_for_bit(converted, SOURCE, tmp_path)
    for field in ("architectures", "model_type", "n_routed_experts", "attention_bias", "first_k_dense_replace",
                  "num_nextn_predict_layers"):
        assert exported[field] == original[field], field


def test_export_without_a_template_is_glm4_moe():
    keys = {**hf_config.model_keys(hf_config.read(str(SOURCE))), "mtp_depth": 0}
    exported = hf_config.to_hf(keys, "float32")
    assert exported["architectures"] == ["Glm4MoeForCausalLM"] and hf_config.model_keys(exported) == keys


# --------------------------------------------------------------------------------------------- preset


def test_preset_is_the_published_shape():
    """configs/models/glm4_5_air.yml is the network of Glm4MoeConfig() (tests/fixtures/glm4_moe/defaults/) with
    the GLM-4.5-Air release's head_dim 128, attention_bias and RoPE base, every architecture key alike but the
    multi-token prediction layer (left to the run), ~106B parameters (eval_shape only)."""
    cfg = loading.model_config(config.finalize(config.parse([str(REPO / "configs" / "base.yml"),
                                                             "model_name=glm4_5_air"]), 1))
    released = {**json.loads((FIXTURES / "defaults" / "glm4_moe.json").read_text()),
                "architectures": ["Glm4MoeForCausalLM"], "head_dim": 128, "attention_bias": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}}
    want = layout.model_config(hf_config.model_keys(released))
    for key in architecture_keys():
        if key not in ("max_target_length", "mtp_depth"):
            assert getattr(cfg, key) == getattr(want, key), key
    assert 1.0e11 <= model.param_count(cfg) <= 1.12e11
