"""Hugging Face import and export: logits equal transformers', the round trip is bit for bit, layouts reshard.

The fixtures under tests/fixtures/hf/ were written by tools/make_hf_fixtures.py with transformers (never installed
here): a Llama with grouped-query heads, head_dim != hidden / heads, Llama-3 RoPE scaling, bfloat16 and a sharded
index, whose tokenizer adds no BOS; a float32 Mistral; a tied-embedding Llama whose config.json uses the
transformers 4.x RoPE spelling; a tied Qwen3 (q/k norms, no BOS, two EOS ids); a Qwen3-MoE (top-2 of 4 experts,
norm_topk_prob false) and a Mixtral (top-2 of 4, a tokenizer that adds BOS). Each comes with the logits
transformers computed in float32 for fixed token ids; those with a tokenizer also with transformers' greedy
tokens for a prompt (generate.json).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
import cli_processes
from helpers import mesh_for
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from maxshard import config, generate, train
from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint import manager as checkpoint
from maxshard.checkpoint import orbax_io
from maxshard.convert import __main__ as cli
from maxshard.convert import families, hf_config, layout, safetensors_io
from maxshard.convert.locate import locate
from maxshard.data import pipeline
from maxshard.data.tokenizer import ByteTokenizer, load_hf_tokenizer, make_tokenizer, resolve_vocab
from maxshard.errors import ConfigError
from maxshard.spec.model_config import model_fields
from maxshard.run import loading
from maxshard.training.step import Trainer, mesh_context

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "hf"
NAMES = ("llama_gqa", "mistral", "llama_tied", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2")
GENERATING = ("llama_gqa", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")  # the fixtures with a tokenizer and generate.json
APPLY = ("dataset_type=synthetic", "dtype=float32", "weight_dtype=float32", "enable_tensorboard=false")
TOLERANCE = 1e-4


def convert_all(tmp_path_factory: pytest.TempPathFactory, names: tuple[str, ...]) -> dict[str, Path]:
    """Each named fixture converted once by the CLI: {name: OUT_DIR}."""
    root = tmp_path_factory.mktemp("converted")
    for name in names:
        assert cli.main(["from_hf", str(FIXTURES / name), str(root / name)]) == 0
    return {name: root / name for name in names}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return convert_all(tmp_path_factory, NAMES)


def start_from_converted(out_dir: Path, run_dir: Path, *extra: str, num_devices: int = 1) -> tuple[Trainer, Any]:
    """A training run's start from the converted config.yml: its load_parameters_path seeds the params.

    Two fixtures ship no tokenizer, and the byte tokenizer (259 ids) does not fit their 128-token vocabulary, so
    they borrow llama_gqa's (128 ids) to load like a run."""
    argv = [str(out_dir / "config.yml"), *APPLY, f"per_device_batch_size={8 / num_devices}",
            f"base_output_directory={run_dir}", *extra]
    if not (out_dir / "hf" / "tokenizer.json").exists():
        argv.append(f"tokenizer_path={FIXTURES / 'llama_gqa' / 'tokenizer.json'}")
    cfg = loading.complete(config.finalize(config.parse(argv), num_devices))
    trainer = Trainer(cfg, mesh_for(cfg))
    with checkpoint.Checkpoints(cfg, trainer) as ckpt:
        state, _ = ckpt.restore_or_init()
    return trainer, state


