"""Llama 4 text through the Hugging Face converter: logits and greedy tokens equal transformers', layouts equal one
device, the round trip is bit for bit, and the preset is the published shape.

The fixture (tests/fixtures/llama4/llama4, tools/make_llama4_fixtures.py with transformers 5.24) has 4 layers:
RoPE layers (interleaved pairs, Llama 3 scaling) that attend within chunks of 4 tokens and L2-normalise q and k,
alternating with global NoPE layers that scale their queries by a position temperature; every 2nd layer is 4
experts, top-1 by sigmoid score with the score on the expert's input, beside a shared expert, the others a dense
MLP of intermediate_size_mlp. The 12 reference tokens cross two chunk boundaries and the temperature's steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_convert import (REPO, TOLERANCE, apply, cli, exports_bit_for_bit, family_fixtures,
                          greedy_tokens_equal_transformers, layout_matches_one_device, logits_match_transformers,
                          read_all, training_keys)

from maxshard import config
from maxshard.convert import hf_config, layout
from maxshard.errors import ConfigError
from maxshard.model import transformer as model
from maxshard.run import loading
from maxshard.spec.model_config import architecture_keys
from maxshard.training.step import Trainer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llama4"
SOURCE = FIXTURES / "llama4"
EXTRA = ("remat_policy=full",)  # the function is under test, which no remat policy changes


converted, one_device = family_fixtures(SOURCE, *EXTRA)


def reference() -> tuple[np.ndarray, np.ndarray]:
    return np.load(SOURCE / "tokens.npy"), np.load(SOURCE / "logits.npy")


# --------------------------------------------------------------------------------------------- import


def test_logits_match_transformers(one_device):
    logits_match_transformers(one_device, SOURCE)


def test_restores_under_expert_tensor_and_fsdp_with_one_devices_logits(converted, one_device, tmp_path):
    """expert=2 x tensor=2 x fsdp=2: the experts split over expert, the heads over tensor; equal to one device
    within 1e-5 and to transformers within 1e-4. The chunked and NoPE layers' gradients under fsdp x tensor,
    context, sequence and a pipeline: tests/test_attention_chunked.py; through the CLI: tests/test_layouts_cli.py."""
    layout = ("ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2")
    layout_matches_one_device(converted, one_device, SOURCE, tmp_path, *layout, *EXTRA)


@pytest.mark.parametrize("key,value", [("attention_chunk_size", 16), ("nope_temperature_scale", 0.0),
                                       ("qk_l2_norm", False), ("moe_weights_on_input", False)])
def test_each_llama4_piece_is_needed_for_those_logits(one_device, key, value):
    """Chunks longer than the 12 tokens (every layer global), no temperature, no L2 norm, the router weight on the
    expert's output: each moves the logits far beyond the tolerance."""
    trainer, state = one_device
    tokens, want = reference()
    changed = Trainer(loading.replace(trainer.cfg, **{key: value}), trainer.mesh)
    assert np.max(np.abs(apply(changed, state.params, tokens) - want)) > 100 * TOLERANCE


def test_greedy_generation_gives_transformers_tokens(converted, tmp_path):
    """transformers' 16 greedy tokens past four chunk boundaries: each chunked layer's cache is a ring of one chunk
    that a query reads only within its own chunk."""
    assert json.loads((SOURCE / "generate.json").read_text())["max_new_tokens"] == 16
    greedy_tokens_equal_transformers(converted, SOURCE, tmp_path, *EXTRA)


def test_keys_and_tensors_are_the_checkpoints():
    """The chunks, NoPE layers, temperature, L2 norm and the router on the input are read from config.json; the
    experts are stacked under feed_forward.experts beside the router and the shared expert, the dense layers'
    MLP is feed_forward itself."""
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    assert (keys["attention_chunk_size"], keys["rope_layers"], keys["nope_temperature_scale"],
            keys["nope_temperature_floor"], keys["qk_l2_norm"], keys["moe_weights_on_input"], keys["mlp_dim"],
            keys["moe_mlp_dim"], keys["moe_layer_interval"], keys["num_shared_experts"],
            keys["moe_renormalize_top_k"]) == (4, [1, 0, 1, 0], 0.5, 4, True, True, 48, 16, 2, 1, False)
    family = hf_config.family({"architectures": ["Llama4ForCausalLM"]})
    hf_names = {p.entry.hf for p in layout.params_of(layout.model_config(keys), family)}
    assert {"model.layers.{i}.feed_forward.experts.gate_up_proj", "model.layers.{i}.feed_forward.router.weight",
            "model.layers.{i}.feed_forward.shared_expert.gate_proj.weight",
            "model.layers.{i}.feed_forward.gate_proj.weight"} <= hf_names


