"""Gemma 2 and Gemma 3 (text) through the Hugging Face converter: logits and greedy tokens equal transformers',
the round trip is bit for bit, and what maxshard cannot compute is refused in one line.

The fixtures (tests/fixtures/hf/gemma2, gemma3; tools/make_hf_fixtures.py with transformers) have sliding windows of
4 tokens, shorter than the 12-token reference text and than prompt + generated tokens, so the local layers' window,
the soft-caps, query_pre_attn_scalar and Gemma 3's per-layer-type RoPE all move the logits. Gemma 3's 8 layers are
maxshard's unit of 6 (five local, one global) plus a last_layers stack of 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file
from test_convert import FIXTURES, REPO, TOLERANCE, apply, convert_all, read_all, reference, starter, training_keys

from maxshard import config, generate
from maxshard.checkpoint import manager as checkpoint
from maxshard.convert import __main__ as cli
from maxshard.convert import hf_config, hf_local_global, layout, names
from maxshard.errors import ConfigError
from maxshard.model import transformer as model
from maxshard.run import loading
from maxshard.training.step import Trainer

NAMES = ("gemma2", "gemma3")
# remat_policy=auto plans every policy's residuals (planning/fit.py): seconds per layer kind of a unit of 6; these
# tests check the function, which no policy changes
EXTRA = ("remat_policy=full",)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return convert_all(tmp_path_factory, NAMES)


@pytest.fixture(scope="module")
def started(converted, tmp_path_factory) -> Any:
    return starter(converted, tmp_path_factory, *EXTRA)


# --------------------------------------------------------------------------------------------- import


@pytest.mark.parametrize("where", ["one_device", "fsdp4xtensor2"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(started, name, where):
    """Under fsdp=4 x tensor=2 too: Gemma 3's unit of 6 layers and its last_layers stack restored sharded."""
    trainer, state = started(name, where)
    tokens, want = reference(name)
    batch = 1 if where == "one_device" else 4  # a batch of 8 divides fsdp=4 x tensor=2
    got = apply(trainer, state.params, np.tile(tokens, (batch, 1)))
    assert np.std(want) > 0.5
    np.testing.assert_allclose(got, np.tile(want, (batch, 1, 1)), rtol=0, atol=TOLERANCE)


def test_keys_and_stacks_are_the_checkpoints(converted):
    """config.yml carries the layer pattern transformers' layer_types spell out, and Gemma 3's 8 layers are a unit of
    6 layers (five local, one global) plus a last_layers stack of 2, each HF layer in its own slot."""
    g2 = hf_config.model_keys(hf_config.read(str(FIXTURES / "gemma2")))
    assert (g2["attention_pattern"], g2["sliding_window"], g2["attn_logit_softcapping"],
            g2["final_logit_softcapping"], g2["query_pre_attn_scalar"]) == (["local", "global"], 4, 1.0, 4.0, 12)
    assert g2["rope_scaling_type"] == "none" and "rope_local_max_timescale" not in g2 and g2["logits_via_embedding"]
    g3 = hf_config.model_keys(hf_config.read(str(FIXTURES / "gemma3")))
    assert g3["attention_pattern"] == ["local"] * 5 + ["global"] and g3["qk_norm"]
    assert (g3["rope_max_timescale"], g3["rope_scaling_type"], g3["rope_scaling_factor"],
            g3["rope_local_max_timescale"], g3["final_logit_softcapping"]) == (1000.0, "linear", 4.0, 50.0, 0)
    family = hf_config.family({"architectures": ["Gemma3ForCausalLM"]})
    params = {p.path: p for p in layout.params_of(layout.model_config(g3), family)}
    norm = ("post_mlp_norm", "scale")
    layers = {("decoder", "layers", f"layer_{s}", *norm): s for s in range(6)}
    layers |= {("decoder", "last_layers", f"layer_{s}", *norm): 6 + s for s in range(2)}
    found = {names.hf_name(params[path].entry, params[path].indices()[0]) for path in layers}
    assert found == {f"model.layers.{i}.post_feedforward_layernorm.weight" for i in range(8)}
    assert all(params[path].indices() == [(i,)] for path, i in layers.items())  # one unit each: 8 layers, 8 slots