def apply(trainer: Trainer, params: Any, tokens: np.ndarray) -> np.ndarray:
    """Logits for `tokens` at positions 0..n-1, one segment, on the trainer's mesh."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    with mesh_context(trainer.mesh, trainer.rules):
        out = jax.jit(trainer.model.apply)({"params": params}, jnp.asarray(tokens), jnp.ones_like(positions), positions)
    return np.asarray(out)


def reference(name: str) -> tuple[np.ndarray, np.ndarray]:
    return np.load(FIXTURES / name / "tokens.npy"), np.load(FIXTURES / name / "logits.npy")


LAYOUTS = {"one_device": ((), 1), "fsdp8": (("ici_fsdp_parallelism=8",), 8),
           "fsdp4xtensor2": (("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"), 8),
           "expert4xfsdp2": (("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"), 8)}


def starter(converted: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, *keys: str) -> Any:
    """start(name, layout) -> (trainer, state) of a converted fixture on a LAYOUTS layout (with `keys`), each
    started once (compiling is the slow part)."""
    cache: dict[tuple[str, str], tuple[Trainer, Any]] = {}

    def start(name: str, layout: str) -> tuple[Trainer, Any]:
        if (name, layout) not in cache:
            extra, devices = LAYOUTS[layout]
            run_dir = tmp_path_factory.mktemp(f"run_{name}_{layout}")
            cache[name, layout] = start_from_converted(converted[name], run_dir, *extra, *keys, num_devices=devices)
        return cache[name, layout]

    return start


@pytest.fixture(scope="module")
def started(converted, tmp_path_factory) -> Any:
    """started(name, layout) -> (trainer, state), each started once for the module."""
    return starter(converted, tmp_path_factory)


# --------------------------------------------------------------------------------------------- import


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(started, name):
    trainer, state = started(name, "one_device")
    assert int(state.step) == 0 and trainer.cfg.load_parameters_path.endswith(f"{name}/checkpoints/0")
    tokens, want = reference(name)
    got = apply(trainer, state.params, tokens)
    assert np.std(want) > 0.5  # logits of a useful scale: a wrong RoPE or head mapping moves them by far more
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_llama3_scaling_is_needed_for_those_logits(started):
    """The fixture is sensitive to RoPE scaling: without it the same weights give clearly different logits."""
    trainer, state = started("llama_gqa", "one_device")
    unscaled = Trainer(loading.replace(trainer.cfg, rope_scaling_type="none"), trainer.mesh)
    tokens, want = reference("llama_gqa")
    assert np.max(np.abs(apply(unscaled, state.params, tokens) - want)) > 100 * TOLERANCE


@pytest.mark.parametrize("layout", ["fsdp8", "fsdp4xtensor2"])
def test_restores_sharded_with_the_same_logits(started, layout):
    trainer, state = started("llama_gqa", layout)
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings)):
        assert leaf.sharding == want
    kernel = state.params["decoder"]["layers"]["attention"]["query"]["kernel"]  # [layers, embed, heads, head_dim]
    assert kernel.dtype == jnp.float32 and len(kernel.sharding.device_set) == 8
    assert kernel.addressable_shards[0].data.size < kernel.size  # really sharded, not replicated
    tokens, want = reference("llama_gqa")
    got = apply(trainer, state.params, np.tile(tokens, (4, 1)))  # a batch of 8 divides every batch layout
    np.testing.assert_allclose(got, np.tile(want, (4, 1, 1)), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(("name", "layout"), [("qwen3", "fsdp4xtensor2"), ("qwen3_moe", "fsdp4xtensor2"),
                                              ("qwen3_moe", "expert4xfsdp2"), ("mixtral", "fsdp4xtensor2"),
                                              ("mixtral", "expert4xfsdp2"), ("deepseek_v3", "fsdp4xtensor2"),
                                              ("deepseek_v3", "expert4xfsdp2")])
def test_families_restore_sharded_with_the_same_logits(started, name, layout):
    """Imported Qwen3 / Qwen3-MoE / Mixtral under tensor and expert parallelism compute transformers' logits;
    the experts arrive stacked on the dimension expert parallelism shards."""
    trainer, state = started(name, layout)
    assert trainer.cfg.capacity_factor == -1 or name == "qwen3"  # imported MoE routes dropless
    layers = state.params["decoder"]["layers"]
    if name != "qwen3":
        wi_0 = layers["layer_0"]["moe"]["wi_0"]  # [layers, experts, embed, mlp]
        experts = wi_0.shape[1]
        assert wi_0.shape[:2] == ((1, 8) if name == "deepseek_v3" else (2, 4))  # DeepSeek: a dense layer first
        local = wi_0.addressable_shards[0].data.shape  # each device holds 1/4 of the experts under expert=4
        assert local[1] == (experts // 4 if layout == "expert4xfsdp2" else experts)
        assert wi_0.addressable_shards[0].data.size < wi_0.size
    tokens, want = reference(name)
    got = apply(trainer, state.params, np.tile(tokens, (4, 1)))
    np.testing.assert_allclose(got, np.tile(want, (4, 1, 1)), rtol=0, atol=TOLERANCE)


def test_qk_norm_and_router_weights_are_needed_for_those_logits(started):
    """The fixtures are sensitive to what the new model keys switch: without q/k norms, or with the top-k weights
    renormalised where Qwen3-MoE keeps the softmax's, the same weights give clearly different logits."""
    trainer, state = started("qwen3_moe", "one_device")
    tokens, want = reference("qwen3_moe")
    renormalized = Trainer(loading.replace(trainer.cfg, moe_renormalize_top_k=True), trainer.mesh)
    assert np.max(np.abs(apply(renormalized, state.params, tokens) - want)) > 100 * TOLERANCE
    plain, plain_state = started("qwen3", "one_device")
    params = dict(plain_state.params)
    layers = dict(params["decoder"]["layers"])
    attention = {k: v for k, v in layers["attention"].items() if not k.endswith("_norm")}
    params["decoder"] = {**params["decoder"], "layers": {**layers, "attention": attention}}
    no_norm = Trainer(loading.replace(plain.cfg, qk_norm=False), plain.mesh)
    tokens, want = reference("qwen3")
    assert np.max(np.abs(apply(no_norm, params, tokens) - want)) > 100 * TOLERANCE


