"""PEFT's own LoRA adapters in and out: `from_hf --adapters` and `to_hf --adapters-only` against files PEFT wrote.

tests/fixtures/peft/qwen3_lora is what `PeftModel.save_pretrained` wrote for a LoRA (r 4, alpha 8, all seven
projections, A and B non-zero) on the qwen3 fixture, with the logits PEFT computes with it
(tools/make_peft_fixtures.py; peft and torch never enter CI). One module fixture imports the base with those
adapters through the CLI; the tests check that maxshard computes PEFT's logits, exports PEFT's files back, and that
a `maxshard.train` run started from the import starts from the adapters (and its own step exports them again).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from maxshard import train
from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint import params as checkpoint_params
from maxshard.convert import __main__ as convert_cli
from maxshard.convert import peft
from maxshard.errors import ConfigError
from maxshard.generation import inference
from maxshard.model.transformer import Transformer
from maxshard.parallel import mesh as mesh_lib
from maxshard.parallel import sharding
from maxshard.run import loading
from maxshard.training.step import mesh_context

REPO = Path(__file__).resolve().parent.parent
QWEN = REPO / "tests" / "fixtures" / "hf" / "qwen3"
PEFT = REPO / "tests" / "fixtures" / "peft" / "qwen3_lora"
RUN = ("dataset_type=synthetic", "dtype=float32", "weight_dtype=float32", "enable_tensorboard=false", "steps=1",
       "per_device_batch_size=1", "max_target_length=16", "eval_period=0", "checkpoint_period=1", "log_period=1",
       "learning_rate=0")


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("peft") / "qwen3"
    assert convert_cli.main(["from_hf", str(QWEN), str(out), "--adapters", str(PEFT)]) == 0
    return out


def _logits(argv: list[str], tokens: np.ndarray) -> np.ndarray:
    """maxshard's float32 logits for `tokens` from the step that generation and eval pick for `argv`."""
    cfg = loading.load_run([*argv, "dtype=float32", "weight_dtype=float32"], check_fit=False)
    step_dir = inference.find_checkpoint(cfg)
    saved = checkpoint_format.read_config(step_dir)
    cfg = inference.with_saved_model(cfg, saved)
    on, rules = mesh_lib.build(cfg), sharding.flax_rules(cfg)
    params = inference.restore_params(step_dir, cfg, on, rules, saved.get("load_parameters_path", ""))
    rows = np.tile(tokens, (4, 1))  # a row per simulated device
    positions = np.broadcast_to(np.arange(rows.shape[1]), rows.shape)
    with mesh_context(on, rules):
        out = jax.jit(Transformer(cfg.model).apply)({"params": params}, rows, np.ones_like(rows), positions)
    return np.asarray(out)[: len(tokens)]


def test_imported_adapters_compute_peft_s_logits(imported):
    """The imported run's config (adapters on the converted base) gives the logits PEFT computed with the adapters
    within 1e-4 (float32), which are far from the base's own."""
    tokens = np.load(PEFT / "tokens.npy")
    ours = _logits([str(imported / "config.yml")], tokens)
    peft, base = np.load(PEFT / "logits.npy"), np.load(QWEN / "logits.npy")
    np.testing.assert_allclose(ours, peft, atol=1e-4, rtol=0)
    assert np.max(np.abs(peft - base)) > 1.0


