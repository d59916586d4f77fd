"""Qwen3-Next and Qwen3.5 (dense, MoE, multimodal) through the Hugging Face converter: logits and greedy tokens equal
transformers', the round trip is bit for bit, and what maxshard cannot compute is refused in one line.

The fixtures (tests/fixtures/qwen3_next/, tools/make_qwen3_next_fixtures.py with transformers 5.24) are 4-layer
hybrids, 3 gated DeltaNet layers then 1 gated full-attention layer (layer_types), partial rotary 0.25, (1 + w)
norms; the MoE ones route top-2 of 4 with a sigmoid-gated shared expert twice an expert's width. Logits are taken
with delta_chunk_size 4, so the 12-token text crosses chunk boundaries (transformers' chunks are 64 wide). Also: the
presets against transformers' config defaults, LoRA exports of the tensors DeltaNet's kernels are cut from, and
Qwen3-Next's multi-token prediction module both ways.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_convert import LAYOUTS, REPO, TOLERANCE, apply, read_all, start_from_converted
from test_lora import _RandomAdapters

from maxshard import config, generate
from maxshard.convert import __main__ as cli
from maxshard.convert import hf_config, layout, names
from maxshard.convert import lora as convert_lora
from maxshard.convert import to_hf as to_hf_module
from maxshard.errors import ConfigError
from maxshard.model import transformer as model
from maxshard.run import loading
from maxshard.spec.model_config import architecture_keys

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "qwen3_next"
NAMES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# remat_policy=auto plans every policy (planning/fit.py); these tests check the function, which no policy changes
EXTRA = ("remat_policy=full", "delta_chunk_size=4")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    for name in (*NAMES, "qwen3_5_mm"):
        assert cli.main(["from_hf", str(FIXTURES / name), str(root / name)]) == 0
    return {name: root / name for name in (*NAMES, "qwen3_5_mm")}


def reference(name: str) -> tuple[np.ndarray, np.ndarray]:
    return np.load(FIXTURES / name / "tokens.npy"), np.load(FIXTURES / name / "logits.npy")


# --------------------------------------------------------------------------------------------- import


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(converted, name, tmp_path):
    trainer, state = start_from_converted(converted[name], tmp_path, *EXTRA)
    tokens, want = reference(name)
    got = apply(trainer, state.params, tokens)
    assert np.std(want) > 0.5  # logits of a useful scale: a wrong gate, rotary part or layer moves them by far more
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(("name", "where"), [("qwen3_next", "fsdp4xtensor2"), ("qwen3_5_moe_text", "expert4xfsdp2")])
def test_restores_sharded_with_the_same_logits(converted, name, where, tmp_path):
    """Heads over tensor=2 (the query's [query, gate] halves, DeltaNet's key and value heads) and experts over
    expert=4: the checkpoint restores sharded and computes transformers' logits."""
    extra, devices = LAYOUTS[where]
    trainer, state = start_from_converted(converted[name], tmp_path, *extra, *EXTRA, num_devices=devices)
    tokens, want = reference(name)
    got = apply(trainer, state.params, np.tile(tokens, (4, 1)))  # a batch of 8 rows over the 8 devices
    np.testing.assert_allclose(got, np.tile(want, (4, 1, 1)), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_gives_transformers_tokens(converted, name, tmp_path):
    """from_hf -> maxshard.generate temperature=0: transformers' 16 greedy tokens, decoded one at a time through
    the DeltaNet layers' recurrent state and the full-attention layer's KV cache."""
    want = json.loads((FIXTURES / name / "generate.json").read_text())
    assert len(want["new_tokens"]) == want["max_new_tokens"] == 16
    out = tmp_path / "out.jsonl"
    argv = [str(converted[name] / "config.yml"), f"base_output_directory={tmp_path}", f"prompt={want['prompt']}",
            f"max_new_tokens={want['max_new_tokens']}", "temperature=0", f"generate_output={out}", *EXTRA]
    assert generate.main(argv) == 0
    assert json.loads(out.read_text())["tokens"] == want["new_tokens"]


def test_keys_and_tensors_are_the_checkpoints():
    """config.json's layer_types become the layer_types key as they are; partial_rotary_factor, the gates, the
    (1 + w) norms and the shared experts (shared_expert_intermediate_size 32 = 2 experts of 16) become keys; the
    fused DeltaNet tensors are cut per key head (Qwen3-Next) or in one group (Qwen3.5)."""
    keys = hf_config.model_keys(hf_config.read(str(FIXTURES / "qwen3_next")))
    assert keys["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (keys["partial_rotary_factor"], keys["attention_output_gate"], keys["norm_unit_offset"], keys["qk_norm"],
            keys["shared_expert_gate"], keys["num_shared_experts"], keys["mlp_dim"],
            keys["moe_renormalize_top_k"]) == (0.25, True, True, True, True, 2, 16, True)
    assert (keys["linear_num_key_heads"], keys["linear_num_value_heads"], keys["linear_key_head_dim"],
            keys["linear_value_head_dim"], keys["linear_conv_kernel_dim"]) == (2, 4, 8, 8, 4)
    dense = hf_config.model_keys(hf_config.read(str(FIXTURES / "qwen3_5_text")))
    assert "num_experts" not in dense and not dense.get("shared_expert_gate") and dense["mlp_dim"] == 48
    family = hf_config.family({"architectures": ["Qwen3NextForCausalLM"]})
    params = {p.path: p for p in layout.params_of(layout.model_config(keys), family)}
    value = params["decoder", "layers", "layer_0", "linear_attention", "value", "kernel"]
    assert value.entry.hf == "model.layers.{i}.linear_attn.in_proj_qkvz.weight" and value.entry.part == (16, 32, 48)
    assert names.hf_shape(value.entry, value.layer_shape) == (96, 32)  # 2 key heads x [q 8, k 8, v 16, z 16]
    conv = params["decoder", "layers", "layer_0", "linear_attention", "value_conv"]
    assert names.hf_shape(conv.entry, conv.layer_shape) == (64, 1, 4) and conv.entry.part == (32, 64, 64)
    gate = params["decoder", "layers", "layer_3", "attention", "query", "kernel"]
    assert gate.shape == (1, 32, 4, 32)  # [units, embed, heads, 2 x head_dim]: each head's query and gate


def test_config_without_layer_types_follows_transformers_rule():
    """Without layer_types, every full_attention_interval-th layer (4 by default) is full attention, as
    transformers' Qwen3NextConfig builds the list; partial_rotary_factor at top level (the 4.x spelling published
    Qwen3-Next checkpoints use) reads as inside rope_parameters."""
    source = hf_config.read(str(FIXTURES / "qwen3_next"))
    rope = source["rope_parameters"]
    older = {k: v for k, v in source.items() if k not in ("layer_types", "rope_parameters")}
    older |= {"rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}
    assert hf_config.model_keys(older) == hf_config.model_keys(source)
    eight = hf_config.model_keys({**older, "num_hidden_layers": 8, "full_attention_interval": 2})
    assert eight["layer_types"] == ["linear_attention", "full_attention"] * 4


# --------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("name", (*NAMES, "qwen3_5_mm"))
def test_round_trip_is_bit_identical(converted, name, tmp_path):
    """to_hf writes the source's tensors bit for bit (the multimodal one: its language model, as
    Qwen3_5ForCausalLM, which is qwen3_5_text's), and a config.json of the same model keys."""
    out = tmp_path / "hf"
    assert cli.main(["to_hf", str(converted[name] / "checkpoints" / "0"), str(out)]) == 0
    text = "qwen3_5_text" if name == "qwen3_5_mm" else name
    source, back = read_all(FIXTURES / text), read_all(out)
    assert sorted(back) == sorted(source)
    for tensor, array in source.items():
        assert back[tensor].dtype == array.dtype and back[tensor].tobytes() == array.tobytes(), tensor
    exported, original = json.loads((out / "config.json").read_text()), hf_config.read(str(FIXTURES / text))
    assert hf_config.model_keys(exported) == hf_config.model_keys(original)
    for field in ("architectures", "model_type", "layer_types", "linear_num_value_heads", "head_dim"):
        assert exported[field] == original[field], field
    assert exported["partial_rotary_factor"] == original["rope_parameters"]["partial_rotary_factor"]


def test_export_without_a_template_picks_the_family_by_its_keys():
    """The gated attention picks the hybrids: Qwen3.5 dense, Qwen3-Next with experts (Qwen3.5-MoE computes the same
    function; only its DeltaNet tensors are cut otherwise), whose config.json reads back as the same keys."""
    for name, want in (("qwen3_next", "Qwen3NextForCausalLM"), ("qwen3_5_text", "Qwen3_5ForCausalLM"),
                       ("qwen3_5_moe_text", "Qwen3NextForCausalLM")):
        keys = hf_config.model_keys(hf_config.read(str(FIXTURES / name)))
        exported = hf_config.to_hf(keys, "float32")
        assert exported["architectures"] == [want] and hf_config.model_keys(exported) == keys


def test_multimodal_and_mtp_tensors_are_left_out_with_one_line_each(tmp_path, capsys):
    """Qwen3_5ForConditionalGeneration converts its language model and leaves the vision tower out; a checkpoint's
    multi-token prediction head (mtp.*, which transformers does not load) is left out too, each with one line."""
    directory = tmp_path / "mm"
    shutil.copytree(FIXTURES / "qwen3_5_mm", directory)
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({**tensors, "mtp.fc.weight": np.zeros((32, 64), np.float32)}, str(directory / "model.safetensors"))
    assert cli.main(["from_hf", str(directory), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "Qwen3_5ForConditionalGeneration: converting its language model as Qwen3_5ForCausalLM" in err
    assert "note: Qwen3_5ForCausalLM: 1 tensors under mtp.* (the multi-token prediction head" in err
    keys = {k: v for k, v in hf_config.model_keys(hf_config.read(str(tmp_path / "out" / "hf"))).items()}
    assert keys == hf_config.model_keys(hf_config.read(str(FIXTURES / "qwen3_5_text")))


def changed(name: str, change: dict[str, Any]) -> dict[str, Any]:
    return {**hf_config.read(str(FIXTURES / name)), **change}


@pytest.mark.parametrize(("name", "change", "field"), [
    ("qwen3_next", {"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
    ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
    ("qwen3_next", {"layer_types": ["mamba"] * 4}, "layer_types"),
    ("qwen3_next", {"shared_expert_intermediate_size": 24}, "shared_expert_intermediate_size"),
    ("qwen3_next", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3_5_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e3, "partial_rotary_factor": 1.5}},
     "partial_rotary_factor"),
])
def test_what_maxshard_cannot_compute_is_one_line(name, change, field):
    with pytest.raises(ConfigError, match=f"config.json: {field}="):
        hf_config.model_keys(changed(name, change))


def test_partial_rotary_of_a_family_without_it_is_refused():
    """A Llama config.json with a partial_rotary_factor (which transformers would apply) is refused, not dropped."""
    llama = hf_config.read(str(Path(__file__).resolve().parent / "fixtures" / "hf" / "mistral"))
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5 is not supported"):
        hf_config.model_keys({**llama, "partial_rotary_factor": 0.5})


# --------------------------------------------------------------------------------------------- presets


@pytest.mark.parametrize(("preset", "model_type", "low", "high"), [
    ("qwen3_next_80b_a3b", "qwen3_next", 79e9, 81e9), ("qwen3_5_9b", "qwen3_5_text", 8.5e9, 9.5e9),
    ("qwen3_5_35b_a3b", "qwen3_5_moe_text", 34e9, 36e9)])
def test_presets_are_transformers_configs_of_the_published_sizes(preset, model_type, low, high):
    """configs/models/<preset>.yml is the network of transformers' config class at its defaults (its docstring's
    Qwen3-Next-80B-A3B / Qwen3.5-9B / Qwen3.5-35B-A3B style configuration, tests/fixtures/qwen3_next/defaults/),
    every architecture key alike, with the size its name says (eval_shape only)."""
    cfg = loading.model_config(config.finalize(config.parse([str(REPO / "configs" / "base.yml"),
                                                             f"model_name={preset}"]), 1))
    keys = hf_config.model_keys(json.loads((FIXTURES / "defaults" / f"{model_type}.json").read_text()))
    want = layout.model_config(keys)
    for key in architecture_keys():
        if key != "vocab_size":  # a run pads the vocabulary to vocab_size_multiple; both are multiples of 128
            assert getattr(cfg, key) == getattr(want, key), key
    assert cfg.vocab_size == want.vocab_size
    assert low <= model.param_count(cfg) <= high


# --------------------------------------------------------------------------------------------- LoRA out


class RandomAdapters(_RandomAdapters):
    """A LoRA run's adapters stand-in (tests/test_lora.py's, drawn the same way): random (A, B) pairs of rank 2 on the
    attention's and gated DeltaNet's query, key, value and output kernels (what lora_targets q, k, v, o adapt in both
    mixers)."""

    rank, alpha = 2, 1.0
    scale = alpha / rank
    targets = ("query", "key", "value", "out")

    def has(self, param: layout.Param) -> bool:
        return param.path[-1] == "kernel" and param.path[-2] in self.targets and param.stacked


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text"])
def test_lora_on_cut_tensors_exports_merged_and_as_peft(converted, name, tmp_path):
    """LoRA on DeltaNet's query, key and value, cut from one in_proj_qkvz (per key head) or in_proj_qkv (one
    group): the merged export adds each part's update in its own rows (the base's elsewhere), and PEFT's one module
    of rank 3 x 2 (lora_B block-diagonal over the parts' rows) is that same update."""
    keys = hf_config.model_keys(hf_config.read(str(FIXTURES / name)))
    family, cfg = hf_config.family(hf_config.read(str(FIXTURES / name))), layout.model_config(keys)
    params, adapters = layout.params_of(cfg, family), RandomAdapters()
    fused = "in_proj_qkvz" if name == "qwen3_next" else "in_proj_qkv"
    hf_name = f"model.layers.0.linear_attn.{fused}.weight"
    parts = sorted((p for p in params if p.entry.hf.endswith(f"{fused}.weight") and p.first == 0),
                   key=lambda p: p.entry.part)
    update = names.join_parts(parts[0].entry, [adapters.delta(p, (0,)) if adapters.has(p) else
                                               np.zeros(p.layer_shape, np.float32) for p in parts],
                              [p.entry for p in parts])
    assert np.count_nonzero(update.any(axis=1)) == sum(p.entry.part[1] - p.entry.part[0] for p in parts
                                                       if adapters.has(p)) * update.shape[0] // parts[0].entry.part[2]
    reader = to_hf_module.orbax_io.Reader(str(converted[name] / "checkpoints" / "0"))
    tensors = dict((spec.name, produce) for spec, produce in to_hf_module._tensors(reader, params, family, None, cfg,
                                                                                  adapters))
    merged = np.concatenate(list(tensors[hf_name]()))
    base = load_file(str(FIXTURES / name / "model.safetensors"))[hf_name].astype(np.float32)
    # the export is bfloat16: base + update rounded to its 8 significant bits, off by at most 2^-8 of the value
    np.testing.assert_allclose(merged.astype(np.float32), base + update, rtol=2**-8, atol=1e-6)
    convert_lora.export_adapters(adapters, params, family, str(tmp_path), "base")
    written = load_file(str(tmp_path / convert_lora.ADAPTER_FILE))
    settings = json.loads((tmp_path / convert_lora.ADAPTER_CONFIG).read_text())
    stem = convert_lora.PEFT_PREFIX + hf_name.removesuffix(".weight")
    assert settings["rank_pattern"][fused] == 6
    scale = settings["alpha_pattern"][fused] / settings["rank_pattern"][fused]
    got = scale * written[f"{stem}.lora_B.weight"] @ written[f"{stem}.lora_A.weight"]
    np.testing.assert_allclose(got, update, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- multi-token prediction


def with_mtp(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The qwen3_next fixture with a multi-token prediction module as Qwen3-Next checkpoints keep it (mtp.fc,
    mtp.pre_fc_norm_embedding/hidden, mtp.layers.0 = a full-attention MoE layer, mtp.norm: vLLM's names), random."""
    directory = tmp_path / "qwen3_next_mtp"
    shutil.copytree(FIXTURES / "qwen3_next", directory)
    tensors = load_file(str(directory / "model.safetensors"))
    rng = np.random.default_rng(0)
    mtp = {name.replace("model.layers.3.", "mtp.layers.0."): rng.normal(size=t.shape).astype(t.dtype)
           for name, t in tensors.items() if name.startswith("model.layers.3.")}
    embed = tensors["model.embed_tokens.weight"]
    mtp |= {"mtp.fc.weight": rng.normal(size=(embed.shape[1], 2 * embed.shape[1])).astype(embed.dtype),
            **{f"mtp.{n}.weight": rng.normal(size=embed.shape[1:]).astype(embed.dtype)
               for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    save_file({**tensors, **mtp}, str(directory / "model.safetensors"))
    return directory, mtp


def test_qwen3_next_mtp_module_converts_both_ways(tmp_path):
    """A Qwen3-Next checkpoint's multi-token prediction module (which transformers does not load) becomes maxshard's
    mtp_1 (mtp_depth 1: eh_proj from mtp.fc, its layer from mtp.layers.0) and goes back bit for bit; the main
    model's tensors are the fixture's. Qwen3.5's family has no such table: its mtp.* are left out (test above)."""
    directory, mtp = with_mtp(tmp_path)
    assert cli.main(["from_hf", str(directory), str(tmp_path / "out")]) == 0
    assert "mtp_depth: 1" in (tmp_path / "out" / "config.yml").read_text()
    source_config = hf_config.read(str(directory))
    keys = {**hf_config.model_keys(source_config), "mtp_depth": 1}
    params = {p.path: p for p in layout.params_of(layout.model_config(keys), hf_config.family(source_config))}
    assert params["mtp_1", "eh_proj", "kernel"].entry.hf == "mtp.fc.weight"
    assert names.hf_name(params["mtp_1", "layer", "attention", "query", "kernel"].entry, (0,)) == \
        "mtp.layers.0.self_attn.q_proj.weight"
    assert cli.main(["to_hf", str(tmp_path / "out" / "checkpoints" / "0"), str(tmp_path / "hf")]) == 0
    source, back = read_all(directory), read_all(tmp_path / "hf")
    assert sorted(back) == sorted(source) and set(mtp) < set(back)
    assert all(back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes() for k, v in source.items())


def test_mtp_a_family_cannot_keep_is_refused_on_export():
    keys = {**hf_config.model_keys(hf_config.read(str(FIXTURES / "qwen3_5_text"))), "mtp_depth": 1}
    with pytest.raises(ConfigError, match="mtp_depth=1 cannot be written as Qwen3_5ForCausalLM"):
        hf_config.to_hf(keys, "float32", hf_config.read(str(FIXTURES / "qwen3_5_text")))
    qwen3_next = hf_config.read(str(FIXTURES / "qwen3_next"))
    with pytest.raises(ConfigError, match="mtp_depth=2 cannot be written as Qwen3NextForCausalLM"):
        hf_config.to_hf({**hf_config.model_keys(qwen3_next), "mtp_depth": 2}, "float32", qwen3_next)