# --------------------------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize(("name", "bos", "stops"), [("llama_gqa", None, (2,)), ("qwen3", None, (2, 0)),
                                                    ("mixtral", 1, (2,))])
def test_documents_and_prompts_start_as_the_tokenizer_says(name, bos, stops):
    """BOS only where the tokenizer's template adds one, EOS ends every document, prompts as tokenizer(prompt)
    encodes them, generation stops at every EOS id of generation_config.json."""
    tok = load_hf_tokenizer(str(FIXTURES / name / "tokenizer.json"))
    assert tok.start_id == bos and tok.stop_ids == stops
    want = json.loads((FIXTURES / name / "generate.json").read_text())
    assert tok.encode_prompt(want["prompt"]) == want["input_ids"]  # what transformers' tokenizer(prompt) gave
    text = "the lazy dog"
    body = tok.encode(text)
    pair = pipeline._document_pair(text, tok, "test")  # what the training pipeline makes of a document
    start = [] if bos is None else [bos]
    assert pair["inputs"].tolist() == start + body and pair["targets"].tolist() == (start + body)[1:] + [tok.eos_id]
    assert ByteTokenizer().encode_prompt("a") == [ByteTokenizer().bos_id, ord("a") + 3]  # byte-level: as before


@pytest.mark.parametrize("name", GENERATING)
def test_greedy_generation_gives_transformers_tokens(converted, name, tmp_path):
    """from_hf -> maxshard.generate temperature=0 gives the tokens of model.generate(tokenizer(prompt)), and
    stops where transformers stopped (Mixtral's fixture ends at EOS before max_new_tokens)."""
    want = json.loads((FIXTURES / name / "generate.json").read_text())
    out = tmp_path / "out.jsonl"
    argv = [str(converted[name] / "config.yml"), f"base_output_directory={tmp_path}", f"prompt={want['prompt']}",
            f"max_new_tokens={want['max_new_tokens']}", "temperature=0", f"generate_output={out}"]
    assert generate.main(argv) == 0
    row = json.loads(out.read_text())
    assert row["tokens"] == want["new_tokens"]
    if name == "mixtral":
        assert len(row["tokens"]) < want["max_new_tokens"] and row["tokens"][-1] == 2


