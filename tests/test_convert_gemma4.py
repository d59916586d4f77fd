"""Gemma 4 text through the Hugging Face converter: logits and greedy tokens equal transformers', layouts equal one
device, the round trip is bit for bit.

The fixture (tests/fixtures/gemma4/gemma4, tools/make_gemma4_fixtures.py with transformers 5.24) has 8 layers
alternating sliding (window 4) and full attention; per-layer input embeddings of 8 features a layer; the last 4
layers reuse the keys and values of the last earlier layer of their kind, have no K/V projections and an MLP twice
as wide (use_double_wide_mlp); the full layers' heads are 16 wide beside the sliding layers' 8 (global_head_dim,
per_layer_config); q/k norms, a value norm without a scale, softmax scale 1, proportional RoPE in the full layers,
a fixed scalar a layer drawn away from 1, logits soft-capped at 15. The 12 reference tokens cross the window twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_convert import (TOLERANCE, apply, cli, exports_bit_for_bit, family_fixtures,
                          greedy_tokens_equal_transformers, layout_matches_one_device, logits_match_transformers,
                          read_all, start_from_converted, training_keys)

from maxshard.convert import hf_config, layout
from maxshard.errors import ConfigError
from maxshard.run import loading
from maxshard.spec import blocks
from maxshard.training.step import Trainer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gemma4"
SOURCE = FIXTURES / "gemma4"
EXTRA = ("remat_policy=full",)  # the function is under test, which no remat policy changes
# The one-device logits are themselves 2.7e-5 from transformers' float64 ones under the suite's XLA:CPU kernels
# (tests/conftest.py: optimization level 0; 8e-6 at the default level, transformers' float32 6e-6): two float32
# programs summing in other orders differ by as much, so the layout is held to 3e-5 (a sharding mistake moves the
# logits by orders of magnitude more)
LAYOUT_ATOL = 3e-5


converted, one_device = family_fixtures(SOURCE, *EXTRA)


def reference() -> tuple[np.ndarray, np.ndarray]:
    return np.load(SOURCE / "tokens.npy"), np.load(SOURCE / "logits.npy")


# --------------------------------------------------------------------------------------------- import


def test_logits_match_transformers(one_device):
    logits_match_transformers(one_device, SOURCE)


def test_keys_stacks_and_tensors_are_the_checkpoints():
    """The per-layer inputs, KV sharing, value norm, layer scalar and proportional RoPE are read from config.json;
    the decoder is 2 layers of its own, the 2 whose keys and values the last 4 reuse, then those 4, which have no
    K/V tensors."""
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    assert (keys["per_layer_input_dim"], keys["per_layer_vocab_size"], keys["kv_shared_layers"], keys["value_norm"],
            keys["layer_scalar"], keys["rope_proportion"], keys["query_pre_attn_scalar"],
            keys["rope_local_max_timescale"], keys["rope_max_timescale"]) == (8, 128, 4, True, True, 0.5, 1.0,
                                                                             10000.0, 1000000.0)
    cfg = layout.model_config(keys)
    assert [(s.name, len(s.unit), s.repeats, s.gives_kv, s.reuses_kv) for s in blocks.stacks(cfg)] == [
        ("layers", 2, 1, False, False), ("kv_layers", 2, 1, True, False), ("shared_layers", 2, 2, False, True)]
    family = hf_config.family({"architectures": ["Gemma4ForCausalLM"]})
    params = layout.params_of(cfg, family)
    shared = {p.entry.hf for p in params if p.path[1] == "shared_layers"}
    assert "model.layers.{i}.self_attn.q_proj.weight" in shared
    assert not shared & {"model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.v_proj.weight",
                         "model.layers.{i}.self_attn.k_norm.weight"}
    assert {"model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight",
            "model.layers.{i}.per_layer_input_gate.weight", "model.layers.{i}.layer_scalar"} <= {
        p.entry.hf for p in params}


@pytest.mark.parametrize("key,value", [("per_layer_input_dim", 0), ("value_norm", False),
                                       ("layer_scalar", False), ("rope_proportion", 1.0)])
def test_each_gemma4_piece_is_needed_for_those_logits(one_device, key, value):
    """Without the per-layer inputs, the value norm, the layer scalars or proportional RoPE the logits move far
    beyond the tolerance (the parameters a piece adds dropped). KV sharing is the checkpoint's shape: the shared
    layers have no K/V tensors to compute without it."""
    trainer, state = one_device
    tokens, want = reference()
    changed = Trainer(loading.replace(trainer.cfg, **{key: value}), trainer.mesh)
    params = _without(state.params, key)
    assert np.max(np.abs(apply(changed, params, tokens) - want)) > 100 * TOLERANCE


def _without(params, key: str):
    """params without the parameters a piece adds (per-layer inputs, layer scalars); as they are otherwise."""
    from flax import traverse_util

    drop = {"per_layer_input_dim": ("per_layer_embed", "per_layer_input"), "layer_scalar": ("layer_scalar",)}
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: v for k, v in flat.items() if not set(drop.get(key, ())) & set(k)})


def test_greedy_generation_gives_transformers_tokens(converted, tmp_path):
    """transformers' 16 greedy tokens past several window boundaries: the KV-shared layers attend over the cache of
    the layer they reuse (a ring of the window for the sliding ones), with no cache of their own."""
    assert json.loads((SOURCE / "generate.json").read_text())["max_new_tokens"] == 16
    greedy_tokens_equal_transformers(converted, SOURCE, tmp_path, *EXTRA)


def test_restores_under_tensor_and_fsdp_with_one_devices_logits(converted, one_device, tmp_path):
    """tensor=2 x fsdp=4: the heads over tensor, the per-layer table and projection over fsdp and tensor; equal to
    one device within LAYOUT_ATOL and to transformers within 1e-4. Gradients under fsdp x tensor, context and
    sequence: tests/test_kv_sharing.py."""
    layout_matches_one_device(converted, one_device, SOURCE, tmp_path, "ici_tensor_parallelism=2",
                              "ici_fsdp_parallelism=4", *EXTRA, atol=LAYOUT_ATOL)


@pytest.mark.parametrize("field,value,message", [
    ("enable_moe_block", True, "num_experts=null is not supported: enable_moe_block=true needs >= 2 experts"),
    ("per_layer_config", {"0": {"head_dim": 16}}, "per_layer_config.0=.* maxshard's sliding_attention layers share"),
    ("per_layer_config", {"1": {"head_dim": 16}}, "the full_attention layers 2 head shapes"),
    ("per_layer_config", {str(i): {"sliding_window": 2} for i in range(1, 8, 2)}, r"per_layer_config.1=\["),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention=\"all\" is not supported"),
])
def test_what_maxshard_cannot_compute_is_one_line(field, value, message):
    with pytest.raises(ConfigError, match=message):
        hf_config.model_keys({**hf_config.read(str(SOURCE)), field: value})


def test_bidirectional_attention_over_images_only_converts_the_causal_text_model():
    """The multimodal releases' use_bidirectional_attention="vision" lets image tokens see each other; text tokens
    attend causally, so the text model converts as without it ("all" is refused above)."""
    source = hf_config.read(str(SOURCE))
    assert hf_config.model_keys({**source, "use_bidirectional_attention": "vision"}) == hf_config.model_keys(source)


def test_the_last_layer_is_full_attention_whatever_layer_types_says():
    """transformers' Gemma4TextConfig makes the last layer full attention (with a warning) when layer_types or its
    5 : 1 rule says sliding: so does the converter, and the model computes what transformers loads."""
    source = {k: v for k, v in hf_config.read(str(DENSE)).items() if k not in ("layer_types", "per_layer_config")}
    keys = hf_config.model_keys({**source, "num_hidden_layers": 8})  # the rule: 5 sliding, 1 full, 2 sliding
    assert keys["attention_pattern"] == ["local"] * 5 + ["global", "local", "global"]
    listed = hf_config.model_keys({**source, "layer_types": ["full_attention", "sliding_attention"] * 3})
    assert listed["attention_pattern"] == ["global", "local"] * 2 + ["global"]  # period 5: layer 5 is global


def test_the_full_layers_head_shape_comes_from_per_layer_config_or_global_head_dim():
    """The fixture's full layers have heads 16 wide beside the sliding layers' 8 (transformers wrote them as
    per_layer_config): global_head_dim=16. Without per_layer_config transformers gives the full layers
    global_head_dim, 512 when the file has none either; equal to head_dim, no key."""
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    assert (keys["head_dim"], keys["global_head_dim"], keys.get("global_num_kv_heads")) == (8, 16, None)
    assert (keys["mlp_dim"], keys["kv_shared_mlp_dim"]) == (48, 96)  # use_double_wide_mlp
    source = {k: v for k, v in hf_config.read(str(SOURCE)).items() if k != "per_layer_config"}
    assert hf_config.model_keys(source)["global_head_dim"] == 512
    assert hf_config.model_keys({**source, "global_head_dim": 16}) == keys
    assert "global_head_dim" not in hf_config.model_keys({**source, "global_head_dim": 8})


def test_the_multimodal_release_converts_its_language_model(converted, tmp_path, capsys):
    """Gemma4ForConditionalGeneration, as Google publishes Gemma 4 (the language model under
    model.language_model.*, a vision tower and its embedder beside it; tests/fixtures/gemma4/gemma4_mm), around
    gemma4's text model: from_hf converts the language model to gemma4's keys and parameters and says what it left
    out; to_hf writes Gemma4ForCausalLM whose tensors are gemma4's bit for bit."""
    out = tmp_path / "mm"
    assert cli.main(["from_hf", str(FIXTURES / "gemma4_mm"), str(out)]) == 0
    assert "Gemma4ForConditionalGeneration: converting its language model as Gemma4ForCausalLM" in (
        capsys.readouterr().err)
    assert training_keys(out) == training_keys(converted)
    assert cli.main(["to_hf", str(out / "checkpoints" / "0"), str(tmp_path / "hf")]) == 0
    back, text = read_all(tmp_path / "hf"), read_all(SOURCE)
    assert sorted(back) == sorted(text) and all(back[k].tobytes() == v.tobytes() for k, v in text.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Gemma4ForCausalLM"]


# The shape of the releases without per-layer inputs (tests/fixtures/gemma4/gemma4_dense): 5 sliding layers per full
# one by transformers' rule, the full layer's values its key projection (attention_k_eq_v) over one key/value head
# 16 wide, no KV sharing
DENSE = FIXTURES / "gemma4_dense"


def converted_and_started(factory: pytest.TempPathFactory, source: Path) -> tuple[Path, tuple]:
    """(a fixture directory's from_hf output, it started as a one-device run)."""
    out = factory.mktemp(source.name) / source.name
    assert cli.main(["from_hf", str(source), str(out)]) == 0
    return out, start_from_converted(out, factory.mktemp(f"{source.name}_run"), *EXTRA)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, tuple]:
    return converted_and_started(tmp_path_factory, DENSE)