def test_transformers_rules_fill_what_config_json_omits_and_a_foreign_moe_layers_is_refused():
    """Without no_rope_layers and layer_types, every no_rope_layer_interval-th layer is NoPE and global and the
    others chunked (transformers' rule); an explicit moe_layers other than interleave_moe_layer_step's is one line."""
    source = hf_config.read(str(SOURCE))
    bare = {k: v for k, v in source.items() if k not in ("no_rope_layers", "layer_types", "moe_layers")}
    assert hf_config.model_keys(bare) == hf_config.model_keys(source)
    with pytest.raises(ConfigError, match="moe_layers=.*interleave_moe_layer_step=2"):
        hf_config.model_keys({**source, "moe_layers": [0, 1, 2, 3]})


# --------------------------------------------------------------------------------------------- export


def test_round_trip_is_bit_identical(converted, tmp_path):
    exported, original = exports_bit_for_bit(converted, SOURCE, tmp_path)
    for field in ("architectures", "model_type", "num_local_experts", "layer_types", "no_rope_layers",
                  "attention_chunk_size", "interleave_moe_layer_step", "intermediate_size_mlp"):
        assert exported[field] == original[field], field


def test_export_without_a_template_is_llama4():
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    exported = hf_config.to_hf(keys, "float32")
    assert exported["architectures"] == ["Llama4ForCausalLM"] and hf_config.model_keys(exported) == keys


# --------------------------------------------------------------------------------------------- preset


def test_preset_is_the_published_shape():
    """configs/models/llama4_scout.yml is the network of Llama4TextConfig() (tests/fixtures/llama4/defaults/),
    every architecture key alike, ~108B parameters (eval_shape only)."""
    cfg = loading.model_config(config.finalize(config.parse([str(REPO / "configs" / "base.yml"),
                                                             "model_name=llama4_scout"]), 1))
    released = {**json.loads((FIXTURES / "defaults" / "llama4_text.json").read_text()),
                "architectures": ["Llama4ForCausalLM"]}
    want = layout.model_config(hf_config.model_keys(released))
    for key in architecture_keys():
        if key != "max_target_length":  # the context trained at is the run's choice
            assert getattr(cfg, key) == getattr(want, key), key
    assert 1.0e11 <= model.param_count(cfg) <= 1.2e11


def test_the_multimodal_release_converts_its_language_model(converted, tmp_path, capsys):
    """Llama4ForConditionalGeneration, as Meta publishes Llama 4 (the language model under language_model.*, a
    vision model and projector beside it), around llama4's text model: from_hf converts the language model to
    llama4's keys and parameters and says what it left out; to_hf writes Llama4ForCausalLM whose tensors are
    llama4's bit for bit."""
    out = tmp_path / "mm"
    assert cli.main(["from_hf", str(FIXTURES / "llama4_mm"), str(out)]) == 0
    assert "Llama4ForConditionalGeneration: converting its language model as Llama4ForCausalLM" in capsys.readouterr().err
    assert training_keys(out) == training_keys(converted)
    assert cli.main(["to_hf", str(out / "checkpoints" / "0"), str(tmp_path / "hf")]) == 0
    back, text = read_all(tmp_path / "hf"), read_all(SOURCE)
    assert sorted(back) == sorted(text) and all(back[k].tobytes() == v.tobytes() for k, v in text.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Llama4ForCausalLM"]


def test_llama3_scaling_with_equal_factors_is_transformers_step():
    """Llama 4 Scout's release scales RoPE with low_freq_factor equal to high_freq_factor: no blended band, the
    frequencies beyond the original context divided by the factor (transformers warns and computes them so). The
    keys convert, the run config takes them, and the frequencies are transformers' (tests/fixtures/llama4/
    rope_step.json) within float32 rounding."""
    from maxshard.model.layers import rope

    step = json.loads((FIXTURES / "rope_step.json").read_text())
    keys = hf_config.model_keys({**hf_config.read(str(SOURCE)), "head_dim": step["head_dim"],
                                 "rope_parameters": step["rope_parameters"]})
    assert keys["rope_low_freq_factor"] == keys["rope_high_freq_factor"] == 1.0
    cfg = layout.model_config(keys)
    want = np.asarray(step["inv_freq"])
    np.testing.assert_allclose(rope.frequencies_for(cfg), want, rtol=1e-6)
    assert np.sum(rope.frequencies_for(cfg) < rope.inverse_frequencies(128, 500000.0) * 0.5) > 0  # some divided
    run = config.finalize(config.parse([str(REPO / "configs" / "base.yml"), "model_name=llama4_scout",
                                        "rope_scaling_type=llama3", "rope_scaling_factor=16",
                                        "rope_high_freq_factor=1", "override_model_config=true"]), 1)
    assert run.rope_high_freq_factor == run.rope_low_freq_factor