def test_fine_tunes_an_imported_moe_dropless_with_expert_parallelism(converted, tmp_path, capsys):
    """A few steps of maxshard.train from the converted Qwen3-MoE, on text through its own tokenizer, with the
    experts sharded over expert=4: the loss falls and nothing is dropped."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        (data / f"doc{i}.txt").write_text("the quick brown fox jumps over the lazy dog. " * (i + 2))
    argv = [str(converted["qwen3_moe"] / "config.yml"), f"dataset_path={data}", f"base_output_directory={tmp_path}",
            "run_name=ft", "steps=4", "log_period=1", "eval_period=0", "max_target_length=32",
            "per_device_batch_size=1", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "learning_rate=1e-2",
            "warmup_steps_fraction=0", "enable_tensorboard=false", "eval_fraction=0"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert "expert=4" in out and "starting from step 0" in out
    records = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["moe/dropped_fraction"] == 0 for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    exported = tmp_path / "hf"  # and the fine-tuned experts go back out as Qwen3-MoE tensors
    assert cli.main(["to_hf", str(tmp_path / "ft" / "checkpoints" / "4"), str(exported), "--dtype", "bfloat16"]) == 0
    back, source = read_all(exported), read_all(FIXTURES / "qwen3_moe")
    assert sorted(back) == sorted(source) and json.loads((exported / "config.json").read_text())["architectures"] == [
        "Qwen3MoeForCausalLM"]
    assert any(back[n].tobytes() != source[n].tobytes() for n in source if ".experts." in n)  # trained, not copied


def test_converted_keys_are_model_config_fields():
    """Every key config.yml writes and to_hf reads back is a ModelConfig field, so cfg.model carries it."""
    assert set(layout.MODEL_KEYS) <= set(model_fields())


def test_config_yml_is_a_training_config(converted):
    text = (converted["llama_gqa"] / "config.yml").read_text()
    assert f'base_config: "{REPO}/configs/base.yml"' in text
    cfg = config.parse([str(converted["llama_gqa"] / "config.yml")])
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.emb_dim, cfg.mlp_dim) == (4, 2, 8, 64, 96)
    assert (cfg.rope_scaling_type, cfg.rope_max_timescale, cfg.rope_original_max_position) == ("llama3", 5e5, 32)
    assert cfg.norm_epsilon == 1e-5 and not cfg.logits_via_embedding
    assert cfg.tokenizer_path == str(converted["llama_gqa"] / "hf" / "tokenizer.json")
    assert resolve_vocab(config.finalize(cfg, 8)).vocab_size == 128  # the model's own tokenizer fits its vocab
    assert make_tokenizer(cfg).encode("the lazy dog")  # and reads
    tied = config.parse([str(converted["llama_tied"] / "config.yml")])
    assert tied.logits_via_embedding and tied.rope_scaling_type == "llama3"  # the 4.x spelling, read the same


# --------------------------------------------------------------------------------------------- export


def read_all(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face directory, through the converter's reader (index or single file)."""
    with safetensors_io.Source(str(directory)) as source:
        return {name: source.read(info) for name, info in source.tensors.items()}


def family_fixtures(source: Path, *extra: str) -> tuple[Any, Any]:
    """Module fixtures (converted, one_device) of one family's fixture directory: its from_hf output, and that
    output started as a one-device run (`extra` keys on top), for the family test files."""

    @pytest.fixture(scope="module")
    def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
        out = tmp_path_factory.mktemp("converted") / source.name
        assert cli.main(["from_hf", str(source), str(out)]) == 0
        return out

    @pytest.fixture(scope="module")
    def one_device(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, Any]:
        return start_from_converted(converted, tmp_path_factory.mktemp("run"), *extra)

    return converted, one_device


