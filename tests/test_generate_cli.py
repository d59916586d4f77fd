"""`python -m maxshard.generate` end to end on a checkpoint written in this process: the model comes from the
checkpoint's config, completions go to stdout and JSONL with tokens/s figures, a pipelined checkpoint loads
unpipelined, both tokenizers decode to text, and every bad input is one line and exit code 2 before any compile.

The checkpoints hold random weights (drawn on the host, so no init program compiles); the CLI runs in this process
(`generate.main`), except one subprocess run that checks the module entry point itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard import generate
from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint.manager import Checkpoints
from maxshard.data.tokenizer import ByteTokenizer, load_hf_tokenizer, load_sentencepiece
from maxshard.errors import ConfigError
from maxshard.generation import inference
from maxshard.model.layers.pipeline import to_scanned
from maxshard.parallel import mesh, sharding
from maxshard.run import loading
from maxshard.training.step import Trainer, TrainState
import cli_processes

REPO = Path(__file__).resolve().parent.parent
BASE = str(REPO / "configs" / "base.yml")
MODEL = ("emb_dim=32", "num_layers=2", "num_heads=4", "num_kv_heads=2", "head_dim=8", "mlp_dim=64",
         "max_target_length=32")
TRAINED = ("cpu_device_count=8", "dataset_type=synthetic", *MODEL)


def _random_params(trainer: Trainer) -> dict:
    rng = np.random.default_rng(0)
    shapes = nn.unbox(trainer.abstract_state.params)
    host = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
    return jax.device_put(host, trainer.state_shardings.params)


def _save_run(base: Path, *keys: str) -> dict:
    """Writes step 5 of a run with random weights (the model of MODEL); returns its host params."""
    cfg = loading.load_run([BASE, *TRAINED, f"base_output_directory={base}", *keys])
    trainer = Trainer(cfg, mesh.build(cfg))
    params = _random_params(trainer)
    state = TrainState(jnp.zeros((), jnp.int32), params, trainer.tx.init(params))
    with Checkpoints(cfg, trainer) as ckpt:
        ckpt.save(5, state, {})
    return jax.device_get(params)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("runs")
    _save_run(base)
    return base


def _generate(base: Path, *keys: str) -> int:
    return generate.main([BASE, "cpu_device_count=8", f"base_output_directory={base}", *keys])


def test_generates_from_the_checkpoints_model_and_writes_jsonl(base, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def \nclass Foo(object):\n")
    out = tmp_path / "out" / "samples.jsonl"
    # No model key on this command line: they come from the checkpoint (base.yml's emb_dim=128 would not load).
    assert _generate(base, f"prompts_file={prompts}", f"generate_output={out}", "max_new_tokens=5",
                     "temperature=0.8", "top_k=20", "seed=3") == 0
    printed = capsys.readouterr().out
    assert "checkpoint: " in printed and "/checkpoints/5" in printed
    assert "prefill: " in printed and "decode: " in printed and printed.count("tokens/s") == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["def ", "class Foo(object):"]
    for row in rows:
        assert 1 <= len(row["tokens"]) <= 5
        assert row["completion"] == generate.completion_text(ByteTokenizer(), row["tokens"])
        assert row["prompt"] + row["completion"] in printed


@pytest.mark.parametrize(("keys", "fragment"), [
    (("run_name=never_trained", "prompt=x"), "no checkpoint in "),
    (("prompt=" + "x" * 31,), "prompt is 32 tokens as encoded; the model's max_target_length is 32: shorten it to "
                              "at most 31 tokens"),
    (("prompt=abc", "max_new_tokens=29"), "max_new_tokens=29 runs past the model's max_target_length=32"),
    (("prompt=abc", "max_new_token=3"), "unknown key 'max_new_token' (from command line); did you mean max_new_tokens"),
    (("prompt=abc", "ici_pipeline_parallelism=2"), "generation runs unpipelined"),
    ((), "set exactly one of prompt=TEXT and prompts_file=PATH"),
    (("prompts_file=missing.txt",), "prompts_file="),
    (("prompt=abc", "top_p=0"), "top_p must be in (0, 1]"),
    (("prompt=abc", "temperature=-1"), "temperature must be >= 0"),
])
def test_bad_input_is_one_line_and_exit_code_2(base, capsys, keys, fragment):
    assert _generate(base, *keys) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("maxshard: error: ") and fragment in lines[0], captured.err
    assert "compiled" not in captured.out  # refused before anything compiled


def test_the_module_entry_point_exits_2_with_one_line():
    argv = [sys.executable, "-m", "maxshard.generate", BASE, "cpu_device_count=8", "prompt=x", "top_k=-1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = cli_processes.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.splitlines() == ["maxshard: error: top_k must be >= 0, got -1"]


def test_a_pipelined_checkpoint_loads_unpipelined(tmp_path):
    saved = _save_run(tmp_path, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "run_name=piped")
    assert "pipeline" in saved["decoder"]  # [repeats, stages, layers per stage, ...] stacks
    cfg = loading.load_run([BASE, *TRAINED, f"base_output_directory={tmp_path}", "run_name=piped",
                            "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"])
    step_dir = inference.find_checkpoint(cfg)
    cfg = inference.with_saved_model(cfg, checkpoint_format.read_config(step_dir))
    generation_mesh = mesh.build(cfg)
    params = inference.restore_params(step_dir, cfg, generation_mesh, sharding.flax_rules(cfg))
    expected = to_scanned(saved)
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), expected)
    assert params["decoder"]["layers"]["mlp"]["wi_0"]["kernel"].sharding.mesh.shape["tensor"] == 2


def test_both_tokenizers_decode_completions_to_text(tmp_path):
    text = "def f(x):\n    return x  # é\n"
    byte = ByteTokenizer()
    assert generate.completion_text(byte, [*byte.encode(text), byte.eos_id]) == text
    pytest.importorskip("sentencepiece")
    sys.path.insert(0, str(REPO / "tools"))
    import train_tokenizer

    path = str(tmp_path / "sp.model")
    train_tokenizer.train([text, "class A:\n    pass\n", "import os\n"] * 50, path, vocab_size=300)
    sp = load_sentencepiece(path)
    assert generate.completion_text(sp, [*sp.encode(text), sp.eos_id]) == text


def test_a_prompt_that_encodes_to_no_tokens_is_refused():
    """Qwen's tokenizer adds no BOS, so an empty prompt is no tokens: prefill would predict from position -1."""
    qwen = load_hf_tokenizer(str(REPO / "tests" / "fixtures" / "hf" / "qwen3" / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"^prompt encodes to no tokens"):
        generate.encode_prompts([""], qwen, 32, 4)
    with pytest.raises(ConfigError, match=r"^prompt 2 encodes to no tokens"):
        generate.encode_prompts(["a", ""], qwen, 32, 4)
    assert generate.encode_prompts([""], ByteTokenizer(), 32, 4) == [[ByteTokenizer().bos_id]]  # BOS: one token
