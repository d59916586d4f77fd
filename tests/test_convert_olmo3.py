"""OLMo 3 through the Hugging Face converter: logits and greedy tokens equal transformers', the round trip is bit for
bit, and what maxshard cannot compute or write is refused in one line.

The fixture (tests/fixtures/olmo3/olmo3, tools/make_olmo3_fixtures.py with transformers 5.24) has 4 layers, 3
sliding-window layers (window 4, shorter than the 12-token text and than prompt + generation) then a full one, norms
after attention and the MLP only (pre_norms false), q/k norms over all heads (qk_norm_all_heads), and RoPE per layer
type: YaRN on the full layer, a base of its own, unscaled, on the sliding ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_convert import (LAYOUTS, REPO, TOLERANCE, apply, exports_bit_for_bit, family_fixtures,
                          greedy_tokens_equal_transformers, layout_matches_one_device, logits_match_transformers)

from maxshard import config
from maxshard.convert import __main__ as cli
from maxshard.convert import hf_config, layout, names
from maxshard.errors import ConfigError
from maxshard.model import transformer as model
from maxshard.run import loading
from maxshard.spec.model_config import architecture_keys
from maxshard.training.step import Trainer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "olmo3"
SOURCE = FIXTURES / "olmo3"
EXTRA = ("remat_policy=full",)  # the function is under test, which no remat policy changes


converted, one_device = family_fixtures(SOURCE, *EXTRA)


def reference() -> tuple[np.ndarray, np.ndarray]:
    return np.load(SOURCE / "tokens.npy"), np.load(SOURCE / "logits.npy")


# --------------------------------------------------------------------------------------------- import


def test_logits_match_transformers(one_device):
    logits_match_transformers(one_device, SOURCE)


def test_restores_under_fsdp_and_tensor_with_one_devices_logits(converted, one_device, tmp_path):
    """fsdp=4 x tensor=2: the heads (and the all-heads q/k norm scales [heads, head_dim]) split over tensor, the
    norm's statistics summed across them; equal to one device within 1e-5 and to transformers within 1e-4."""
    extra, _ = LAYOUTS["fsdp4xtensor2"]
    layout_matches_one_device(converted, one_device, SOURCE, tmp_path, *extra, *EXTRA)


def test_window_norm_scope_and_local_rope_are_needed_for_those_logits(one_device):
    """Each OLMo 3 option the fixture uses moves its logits far beyond the tolerance: no window, the sliding
    layers on the full layer's (scaled) RoPE, and q/k norms per head (the same scales, read per head)."""
    trainer, state = one_device
    tokens, want = reference()
    for change in ({"sliding_window": 64}, {"rope_local_max_timescale": 0.0}):
        other = Trainer(loading.replace(trainer.cfg, **change), trainer.mesh)
        assert np.max(np.abs(apply(other, state.params, tokens) - want)) > 100 * TOLERANCE, change


def test_greedy_generation_past_the_window_gives_transformers_tokens(converted, tmp_path):
    """transformers' 16 greedy tokens, the KV cache masking what the sliding layers no longer see."""
    want = json.loads((SOURCE / "generate.json").read_text())
    assert len(want["input_ids"]) + want["max_new_tokens"] > 2 * 4 and want["max_new_tokens"] == 16
    greedy_tokens_equal_transformers(converted, SOURCE, tmp_path, *EXTRA)


def test_keys_and_tensors_are_the_checkpoints():
    """layer_types become a pattern of 3 local and 1 global layers; the per-type RoPE the global and local keys;
    the layers keep no norm before attention or the MLP, and q_norm [heads x head_dim] is one scale [heads,
    head_dim]."""
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    assert (keys["attention_pattern"], keys["sliding_window"], keys["pre_norms"], keys["post_norms"],
            keys["qk_norm"], keys["qk_norm_all_heads"]) == (["local"] * 3 + ["global"], 4, False, True, True, True)
    assert (keys["rope_max_timescale"], keys["rope_scaling_type"], keys["rope_scaling_factor"],
            keys["rope_original_max_position"], keys["rope_local_max_timescale"]) == (1000.0, "yarn", 4.0, 64, 50.0)
    family = hf_config.family({"architectures": ["Olmo3ForCausalLM"]})
    params = {p.path: p for p in layout.params_of(layout.model_config(keys), family)}
    layer = ("decoder", "layers", "layer_0")
    assert not any(path[:3] == layer and path[3] in ("attention_norm", "mlp_norm") for path in params)
    q_norm = params[(*layer, "attention", "query_norm", "scale")]
    assert q_norm.entry.hf == "model.layers.{i}.self_attn.q_norm.weight" and q_norm.layer_shape == (4, 8)
    assert names.hf_shape(q_norm.entry, q_norm.layer_shape) == (32,)
    k_norm = params[(*layer, "attention", "key_norm", "scale")]
    assert names.hf_shape(k_norm.entry, k_norm.layer_shape) == (16,)
    post = params[(*layer, "post_attention_norm", "scale")]
    assert post.entry.hf == "model.layers.{i}.post_attention_layernorm.weight"