def layout_matches_one_device(converted: Path, one_device: tuple[Trainer, Any], source: Path, tmp_path: Path,
                              *keys: str, atol: float = 1e-5) -> None:
    """The converted step restored on 8 devices under the layout in `keys`: the logits of 8 rows of the fixture's
    tokens equal the one-device run's within `atol` and transformers' within TOLERANCE."""
    trainer, state = start_from_converted(converted, tmp_path, *keys, num_devices=8)
    tokens, want = np.load(source / "tokens.npy"), np.load(source / "logits.npy")
    got = apply(trainer, state.params, np.tile(tokens, (4, 1)))  # a batch of 8 rows over the 8 devices
    single = apply(one_device[0], one_device[1].params, tokens)
    np.testing.assert_allclose(got, np.tile(single, (4, 1, 1)), rtol=0, atol=atol)
    np.testing.assert_allclose(got, np.tile(want, (4, 1, 1)), rtol=0, atol=TOLERANCE)


def training_keys(out_dir: Path) -> dict[str, Any]:
    """A converted config.yml's keys but its paths."""
    keys = yaml.safe_load((out_dir / "config.yml").read_text())
    return {k: v for k, v in keys.items() if not k.endswith("_path") and k != "base_config"}


def logits_match_transformers(one_device: tuple[Trainer, Any], source: Path) -> None:
    """The one-device run's logits of the fixture's tokens are transformers' within TOLERANCE (of a useful scale)."""
    trainer, state = one_device
    tokens, want = np.load(source / "tokens.npy"), np.load(source / "logits.npy")
    assert np.std(want) > 0.5
    np.testing.assert_allclose(apply(trainer, state.params, tokens), want, rtol=0, atol=TOLERANCE)


def greedy_tokens_equal_transformers(converted: Path, source: Path, tmp_path: Path, *extra: str) -> None:
    """from_hf -> maxshard.generate temperature=0 gives the fixture's generate.json tokens (transformers' greedy
    ones, decoded one at a time from the KV cache)."""
    want = json.loads((source / "generate.json").read_text())
    out = tmp_path / "out.jsonl"
    argv = [str(converted / "config.yml"), f"base_output_directory={tmp_path}", f"prompt={want['prompt']}",
            f"max_new_tokens={want['max_new_tokens']}", "temperature=0", f"generate_output={out}", *extra]
    assert generate.main(argv) == 0
    assert json.loads(out.read_text())["tokens"] == want["new_tokens"]


