"""GPT-OSS import and export (`GptOssForCausalLM`): transformers' logits and greedy tokens, bit-identical export,
and the released checkpoints' MXFP4 experts dequantized as transformers dequantizes them.

Fixtures (tools/make_hf_fixtures.py, transformers 5.x): `gpt_oss`, 4 layers alternating sliding (window 4 < the
12-token text) and full attention with sinks and q/k/v/o biases, 4 experts top-2 with router and expert biases,
clamped SwiGLU (limit 1, so it binds), YaRN with truncate false, float32; `gpt_oss_mxfp4`, 2 such layers whose
experts are stored as MXFP4 blocks + scales, with the logits transformers computes after its own dequantization.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from test_convert import FIXTURES, TOLERANCE, apply, convert_all, read_all, reference, start_from_converted

from maxshard import config, generate
from maxshard.convert import __main__ as cli
from maxshard.convert import hf_config, mxfp4, safetensors_io
from maxshard.errors import ConfigError
from maxshard.spec import blocks
from maxshard.model import transformer as model
from maxshard.run import loading
from maxshard.training.step import Trainer

# An explicit remat policy: `auto` would plan every policy's memory first (planning/fit.py, ~20 s of tracing for
# this model on CPU), which the planning tests cover; what is under test here is the converted model.
POLICY = "remat_policy=full"
REPO = Path(__file__).resolve().parent.parent
LAYOUTS = {"one_device": ((), 1), "fsdp4xtensor2": (("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"), 8),
           "expert4xfsdp2": (("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"), 8)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return convert_all(tmp_path_factory, ("gpt_oss", "gpt_oss_mxfp4"))


def test_config_maps_to_the_model_keys(converted):
    keys = hf_config.model_keys(hf_config.read(str(FIXTURES / "gpt_oss")))
    assert keys["attention_pattern"] == ["local", "global"] and keys["sliding_window"] == 4
    assert (keys["attention_sinks"], keys["attention_bias"], keys["moe_bias"]) == (True, True, True)
    assert (keys["mlp_activation"], keys["swiglu_limit"], keys["swiglu_alpha"]) == ("clamped_swiglu", 1.0, 1.702)
    assert (keys["num_experts"], keys["num_experts_per_tok"], keys["mlp_dim"], keys["head_dim"]) == (4, 2, 32, 16)
    assert (keys["rope_scaling_type"], keys["yarn_truncate"], keys["capacity_factor"]) == ("yarn", False, -1.0)
    released = {**hf_config.read(str(FIXTURES / "gpt_oss")), "layer_types": ["sliding_attention", "chunked"]}
    with pytest.raises(ConfigError, match="layer_types"):
        hf_config.model_keys(released)
    mixtral = hf_config.read(str(FIXTURES / "mixtral"))  # what Mixtral's config.json cannot say is refused on export
    with pytest.raises(ConfigError, match="cannot be written as MixtralForCausalLM"):
        hf_config.to_hf(keys, "float32", mixtral)
    assert hf_config.to_hf(keys, "float32")["architectures"] == ["GptOssForCausalLM"]  # without a template


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers(converted, tmp_path, layout):
    extra, devices = LAYOUTS[layout]
    trainer, state = start_from_converted(converted["gpt_oss"], tmp_path, POLICY, *extra, num_devices=devices)
    tokens, want = reference("gpt_oss")
    batch = 1 if devices == 1 else 4
    got = apply(trainer, state.params, np.tile(tokens, (batch, 1)))
    assert np.std(want) > 0.5
    np.testing.assert_allclose(got, np.tile(want, (batch, 1, 1)), rtol=0, atol=TOLERANCE)
    if layout == "expert4xfsdp2":
        wi_0 = state.params["decoder"]["layers"]["layer_0"]["moe"]["wi_0"]  # [units, experts, embed, mlp]
        assert wi_0.addressable_shards[0].data.shape[1] == 1  # one expert of 4 per device
    if layout == "one_device":  # the window and the untruncated YaRN both matter for these logits
        for change in ({"sliding_window": 12}, {"yarn_truncate": True}):  # a window as long as the text: global
            other = Trainer(loading.replace(trainer.cfg, **change), trainer.mesh)
            assert np.max(np.abs(apply(other, state.params, tokens) - want)) > 10 * TOLERANCE, change


def test_greedy_generation_gives_transformers_tokens_past_the_window(converted, tmp_path):
    want = json.loads((FIXTURES / "gpt_oss" / "generate.json").read_text())
    assert len(want["input_ids"]) + len(want["new_tokens"]) > 4 * 4  # several windows long
    out = tmp_path / "out.jsonl"
    argv = [str(converted["gpt_oss"] / "config.yml"), f"base_output_directory={tmp_path}",
            f"prompt={want['prompt']}", f"max_new_tokens={want['max_new_tokens']}", "temperature=0",
            f"generate_output={out}", POLICY, "max_target_length=32"]  # prompt + 16 tokens fit
    assert generate.main(argv) == 0
    assert json.loads(out.read_text())["tokens"] == want["new_tokens"]


def test_round_trip_is_bit_identical(converted, tmp_path):
    out = tmp_path / "hf"
    assert cli.main(["to_hf", str(converted["gpt_oss"] / "checkpoints" / "0"), str(out)]) == 0
    source, back = read_all(FIXTURES / "gpt_oss"), read_all(out)
    assert sorted(back) == sorted(source)
    for tensor, array in source.items():
        assert back[tensor].dtype == array.dtype and back[tensor].tobytes() == array.tobytes(), tensor
    exported, original = json.loads((out / "config.json").read_text()), hf_config.read(str(FIXTURES / "gpt_oss"))
    assert hf_config.model_keys(exported) == hf_config.model_keys(original)
    assert exported["layer_types"] == original["layer_types"] and exported["rope_scaling"]["truncate"] is False


def test_dequantizes_fp4_codes_and_scales():
    """One block of 32: byte 0x71 holds code 1 (0.5) then code 7 (6.0); 0xF8 holds -0.0 then -6.0; scale
    128 is 2 ** 1, 125 is 2 ** -2; the result is [in, out], the transpose of the stored [out, in]."""
    blocks = np.zeros((1, 2, 1, 16), np.uint8)
    blocks[0, 0, 0, :2] = [0x71, 0xF8]
    blocks[0, 1, 0, 15] = 0x2A  # code 10 (-1.0) at 30, code 2 (1.0) at 31
    scales = np.array([[[128], [125]]], np.uint8)
    values = mxfp4.dequantize(blocks, scales, np.dtype(np.float32))
    assert values.shape == (1, 32, 2)
    assert values[0, :4, 0].tolist() == [1.0, 12.0, -0.0, -12.0] and not values[0, 4:, 0].any()
    assert values[0, 30:, 1].tolist() == [-0.25, 0.25] and not values[0, :30, 1].any()


def test_mxfp4_checkpoint_imports_to_transformers_dequantized_logits(converted, tmp_path):
    """The MXFP4 fixture converts (its experts dequantized to the checkpoint's float32), computes the logits
    transformers computed from it, and exports as plain tensors without the quantization_config."""
    trainer, state = start_from_converted(converted["gpt_oss_mxfp4"], tmp_path / "run", POLICY)
    tokens, want = reference("gpt_oss_mxfp4")
    np.testing.assert_allclose(apply(trainer, state.params, tokens), want, rtol=0, atol=TOLERANCE)
    out = tmp_path / "hf"
    assert cli.main(["to_hf", str(converted["gpt_oss_mxfp4"] / "checkpoints" / "0"), str(out)]) == 0
    back = read_all(out)
    assert back["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 64)
    assert not any(name.endswith(mxfp4.SUFFIXES) for name in back)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


@pytest.mark.parametrize(("name", "layers", "total"), [("gpt_oss_20b", 24, 20.91e9), ("gpt_oss_120b", 36, 116.83e9)])
def test_presets_have_the_published_shapes_and_sizes(name, layers, total):
    """configs/models/gpt_oss_*.yml: the released config.json's keys, and the parameter counts OpenAI's model card
    gives (20.91B, 116.83B total), counted from the model's own tree (eval_shape)."""
    argv = [str(REPO / "configs" / "base.yml"), f"model_name={name}", "dataset_type=synthetic"]
    cfg = loading.model_config(config.finalize(config.parse(argv), 8))
    assert blocks.stacks(cfg)[0].unit == (blocks.Layer("gqa", "moe", True), blocks.Layer("gqa", "moe", False))
    assert cfg.num_units == layers // 2 and cfg.moe_bias and cfg.attention_sinks and cfg.attention_bias
    assert model.param_count(cfg) == pytest.approx(total, rel=1e-3)


def test_mxfp4_pairs_read_as_the_sources_float_dtype_and_lone_halves_are_refused(tmp_path):
    """A bfloat16 checkpoint (as released): its MXFP4 experts read as one bfloat16 tensor [experts, in, out], rows
    (experts) dequantized on their own; a _blocks without its _scales is one line naming it."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 4, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 130, (3, 4, 2), dtype=np.uint8)
    norm = np.ones(8, ml_dtypes.bfloat16)
    save_file({"e.gate_up_proj_blocks": blocks, "e.gate_up_proj_scales": scales, "norm": norm},
              str(tmp_path / "model.safetensors"))
    with safetensors_io.Source(str(tmp_path)) as source:
        info = source.tensors["e.gate_up_proj"]
        assert (info.dtype, info.shape) == (np.dtype(ml_dtypes.bfloat16), (3, 64, 4))
        whole = mxfp4.dequantize(blocks, scales, np.dtype(np.float32))
        assert source.read(info, 1, 3).tobytes() == whole[1:3].astype(ml_dtypes.bfloat16).tobytes()
        assert np.array_equal(whole.astype(ml_dtypes.bfloat16).astype(np.float32), whole)  # exact in bfloat16
    save_file({"e.gate_up_proj_blocks": blocks, "norm": norm}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="e.gate_up_proj_blocks has no _scales partner"):
        safetensors_io.Source(str(tmp_path))