def _assert_peft_s_files(exported: Path) -> None:
    """`exported` holds PEFT's tensors (names, shapes, values) and the adapter_config.json fields PEFT reads."""
    theirs, ours = load_file(str(PEFT / "adapter_model.safetensors")), load_file(str(exported /
                                                                                       "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape and ours[name].dtype == tensor.dtype, name
        np.testing.assert_array_equal(ours[name], tensor, err_msg=name)
    peft_config = json.loads((PEFT / "adapter_config.json").read_text())
    our_config = json.loads((exported / "adapter_config.json").read_text())
    assert set(our_config["target_modules"]) == set(peft_config["target_modules"])
    for key, value in our_config.items():
        if key not in ("target_modules", "base_model_name_or_path"):
            assert value == peft_config[key], key


def test_adapters_only_export_reproduces_peft_s_files(imported, tmp_path):
    assert convert_cli.main(["to_hf", str(imported / "adapters" / "0"), str(tmp_path / "out"),
                             "--adapters-only"]) == 0
    _assert_peft_s_files(tmp_path / "out")


def test_training_starts_from_the_imported_adapters(imported, capsys):
    """`maxshard.train` on the imported config starts from the adapters (at learning rate 0 its saved step holds
    them unchanged: fresh ones would have B = 0), its own step exports PEFT's files again (its base is found
    through the imported step), and generation with the training command picks that step."""
    root = imported.parent
    argv = [str(imported / "config.yml"), *RUN, f"base_output_directory={root}", "run_name=from_peft"]
    assert train.main(argv) == 0
    assert f"starting from step 0 with the parameters of {imported / 'adapters' / '0'}" in capsys.readouterr().out
    step = root / "from_peft" / "checkpoints" / "1"
    assert convert_cli.main(["to_hf", str(step), str(root / "from_peft_peft"), "--adapters-only"]) == 0
    _assert_peft_s_files(root / "from_peft_peft")
    cfg = loading.load_run(argv, check_fit=False)
    assert inference.find_checkpoint(cfg) == str(step)


def test_run_keys_must_match_the_adapters(imported):
    """A run whose LoRA keys differ from the imported adapters' fails in one line naming the key, at the start of
    `load_parameters` (through `maxshard.train`, before anything compiles: tests/test_lora.py)."""
    argv = [str(imported / "config.yml"), *RUN, f"base_output_directory={imported.parent}", "run_name=mismatch"]
    imported_cfg = loading.load_run(argv, check_fit=False)
    for key, value in (("lora_alpha", 16.0), ("lora_rank", 8), ("lora_targets", ("q", "v"))):
        cfg = loading.replace(imported_cfg, **{key: value})
        with pytest.raises(ConfigError, match=f"^{key}=.*: the adapters of load_parameters_path=.* have {key}=") as e:
            checkpoint_params.read_start_adapters(cfg, target_params=None)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit, message", [
    ({"use_rslora": True}, r"use_rslora=True changes what the adapters compute"),
    ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules names lm_head; maxshard's LoRA adapts q_proj"),
    ({"target_modules": "q_proj|v_proj"}, r"target_modules='q_proj\|v_proj': list the projections by name"),
    ({"r": 8}, r"tensor base_model.model.model.layers.0.self_attn.[a-z]_proj.lora_A.weight has shape \[4, 64\]; "
               r"r=8"),
    ({"target_modules": ["q_proj", "v_proj"]}, r"tensor base_model.model.model.layers.0.mlp.down_proj.lora_A"
                                               r".weight has no place"),
], ids=["rslora", "head", "pattern", "rank", "extra_tensor"])
def test_adapters_maxshard_cannot_compute_fail_in_one_line(tmp_path, edit, message):
    adapters = tmp_path / "adapters"
    shutil.copytree(PEFT, adapters)
    config = {**json.loads((PEFT / "adapter_config.json").read_text()), **edit}
    (adapters / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as e:
        convert_cli.run(convert_cli.parser().parse_args(["from_hf", str(QWEN), str(tmp_path / "out"),
                                                         "--adapters", str(adapters)]))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_lora_dropout_is_named_as_not_applied(tmp_path, capsys):
    """PEFT's lora_dropout is a training option: the adapters import as they are, and the user is told the run
    trains them without it."""
    adapters = tmp_path / "adapters"
    shutil.copytree(PEFT, adapters)
    config = {**json.loads((PEFT / "adapter_config.json").read_text()), "lora_dropout": 0.05}
    (adapters / "adapter_config.json").write_text(json.dumps(config))
    assert peft.read(str(adapters)).rank == peft.read(str(PEFT)).rank
    out = capsys.readouterr().out
    assert out.count("note:") == 1 and "lora_dropout=0.05 is not applied" in out  # none for the 0.0 fixture