def test_values_from_keys_match_transformers(dense, tmp_path):
    """attention_k_eq_v reads as global_values_from_keys: the full layer has no value projection and takes its
    values from the key projection before its norm and RoPE; its heads 16 wide over one key/value head. Logits
    within 1e-4, 16 greedy tokens as transformers', the round trip bit for bit."""
    converted, one_device = dense
    keys = hf_config.model_keys(hf_config.read(str(DENSE)))
    assert (keys["global_values_from_keys"], keys["global_head_dim"], keys["global_num_kv_heads"]) == (True, 16, 1)
    assert keys["attention_pattern"] == ["local"] * 5 + ["global"] and keys["per_layer_input_dim"] == 0
    attention = one_device[1].params["decoder"]["layers"]["layer_5"]["attention"]
    assert "value" not in attention and attention["key"]["kernel"].shape[-2:] == (1, 16)
    logits_match_transformers(one_device, DENSE)
    (tmp_path / "generate").mkdir()
    greedy_tokens_equal_transformers(converted, DENSE, tmp_path / "generate", *EXTRA)
    exported, original = exports_bit_for_bit(converted, DENSE, tmp_path)
    for field in ("attention_k_eq_v", "per_layer_config", "layer_types", "hidden_size_per_layer_input"):
        assert exported[field] == original[field], field