def test_both_rope_spellings_and_export_without_a_template():
    """transformers 5.24 reads a 4.x OLMo 3 config's rope_theta and rope_scaling for the full layers only (its
    sliding layers get Olmo3Config's default_theta, 500000), and maxshard reads it so; to_hf without a template
    picks OLMo 3 by the keys and writes rope_parameters per layer type, which reads back as the same keys."""
    source = hf_config.read(str(SOURCE))
    full = source["rope_parameters"]["full_attention"]
    older = {k: v for k, v in source.items() if k != "rope_parameters"}
    older |= {"rope_theta": full["rope_theta"], "rope_scaling": {k: v for k, v in full.items() if k != "rope_theta"}}
    assert hf_config.model_keys(older) == {**hf_config.model_keys(source), "rope_local_max_timescale": 500000.0}
    keys = hf_config.model_keys(source)
    exported = hf_config.to_hf(keys, "float32")
    assert exported["architectures"] == ["Olmo3ForCausalLM"] and hf_config.model_keys(exported) == keys
    assert "rope_theta" not in exported and "rope_scaling" not in exported
    assert exported["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 50.0}
    assert exported["layer_types"] == source["layer_types"]


# --------------------------------------------------------------------------------------------- export


def test_round_trip_is_bit_identical(converted, tmp_path):
    exported, original = exports_bit_for_bit(converted, SOURCE, tmp_path)
    for field in ("architectures", "model_type", "layer_types", "sliding_window", "tie_word_embeddings"):
        assert exported[field] == original[field], field
    local = "sliding_attention"  # the full layers' YaRN is written with its constants spelled out
    assert exported["rope_parameters"][local] == original["rope_parameters"][local]


def test_other_families_refuse_olmo3_keys():
    """Model keys OLMo 3's config.json can express but Llama's and Gemma's cannot are one line each."""
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    for template, key in (("LlamaForCausalLM", "qk_norm"), ("Gemma3ForCausalLM", "norm_unit_offset")):
        with pytest.raises(ConfigError, match=f"cannot be written as {template}"):
            hf_config.to_hf(keys, "float32", {"architectures": [template]})
    gemma = {**keys, "pre_norms": True, "qk_norm_all_heads": False, "norm_unit_offset": True, "embed_scale": True,
             "mlp_activation": "gelu_tanh"}
    with pytest.raises(ConfigError, match="pre_norms=False cannot be written as Gemma3ForCausalLM"):
        hf_config.to_hf({**gemma, "pre_norms": False}, "float32", {"architectures": ["Gemma3ForCausalLM"]})


def test_norm_options_out_of_range_are_one_line(tmp_path):
    base = str(REPO / "configs" / "base.yml")
    for change, says in ((("pre_norms=false",), "pre_norms=false"),
                         (("qk_norm_all_heads=true",), "qk_norm_all_heads")):
        with pytest.raises(ConfigError, match=says):
            config.finalize(config.parse([base, "model_name=tiny", *change]), 1)


def test_a_changed_config_field_is_one_line(tmp_path, capsys):
    directory = tmp_path / "olmo3"
    shutil.copytree(SOURCE, directory)
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "layer_types": ["chunked_attention"] * 4}))
    assert cli.main(["from_hf", str(directory), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("maxshard: error: config.json: layer_types=") and err.count("\n") == 1, err


# --------------------------------------------------------------------------------------------- preset


def test_preset_is_transformers_config_at_its_defaults():
    """configs/models/olmo3_7b.yml is the network of Olmo3Config() (its docstring's OLMo 3 7B style configuration,
    tests/fixtures/olmo3/defaults/), every architecture key alike, ~6.9B parameters (eval_shape only)."""
    cfg = loading.model_config(config.finalize(config.parse([str(REPO / "configs" / "base.yml"),
                                                             "model_name=olmo3_7b"]), 1))
    want = layout.model_config(hf_config.model_keys(json.loads((FIXTURES / "defaults" / "olmo3.json").read_text())))
    for key in architecture_keys():
        assert getattr(cfg, key) == getattr(want, key), key
    assert 6.5e9 <= model.param_count(cfg) <= 7.5e9