def exports_bit_for_bit(converted: Path, source: Path, tmp_path: Path) -> tuple[dict, dict]:
    """to_hf of the converted step writes every tensor of `source` with its dtype and bytes; (the exported
    config.json, the source's), whose model keys agree."""
    out = tmp_path / "hf"
    assert cli.main(["to_hf", str(converted / "checkpoints" / "0"), str(out)]) == 0
    original, back = read_all(source), read_all(out)
    assert sorted(back) == sorted(original)
    for tensor, array in original.items():
        assert back[tensor].dtype == array.dtype and back[tensor].tobytes() == array.tobytes(), tensor
    exported, config_json = json.loads((out / "config.json").read_text()), hf_config.read(str(source))
    assert hf_config.model_keys(exported) == hf_config.model_keys(config_json)
    return exported, config_json


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bit_identical(converted, name, tmp_path):
    out = tmp_path / "hf"
    assert cli.main(["to_hf", str(converted[name] / "checkpoints" / "0"), str(out), "--max-shard-size", "60KB"]) == 0
    source, back = read_all(FIXTURES / name), read_all(out)
    assert sorted(back) == sorted(source)
    for tensor, array in source.items():
        assert back[tensor].dtype == array.dtype and back[tensor].shape == array.shape, tensor
        assert back[tensor].tobytes() == array.tobytes(), tensor
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()  # 131 KB > 60 KB: sharded
    index = json.loads((out / "model.safetensors.index.json").read_text())
    whole = {}
    for shard in shards:  # each shard is a whole safetensors file, with the header metadata transformers expects
        with safe_open(str(out / shard), "numpy") as f:
            assert f.metadata() == {"format": "pt"}
        whole.update({name: (shard, array) for name, array in load_file(str(out / shard)).items()})
    assert {name: shard for name, (shard, _) in whole.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(array.nbytes for _, array in whole.values())
    for shard in shards:  # at most --max-shard-size of tensor bytes in a file (a larger tensor alone in its own)
        held = [array.nbytes for file, array in whole.values() if file == shard]
        assert sum(held) <= 60_000 or len(held) == 1, (shard, held)
    exported, original = json.loads((out / "config.json").read_text()), hf_config.read(str(FIXTURES / name))
    assert hf_config.model_keys(exported) == hf_config.model_keys(original)
    for field in ("architectures", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert exported[field] == original[field], field
    has_tokenizer = (FIXTURES / name / "tokenizer.json").exists()
    assert (out / "tokenizer.json").exists() == has_tokenizer


def test_chunked_writes_round_trip(tmp_path, monkeypatch):
    """With chunks of ~1 KB every parameter is written in many blocks of Hugging Face rows, the last one ragged."""
    monkeypatch.setattr(orbax_io, "CHUNK_BYTES", 1000)
    assert cli.main(["from_hf", str(FIXTURES / "llama_gqa"), str(tmp_path / "ms")]) == 0
    zarray = json.loads((tmp_path / "ms/checkpoints/0/state/params.token_embed.embedding/.zarray").read_text())
    assert zarray["chunks"] == [7, 64] and zarray["shape"] == [128, 64]  # 7 rows x 64 x 2 bytes <= 1000
    query = tmp_path / "ms/checkpoints/0/state/params.decoder.layers.attention.query.kernel/.zarray"
    assert json.loads(query.read_text())["chunks"] == [1, 64, 1, 8]  # one layer, one head (q_proj rows 8h..8h+7)
    assert cli.main(["to_hf", str(tmp_path / "ms/checkpoints/0"), str(tmp_path / "hf")]) == 0
    source, back = read_all(FIXTURES / "llama_gqa"), read_all(tmp_path / "hf")
    assert all(back[name].tobytes() == array.tobytes() for name, array in source.items())



def test_export_takes_the_family_from_the_config_it_writes_and_notes_dropping(converted, tmp_path, capsys,
                                                                             monkeypatch):
    """A template naming neither architectures nor model_type exports as the family the model keys pick (the family
    of the tensors is the one config.json names); an MoE trained with token dropping exports with one note line on
    stderr, since transformers' families route dropless."""
    template = tmp_path / "template"
    template.mkdir()
    fields = hf_config.read(str(FIXTURES / "qwen3_moe"))
    (template / "config.json").write_text(json.dumps({k: v for k, v in fields.items()
                                                      if k not in ("architectures", "model_type")}))
    step_dir = str(converted["qwen3_moe"] / "checkpoints" / "0")
    assert cli.main(["to_hf", step_dir, str(tmp_path / "dropless"), "--template", str(template)]) == 0
    assert "note:" not in capsys.readouterr().err  # converted: dropless already
    assert json.loads((tmp_path / "dropless" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    source = read_all(FIXTURES / "qwen3_moe")
    assert {n: a.tobytes() for n, a in read_all(tmp_path / "dropless").items()} == {
        n: a.tobytes() for n, a in source.items()}
    saved = checkpoint_format.read_config
    monkeypatch.setattr(checkpoint_format, "read_config", lambda d: {**saved(d), "capacity_factor": 1.25})
    assert cli.main(["to_hf", step_dir, str(tmp_path / "dropping")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("note: trained with capacity_factor=1.25") and err[0].endswith(
        "Qwen3MoeForCausalLM routes dropless, so the export computes dropless routing")

def test_single_file_export_reads_with_safetensors(converted, tmp_path):
    out = tmp_path / "hf"
    assert cli.main(["to_hf", str(converted["mistral"] / "checkpoints" / "0"), str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    source = read_all(FIXTURES / "mistral")
    with safe_open(str(out / "model.safetensors"), "numpy") as f:  # float32: the package's numpy path reads it
        for tensor in f.keys():
            np.testing.assert_array_equal(f.get_tensor(tensor), source[tensor])


def test_to_hf_from_a_training_checkpoint(started, tmp_path):
    """A checkpoint the trainer saved (OCDBT, float32 weights, fsdp-sharded) exports; cast to bfloat16 it is the
    bfloat16 source again, bit for bit."""
    trainer, state = started("llama_gqa", "fsdp8")
    with checkpoint.Checkpoints(trainer.cfg, trainer) as ckpt:
        ckpt.save(1, state, {})
    step_dir = Path(trainer.cfg.checkpoint_dir) / "1"
    out = tmp_path / "hf"
    assert cli.main(["to_hf", str(step_dir), str(out), "--dtype", "bfloat16"]) == 0
    source, back = read_all(FIXTURES / "llama_gqa"), read_all(out)
    for tensor, array in source.items():
        assert back[tensor].tobytes() == array.tobytes(), tensor
    assert (out / "tokenizer.json").exists()  # found through the run's tokenizer_path (the converted hf/)


# --------------------------------------------------------------------------------------------- errors


def broken_copy(tmp_path: Path, change: dict[str, Any], remove: tuple[str, ...] = ()) -> Path:
    """The tied fixture (4.x spelling, one file) with config.json fields changed or removed."""
    directory = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama_tied", directory)
    cfg = json.loads((directory / "config.json").read_text())
    for key in remove:
        cfg.pop(key, None)
    cfg.update(change)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


@pytest.mark.parametrize(("change", "remove", "field"), [
    ({"architectures": ["GPT2LMHeadModel"]}, (), "architectures"),
    ({"attention_bias": True}, (), "attention_bias"),
    ({"mlp_bias": True}, (), "mlp_bias"),
    ({"hidden_act": "gelu"}, (), "hidden_act"),
    ({"sliding_window": 16}, (), "sliding_window"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, (), "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, ("rope_scaling",),
     "rope_parameters.rope_type"),
    ({"quantization_config": {"quant_method": "gptq"}}, (), "quantization_config"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unrepresentable_field_is_one_line_and_exit_2(tmp_path, capsys, change, remove, field):
    assert cli.main(["from_hf", str(broken_copy(tmp_path, change, remove)), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"maxshard: error: config.json: {field}=") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize(("fields", "want"), [
    ({"rope_theta": 1e6, "rope_scaling": None}, {"rope_max_timescale": 1e6, "rope_scaling_type": "none"}),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, {"rope_max_timescale": 1e6}),
    ({}, {"rope_max_timescale": 10000.0, "rope_scaling_type": "none"}),
    ({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 32, "low_freq_factor": 1, "high_freq_factor": 4,
                                          "original_max_position_embeddings": 8192}},  # the older "type" key
     {"rope_scaling_type": "llama3", "rope_scaling_factor": 32.0, "rope_original_max_position": 8192}),
])
def test_rope_settings_in_every_spelling(fields, want):
    keys = hf_config.rope_keys(fields)
    assert {k: keys[k] for k in want} == want


def test_layers_are_found_in_every_decoder_layout():
    """to_hf reads scanned [layers, ...], unrolled layers_<i> and pipelined [repeats, stages, per_stage, ...]."""
    param = next(p for p in layout.params_of(layout.model_config(
        {"vocab_size": 128, "num_layers": 4, "emb_dim": 64}), families.FAMILIES[0]) if p.path[-2] == "query")
    query = ("attention", "query", "kernel")
    fake = lambda arrays: SimpleNamespace(arrays=arrays)  # noqa: E731 - locate consults only .arrays
    shape = SimpleNamespace(shape=(2, 2, 1, 64, 4, 32))  # 2 repeats x 2 stages x 1 layer per stage
    assert locate(fake({("decoder", "layers", *query): None}), param, 3) == (("decoder", "layers", *query), (3,))
    unrolled = ("decoder", "layers_3", *query)
    assert locate(fake({unrolled: None}), param, 3) == (unrolled, ())
    piped = ("decoder", "pipeline", "layers", *query)
    assert locate(fake({piped: shape}), param, 3) == (piped, (1, 1, 0))  # layer 3 = repeat 1, stage 1
    with pytest.raises(ConfigError, match="has no params/decoder/layers/attention/query/kernel for layer 3"):
        locate(fake({}), param, 3)


def family_copy(tmp_path: Path, name: str, change: dict[str, Any]) -> Path:
    directory = tmp_path / name
    shutil.copytree(FIXTURES / name, directory)
    cfg = {**json.loads((directory / "config.json").read_text()), **change}
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


@pytest.mark.parametrize(("name", "change", "field"), [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("mixtral", {"num_local_experts": 1}, "num_local_experts"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                         "attention_factor": 1.5}}, "rope_parameters.attention_factor"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_family_fields_maxshard_cannot_compute_are_one_line(tmp_path, capsys, name, change, field):
    assert cli.main(["from_hf", str(family_copy(tmp_path, name, change)), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"maxshard: error: config.json: {field}=") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_qwen3_sliding_window_off_converts_and_families_export_without_a_template():
    """Qwen3 carries a sliding_window that applies only with use_sliding_window; without a template, to_hf picks
    the family that computes the model keys."""
    qwen = hf_config.read(str(FIXTURES / "qwen3"))
    keys = hf_config.model_keys({**qwen, "sliding_window": 4, "use_sliding_window": False})
    assert keys["qk_norm"] and keys["logits_via_embedding"] and keys["head_dim"] == 16
    for name in ("qwen3", "qwen3_moe", "mixtral", "llama_gqa"):
        source = hf_config.read(str(FIXTURES / name))
        keys = hf_config.model_keys(source)
        exported = hf_config.to_hf(keys, "float32")
        assert exported["architectures"] == source["architectures"] and hf_config.model_keys(exported) == keys


def test_sliding_window_as_long_as_the_context_converts():
    cfg = hf_config.read(str(FIXTURES / "mistral"))
    assert hf_config.model_keys({**cfg, "sliding_window": cfg["max_position_embeddings"]})["num_kv_heads"] == 2


def test_extra_or_missing_tensor_and_taken_out_dir(tmp_path, capsys):
    source = broken_copy(tmp_path, {})
    tensors = read_all(source)
    extra = {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
    (source / "model.safetensors").unlink()
    write(source, extra)
    assert cli.main(["from_hf", str(source), str(tmp_path / "a")]) == 2
    assert "tensor model.layers.0.self_attn.q_proj.bias has no place" in capsys.readouterr().err
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    write(source, tensors)
    assert cli.main(["from_hf", str(source), str(tmp_path / "a")]) == 2
    assert "tensor model.layers.1.mlp.up_proj.weight is missing" in capsys.readouterr().err
    assert cli.main(["from_hf", str(FIXTURES / "llama_tied"), str(tmp_path / "b")]) == 0
    capsys.readouterr()
    assert cli.main(["from_hf", str(FIXTURES / "llama_tied"), str(tmp_path / "b")]) == 2
    assert "already holds a converted model" in capsys.readouterr().err


def test_unreadable_or_integer_safetensors_is_one_line(tmp_path, capsys):
    source = broken_copy(tmp_path, {})
    tensors = read_all(source)
    data = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated: the library refuses to open it
    assert cli.main(["from_hf", str(source), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors is not a readable safetensors file" in err and err.count("\n") == 1, err
    write(source, {**tensors, "model.embed_tokens.weight": np.zeros((128, 64), np.int32)})
    assert cli.main(["from_hf", str(source), str(tmp_path / "a")]) == 2
    assert "tensor model.embed_tokens.weight has dtype I32" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def write(directory: Path, tensors: dict[str, np.ndarray]) -> None:
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_cli_exit_code_and_help(tmp_path):
    bad = broken_copy(tmp_path, {"architectures": ["Qwen2ForCausalLM"]})
    run = cli_processes.run([sys.executable, "-m", "maxshard.convert", "from_hf", str(bad), str(tmp_path / "o")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0
    assert run.stderr.startswith("maxshard: error: config.json: architectures=['Qwen2ForCausalLM']"), run.stderr
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