def test_window_softcaps_and_local_rope_are_needed_for_those_logits(started):
    """Each Gemma option the fixtures use moves their logits far beyond the tolerance: no window, no attention
    soft-cap (Gemma 2), local layers on the global RoPE (Gemma 3)."""
    for name, change in (("gemma2", {"sliding_window": 64}),
                         ("gemma2", {"attn_logit_softcapping": 0.0}),
                         ("gemma3", {"rope_local_max_timescale": 0.0})):
        trainer, state = started(name, "one_device")
        tokens, want = reference(name)
        other = Trainer(loading.replace(trainer.cfg, **change), trainer.mesh)
        assert np.max(np.abs(apply(other, state.params, tokens) - want)) > 100 * TOLERANCE, change


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_past_the_window_gives_transformers_tokens(converted, name, tmp_path):
    """from_hf -> maxshard.generate temperature=0: the tokens of transformers' model.generate, 23 tokens through a
    window of 4 (the KV cache masks what the local layers no longer see)."""
    want = json.loads((FIXTURES / name / "generate.json").read_text())
    assert len(want["input_ids"]) + want["max_new_tokens"] > 2 * 4
    out = tmp_path / "out.jsonl"
    argv = [str(converted[name] / "config.yml"), f"base_output_directory={tmp_path}", f"prompt={want['prompt']}",
            f"max_new_tokens={want['max_new_tokens']}", "temperature=0", f"generate_output={out}", *EXTRA]
    assert generate.main(argv) == 0
    assert json.loads(out.read_text())["tokens"] == want["new_tokens"]