# gemma4_dense with the MoE block (tests/fixtures/gemma4/gemma4_moe, enable_moe_block): beside every layer's MLP 4
# experts 16 wide, 2 a token; the router's scale about 1, its per-expert scale in 0.5..1.5
MOE = FIXTURES / "gemma4_moe"


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, tuple]:
    return converted_and_started(tmp_path_factory, MOE)


def test_the_moe_block_matches_transformers(moe, tmp_path):
    """enable_moe_block reads as moe_beside_mlp: each layer keeps its dense MLP (intermediate_size) and runs the
    dropless experts (moe_intermediate_size) beside it, with their own norms, the router's norm and scale and the
    per-expert scale. Logits within 1e-4, 16 greedy tokens as transformers', the round trip bit for bit."""
    converted, one_device = moe
    keys = hf_config.model_keys(hf_config.read(str(MOE)))
    assert (keys["moe_beside_mlp"], keys["num_experts"], keys["num_experts_per_tok"], keys["moe_mlp_dim"],
            keys["mlp_dim"], keys["capacity_factor"]) == (True, 4, 2, 16, 48, -1.0)
    layer = one_device[1].params["decoder"]["layers"]["layer_0"]
    assert {"mlp", "moe", "moe_norm", "post_dense_norm", "post_moe_norm"} <= set(layer)
    assert layer["moe"]["wi_0"].shape[-3:] == (4, 32, 16) and layer["moe"]["expert_scale"].shape[-1] == 4
    logits_match_transformers(one_device, MOE)
    (tmp_path / "generate").mkdir()
    greedy_tokens_equal_transformers(converted, MOE, tmp_path / "generate", *EXTRA)
    exported, original = exports_bit_for_bit(converted, MOE, tmp_path)
    for field in ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size", "intermediate_size"):
        assert exported[field] == original[field], field