# --------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bit_identical(converted, name, tmp_path):
    out = tmp_path / "hf"
    assert cli.main(["to_hf", str(converted[name] / "checkpoints" / "0"), str(out)]) == 0
    source, back = read_all(FIXTURES / name), read_all(out)
    assert sorted(back) == sorted(source)
    for tensor, array in source.items():
        assert back[tensor].dtype == array.dtype and back[tensor].tobytes() == array.tobytes(), tensor
    exported, original = json.loads((out / "config.json").read_text()), hf_config.read(str(FIXTURES / name))
    assert hf_config.model_keys(exported) == hf_config.model_keys(original)
    for field in ("architectures", "model_type", "layer_types", "sliding_window", "query_pre_attn_scalar",
                  "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "tie_word_embeddings"):
        assert exported[field] == original[field], field


def test_to_hf_from_a_training_checkpoint(started, tmp_path):
    """A checkpoint the trainer saved under fsdp=4 x tensor=2 (OCDBT, each of Gemma 3's layers in its unit's slot)
    exports to the source tensors, bit for bit."""
    trainer, state = started("gemma3", "fsdp4xtensor2")
    with checkpoint.Checkpoints(trainer.cfg, trainer) as ckpt:
        ckpt.save(1, state, {})
    out = tmp_path / "hf"
    assert cli.main(["to_hf", str(Path(trainer.cfg.checkpoint_dir) / "1"), str(out)]) == 0
    source, back = read_all(FIXTURES / "gemma3"), read_all(out)
    assert sorted(back) == sorted(source)
    assert all(back[name].tobytes() == array.tobytes() for name, array in source.items())


def test_the_multimodal_release_converts_its_language_model(converted, tmp_path, capsys):
    """Gemma3ForConditionalGeneration, as Google publishes Gemma 3 4B-27B (a sparse text_config, the language model
    under language_model.model.*, a vision tower beside it), around gemma3's text model: from_hf converts the
    language model to gemma3's keys and parameters and says what it left out; to_hf writes Gemma3ForCausalLM whose
    tensors are gemma3's bit for bit (whose logits test_logits_match_transformers checks; the fixture's tool checks
    that the wrapper computes them too)."""
    out = tmp_path / "mm"
    assert cli.main(["from_hf", str(FIXTURES / "gemma3_mm"), str(out)]) == 0
    assert "Gemma3ForConditionalGeneration: converting its language model as Gemma3ForCausalLM" in capsys.readouterr().err
    assert training_keys(out) == training_keys(converted["gemma3"])
    assert cli.main(["to_hf", str(out / "checkpoints" / "0"), str(tmp_path / "hf")]) == 0
    back, text = read_all(tmp_path / "hf"), read_all(FIXTURES / "gemma3")
    assert sorted(back) == sorted(text) and all(back[k].tobytes() == v.tobytes() for k, v in text.items())
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["Gemma3ForCausalLM"]
    assert hf_config.model_keys(exported) == hf_config.model_keys(hf_config.read(str(FIXTURES / "gemma3")))


def test_a_multimodal_tensor_of_no_known_part_is_one_line(tmp_path, capsys):
    directory = gemma_copy(tmp_path, "gemma3_mm", {})
    tensors = read_all(directory)
    save_file({**tensors, "audio_tower.weight": np.zeros(2, np.float32)}, str(directory / "model.safetensors"))
    assert cli.main(["from_hf", str(directory), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tensor audio_tower.weight belongs to no part of Gemma3ForConditionalGeneration" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def spelled_4x(gemma3: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 3 fixture's config.json as transformers 4.x checkpoints spell it (google/gemma-3-*: rope_theta and
    rope_scaling for global layers, rope_local_base_freq, sliding_window_pattern instead of layer_types)."""
    cfg = {k: v for k, v in gemma3.items() if k not in ("rope_parameters", "layer_types")}
    full = gemma3["rope_parameters"]["full_attention"]
    return {**cfg, "rope_theta": full["rope_theta"], "rope_scaling": {"rope_type": "linear", "factor": full["factor"]},
            "rope_local_base_freq": gemma3["rope_parameters"]["sliding_attention"]["rope_theta"],
            "sliding_window_pattern": 6}


def test_both_spellings_and_export_without_a_template():
    """4.x and 5.x Gemma 3 configs give the same keys; to_hf without a template picks Gemma 2 / 3 by the keys and
    writes what reads back as the same keys (4.x RoPE spelling, layer_types in full, null soft-caps)."""
    gemma3 = hf_config.read(str(FIXTURES / "gemma3"))
    keys = hf_config.model_keys(gemma3)
    assert hf_config.model_keys(spelled_4x(gemma3)) == keys
    gemma2 = hf_config.read(str(FIXTURES / "gemma2"))  # as google/gemma-2-* spell it: no layer_types, hidden_act too
    older = {k: v for k, v in gemma2.items() if k not in ("rope_parameters", "layer_types")}
    older |= {"rope_theta": 1e4, "hidden_act": "gelu_pytorch_tanh", "cache_implementation": "hybrid"}
    assert hf_config.model_keys(older) == hf_config.model_keys(gemma2)
    assert hf_config.to_hf(hf_config.model_keys(older), "float32", older)["hidden_act"] == "gelu_pytorch_tanh"
    for name in NAMES:
        source = hf_config.read(str(FIXTURES / name))
        keys = hf_config.model_keys(source)
        exported = hf_config.to_hf(keys, "float32")
        assert exported["architectures"] == source["architectures"] and hf_config.model_keys(exported) == keys
    assert exported["rope_local_base_freq"] == 50.0 and exported["final_logit_softcapping"] is None
    assert exported["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_layer_pattern_is_the_shortest_period():
    """Gemma 3 27B's 62 layers (transformers' default rule for sliding_window_pattern 6) are a period of 6; an
    all-global model has no window."""
    hf = {"num_hidden_layers": 62, "sliding_window": 1024, "sliding_window_pattern": 6}
    fam = hf_config.family({"architectures": ["Gemma3ForCausalLM"]})
    assert hf_local_global.pattern_keys(hf, fam) == {"attention_pattern": ["local"] * 5 + ["global"],
                                                     "sliding_window": 1024}
    types = ["full_attention"] * 4
    assert hf_local_global.pattern_keys({**hf, "num_hidden_layers": 4, "layer_types": types}, fam) == {
        "attention_pattern": ["global"], "sliding_window": 0}
    assert hf_local_global.shortest_period(list("LGLLGL")) == 3 and hf_local_global.shortest_period(list("LLG")) == 3
    keys = {"attention_pattern": ["local", "global"], "sliding_window": 8, "num_layers": 5}
    assert hf_local_global.layer_types(keys) == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]


@pytest.mark.parametrize(("name", "count"), [("gemma3_27b", 27_009_346_304), ("gemma2_9b", 9_241_705_984)])
def test_presets_have_the_published_parameter_counts(name, count):
    """configs/models/gemma3_27b.yml: Gemma 3 27B's text model, ~27.0B with its 262208 x 5376 tied embedding;
    gemma2_9b.yml: 9.24B (what `python -m maxshard.plan ... model_name=NAME` prints)."""
    cfg = config.parse([str(REPO / "configs" / "base.yml"), f"model_name={name}"])
    assert model.param_count(loading.model_config(config.finalize(cfg, 1))) == count


# --------------------------------------------------------------------------------------------- refusals


def gemma_copy(tmp_path: Path, name: str, change: dict[str, Any], remove: tuple[str, ...] = ()) -> Path:
    directory = tmp_path / name
    shutil.copytree(FIXTURES / name, directory)
    cfg = {k: v for k, v in json.loads((directory / "config.json").read_text()).items() if k not in remove}
    (directory / "config.json").write_text(json.dumps({**cfg, **change}))
    return directory


@pytest.mark.parametrize(("name", "change", "field"), [
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
    ("gemma2", {"layer_types": ["full_attention"]}, "layer_types"),
    ("gemma2", {"sliding_window": None}, "sliding_window"),
    ("gemma2", {"attention_bias": True}, "attention_bias"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "longrope", "rope_theta": 1e4}}},
     "rope_parameters.rope_type"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_gemma_fields_maxshard_cannot_compute_are_one_line(tmp_path, capsys, name, change, field):
    assert cli.main(["from_hf", str(gemma_copy(tmp_path, name, change)), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"maxshard: error: config.json: {field}=") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_export_refuses_options_the_family_cannot_write(converted, tmp_path, capsys):
    """A Gemma checkpoint exported with a Llama template, or model keys a family has no field for (post_norms on a
    Llama, a local RoPE base on Gemma 2, a local RoPE that would need scaling on Gemma 3), is one line, not a
    config.json that transformers would load as another function."""
    step = str(converted["gemma2"] / "checkpoints" / "0")
    assert cli.main(["to_hf", step, str(tmp_path / "out"), "--template", str(FIXTURES / "llama_tied")]) == 2
    err = capsys.readouterr().err
    assert "cannot be written as LlamaForCausalLM" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "config.json").exists()
    llama = hf_config.model_keys(hf_config.read(str(FIXTURES / "llama_tied")))
    template = hf_config.read(str(FIXTURES / "llama_tied"))
    for change, key in (({"post_norms": True}, "post_norms"), ({"embed_scale": True}, "embed_scale"),
                        ({"attention_pattern": ["local", "global"], "sliding_window": 4}, "sliding_window"),
                        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping")):
        with pytest.raises(ConfigError, match=f"^{key}=.* cannot be written as LlamaForCausalLM"):
            hf_config.to_hf({**llama, **change}, "float32", template)
    g2 = hf_config.model_keys(hf_config.read(str(FIXTURES / "gemma2")))
    with pytest.raises(ConfigError, match="^rope_local_max_timescale=100.0 cannot be written as Gemma2ForCausalLM"):
        hf_config.to_hf({**g2, "rope_local_max_timescale": 100.0}, "float32", hf_config.read(str(FIXTURES / "gemma2")))
    g3 = hf_config.model_keys(hf_config.read(str(FIXTURES / "gemma3")))
    with pytest.raises(ConfigError, match="^rope_local_max_timescale=0 with rope_scaling_type=linear"):
        hf_config.to_hf({**g3, "rope_local_max_timescale": 0.0}, "float32")