@pytest.mark.parametrize("param", ["expert_scale", "router_norm"])
def test_each_piece_of_the_router_is_needed_for_those_logits(moe, param):
    """At 1 (the per-expert scale, the router norm's scale) the logits move far beyond the tolerance."""
    from flax import traverse_util

    trainer, state = moe[1]
    tokens, want = np.load(MOE / "tokens.npy"), np.load(MOE / "logits.npy")
    flat = traverse_util.flatten_dict(state.params)
    ones = {k: np.ones_like(v) if param in k else v for k, v in flat.items()}
    assert np.max(np.abs(apply(trainer, traverse_util.unflatten_dict(ones), tokens) - want)) > 100 * TOLERANCE


def test_the_moe_block_restores_under_expert_and_fsdp_with_one_devices_logits(moe, tmp_path):
    """expert=2 x fsdp=4: the experts over expert, the rest over fsdp (the full layer's one key/value head allows
    no tensor parallelism; the block under tensor: tests/test_moe_beside_mlp.py)."""
    converted, one_device = moe
    layout_matches_one_device(converted, one_device, MOE, tmp_path, "ici_expert_parallelism=2",
                              "ici_fsdp_parallelism=4", *EXTRA, atol=LAYOUT_ATOL)


def test_the_moe_block_refuses_what_maxshard_cannot_compute_in_one_line():
    source = hf_config.read(str(MOE))
    with pytest.raises(ConfigError, match="top_k_experts=5 is not supported: needs 1..4"):
        hf_config.model_keys({**source, "top_k_experts": 5})
    keys = hf_config.model_keys(source)
    with pytest.raises(ConfigError, match="num_shared_experts=1 cannot be written as Gemma4ForCausalLM"):
        hf_config.to_hf({**keys, "num_shared_experts": 1}, "float32", template=source)


# --------------------------------------------------------------------------------------------- export


def test_round_trip_is_bit_identical(converted, tmp_path):
    exported, original = exports_bit_for_bit(converted, SOURCE, tmp_path)
    for field in ("architectures", "model_type", "layer_types", "num_kv_shared_layers", "hidden_size_per_layer_input",
                  "vocab_size_per_layer_input", "rope_parameters", "per_layer_config", "use_double_wide_mlp"):
        assert exported[field] == original[field], field


# The releases' config.json text_config fields that differ from Gemma4TextConfig's defaults (google/gemma-4-26B-A4B,
# google/gemma-4-31B), the parameters Google publishes for them, and what of them a token meets (26B-A4B: 3.8B)
_RELEASE = {"final_logit_softcapping": 30.0, "sliding_window": 1024, "hidden_size_per_layer_input": 0,
            "attention_k_eq_v": True, "max_position_embeddings": 262144,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1000000.0}}}
RELEASES = {
    "gemma4_26b_a4b": ({**_RELEASE, "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
                        "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
                        "moe_intermediate_size": 704}, 25.2e9, 3.8e9),
    "gemma4_31b": ({**_RELEASE, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "num_global_key_value_heads": 4},
                   30.7e9, 30.7e9),
}
# The E sizes, with per-layer inputs: what Google publishes is the "effective" count, without the per-layer table;
# E4B's 4.5B is 3% below what its config.json's fields make (4.64B), so it is held to 4%
_SMALL = {**_RELEASE, "sliding_window": 512, "attention_k_eq_v": False, "hidden_size_per_layer_input": 256,
          "max_position_embeddings": 131072}
EFFECTIVE = {
    "gemma4_e2b": ({**_SMALL, "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
                    "num_attention_heads": 8, "num_key_value_heads": 1, "num_kv_shared_layers": 20,
                    "use_double_wide_mlp": True, "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7},
                   2.3e9, 0.01),
    "gemma4_e4b": ({**_SMALL, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "num_kv_shared_layers": 18},
                   4.5e9, 0.04),
}


def _preset_and_release(name: str, fields: dict):
    """(configs/models/<name>.yml's network, the one the converter reads from the release's config.json fields,
    transformers' 5 : 1 rule for the layers where they give no layer_types), every architecture key alike."""
    from maxshard import config
    from maxshard.spec.model_config import architecture_keys
    from test_convert import REPO

    cfg = loading.model_config(config.finalize(config.parse([str(REPO / "configs" / "base.yml"),
                                                             f"model_name={name}"]), 1))
    defaults = {k: v for k, v in json.loads((FIXTURES / "defaults" / "gemma4_text.json").read_text()).items()
                if k not in ("layer_types", "per_layer_config")}  # the default's 30 layers' own; derived again
    want = layout.model_config(hf_config.model_keys({**defaults, **fields, "architectures": ["Gemma4ForCausalLM"]}))
    unread = {"max_target_length"} | ({"per_layer_vocab_size"} if not cfg.per_layer_input_dim else set())
    for key in architecture_keys():
        if key not in unread:  # the context trained at is the run's choice; a table's rows without the table
            assert getattr(cfg, key) == getattr(want, key), key
    return cfg


@pytest.mark.parametrize("name", list(RELEASES))
def test_presets_are_the_released_shapes(name):
    """The preset is the release's network, with the parameters Google publishes, in all and per token
    (eval_shape only)."""
    from maxshard.model import flops, transformer as model

    fields, total, active = RELEASES[name]
    cfg = _preset_and_release(name, fields)
    met = flops.matmul_params(cfg)  # the head is the tied embedding, whose row a token also meets
    assert abs(model.param_count(cfg) - total) < 0.01 * total and abs(met - active) < 0.01 * active


@pytest.mark.parametrize("name", list(EFFECTIVE))
def test_the_e_presets_are_the_released_shapes(name):
    from maxshard.model import transformer as model

    fields, effective, within = EFFECTIVE[name]
    cfg = _preset_and_release(name, fields)
    table = cfg.per_layer_vocab_size * cfg.num_layers * cfg.per_layer_input_dim
    assert abs(model.param_count(cfg) - table - effective) < within * effective


def test_export_without_a_template_is_gemma4():
    keys = hf_config.model_keys(hf_config.read(str(SOURCE)))
    exported = hf_config.to_hf(keys, "float32")
    assert exported["architectures"] == ["Gemma4ForCausalLM"] and hf_config.model_keys(exported) == keys
