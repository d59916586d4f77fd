"""LoRA (`lora_rank` > 0): adapters train on a frozen imported base, through the CLIs users run.

One module fixture imports the qwen3 fixture (from_hf) and fine-tunes it with LoRA on chat data whose user turns are
noise and whose assistant always gives one reply (tests/test_chat.py's set), through `maxshard.train`. The tests
then check what the issue asks of it: only the adapters trained and were saved, the export merges them (each
targeted matrix moved by a matrix of rank <= lora_rank, every other tensor the base's bit for bit), PEFT's adapter
files hold the same update, generation applies them, a resume reads the base again, and the layouts agree.
PEFT's own files (adapters it saved and the logits it computed) are compared in tests/test_peft.py; that PEFT
loads this run's adapter files as the merged model is checked by hand (tools/check_peft_export.py; torch and peft
never enter CI).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

from maxshard import config, data, generate, train
from maxshard.checkpoint import format as checkpoint_format
from maxshard.convert import __main__ as convert_cli
from maxshard.convert import hf_config, layout, names
from maxshard.convert import lora as convert_lora
from maxshard.errors import ConfigError
from maxshard.generation import inference
from maxshard.model import trainable
from maxshard.model.layers import pipeline
from maxshard.model.transformer import Transformer
from maxshard.observe.report import build_report
from maxshard.parallel import mesh as mesh_lib
from maxshard.parallel import sharding
from maxshard.planning.compiled import abstract_inputs
from maxshard.run import loading
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import max_relative_difference, mesh_for, tiny_config
from tests.test_chat import QWEN, REPLY, imported_sft_argv, template
from tests.test_convert import FIXTURES

RANK, ALPHA = 4, 8.0
TARGETS = ("q", "v", "o", "gate", "up", "down")  # all but k: a projection without adapters stays the base's
HF_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STEPS = 30


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(root, argv, metrics records) of a LoRA fine-tune of the imported qwen3 fixture."""
    root = tmp_path_factory.mktemp("lora")
    argv = imported_sft_argv(root, "lora", f"steps={STEPS}", "learning_rate=3e-2", "checkpoint_period=20",
                             f"lora_rank={RANK}", f"lora_alpha={ALPHA}", f"lora_targets={','.join(TARGETS)}")
    assert train.main(argv) == 0
    records = [json.loads(line) for line in (root / "lora" / "metrics.jsonl").read_text().splitlines()]
    return root, argv, records


def _step_dir(root: Path, step: int = STEPS) -> Path:
    return root / "lora" / "checkpoints" / str(step)


def test_lora_learns_the_reply_and_records_what_trains(lora_run):
    """The loss per assistant token falls near zero with only the adapters training; the startup record holds the
    trainable count (the adapters: rank x (in + out) per targeted matrix) and the LoRA settings."""
    _, _, records = lora_run
    startup = records[0]["startup"]
    assert startup["lora"] == {"rank": RANK, "alpha": ALPHA, "targets": list(TARGETS)}
    hf = json.loads((QWEN / "config.json").read_text())
    emb, heads, kv, head_dim = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    mlp, layers = hf["intermediate_size"], hf["num_hidden_layers"]
    per_layer = RANK * ((emb + heads * head_dim) + (emb + kv * head_dim) + (heads * head_dim + emb)
                        + 2 * (emb + mlp) + (mlp + emb))
    assert startup["trainable_param_count"] == layers * per_layer < startup["param_count"] / 10
    steps = [r for r in records if "loss" in r and "step" in r]
    assert steps[0]["loss"] > 1.0 and steps[-1]["loss"] < 0.05, [round(r["loss"], 3) for r in steps]


def test_checkpoint_holds_the_adapters_and_their_moments_only(lora_run):
    root, _, _ = lora_run
    tree = ocp.PyTreeCheckpointHandler().metadata(_step_dir(root) / "state").tree
    leaves = [jax.tree_util.keystr(path, simple=True, separator=".")
              for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    params = [name for name in leaves if name.startswith("params.")]
    assert params and all(name.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for name in params)
    moments = [name for name in leaves if name.startswith("opt_state.")]
    assert moments and all(name.rsplit(".", 1)[-1] in ("lora_a", "lora_b", "count") for name in moments)


def _base_tensors() -> dict[str, np.ndarray]:
    return load_file(str(QWEN / "model.safetensors"))


def test_merged_export_moves_targets_by_low_rank_and_keeps_the_rest(lora_run, tmp_path):
    """to_hf of the LoRA step: each targeted matrix differs from the base by a matrix of rank <= lora_rank (and by
    something); every other tensor, k_proj included, is the base's bit for bit."""
    root, _, _ = lora_run
    assert convert_cli.main(["to_hf", str(_step_dir(root)), str(tmp_path / "hf")]) == 0
    merged, base = load_file(str(tmp_path / "hf" / "model.safetensors")), _base_tensors()
    assert merged.keys() == base.keys()
    for name, tensor in base.items():
        if name.split(".")[-2] not in HF_TARGETS:
            assert merged[name].dtype == tensor.dtype and np.array_equal(merged[name], tensor), name
            continue
        delta = merged[name].astype(np.float64) - tensor.astype(np.float64)
        singular = np.linalg.svd(delta, compute_uv=False)
        assert singular[0] > 1e-3, name  # the adapter moved it
        assert singular[RANK] < 1e-5 * singular[0], (name, singular[: RANK + 2])


def _logits(step_dir: Path, config_yml: Path, tokens: np.ndarray) -> np.ndarray:
    """The logits maxshard computes from a checkpoint step, loaded as generation loads it (a LoRA step: adapters
    on the base of its load_parameters_path)."""
    cfg = loading.load_run([str(config_yml), f"load_parameters_path={step_dir}", "dtype=float32"], check_fit=False)
    saved = checkpoint_format.read_config(str(step_dir))
    cfg = inference.with_saved_model(cfg, saved)
    on, rules = mesh_lib.build(cfg), sharding.flax_rules(cfg)
    params = inference.restore_params(str(step_dir), cfg, on, rules, saved.get("load_parameters_path", ""))
    with mesh_context(on, rules):
        return np.asarray(Transformer(cfg.model).apply({"params": params}, tokens, np.ones_like(tokens),
                                                       np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)))


def test_merged_export_computes_what_the_adapters_compute(lora_run, tmp_path):
    """The merged export, imported back, gives the logits of the base with the adapters applied (within float32
    rounding), and not the base's own."""
    root, _, _ = lora_run
    assert convert_cli.main(["to_hf", str(_step_dir(root)), str(tmp_path / "hf")]) == 0
    assert convert_cli.main(["from_hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    tokens = np.random.default_rng(0).integers(0, 100, (8, 16)).astype(np.int32)  # a row per device
    config_yml = root / "imported" / "config.yml"
    with_adapters = _logits(_step_dir(root), config_yml, tokens)
    merged = _logits(tmp_path / "back" / "checkpoints" / "0", config_yml, tokens)
    base = _logits(root / "imported" / "checkpoints" / "0", config_yml, tokens)
    np.testing.assert_allclose(merged, with_adapters, atol=1e-4)
    assert np.max(np.abs(base - with_adapters)) > 1e-2


class _RandomAdapters:
    """Adapters as `convert.lora.Adapters` reads them from a checkpoint, drawn at random for every MLA projection
    LoRA adapts (q: query_down and query; k: key; v: value; o: out), rank 2."""

    rank, alpha = 2, 3.0
    scale = alpha / rank
    targets = ("query_down", "query", "key", "value", "out")

    def has(self, param: layout.Param) -> bool:
        return param.path[-1] == "kernel" and param.path[-2] in self.targets and "attention" in param.path

    def pair(self, param: layout.Param, at: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        # crc32, not hash(): Python salts str hashes per process, and a test's draw must be the same on every run
        rng = np.random.default_rng(zlib.crc32(repr((param.path, at)).encode()))
        shape, num_in = param.layer_shape, param.entry.num_in
        return (rng.normal(size=(*shape[:num_in], self.rank)).astype(np.float32),
                rng.normal(size=(self.rank, *shape[num_in:])).astype(np.float32))

    def delta(self, param: layout.Param, at: tuple[int, ...]) -> np.ndarray:
        a, b = self.pair(param, at)
        return self.scale * np.tensordot(a, b, axes=1)


def test_adapters_only_export_of_latent_attention_is_the_merged_update(tmp_path):
    """DeepSeek-V3's latent attention (the fixture's q_a/q_b_proj, whose RoPE rows are reordered, and kv_b_proj,
    which holds each head's key rows then its value rows): for every module, PEFT's update alpha_m / r_m x lora_B
    @ lora_A from the written files equals the update the merged export adds in Hugging Face's layout. kv_b_proj's
    two adapters become one module of rank 4 (rank_pattern, alpha_pattern keep the scale)."""
    hf = hf_config.read(str(FIXTURES / "deepseek_v3"))
    family, params = hf_config.family(hf), layout.params_of(layout.model_config(hf_config.model_keys(hf)),
                                                            hf_config.family(hf))
    adapters = _RandomAdapters()
    convert_lora.export_adapters(adapters, params, family, str(tmp_path), "base")
    written = load_file(str(tmp_path / convert_lora.ADAPTER_FILE))
    settings = json.loads((tmp_path / convert_lora.ADAPTER_CONFIG).read_text())
    assert settings["rank_pattern"] == {"kv_b_proj": 4} and settings["alpha_pattern"] == {"kv_b_proj": 6.0}
    want: dict[str, list] = {}
    for param in (p for p in params if p.stacked and adapters.has(p)):
        for (layer,) in param.indices():
            want.setdefault(names.hf_name(param.entry, (layer,)), []).append((param.entry,
                                                                                adapters.delta(param, (layer,))))
    assert {n.split(".")[-2] for n in want} == {"q_a_proj", "q_b_proj", "kv_b_proj", "o_proj"}
    for name, parts in want.items():
        entry = parts[0][0]
        update = names.join_parts(entry, [d for _, d in sorted(parts, key=lambda p: p[0].part)]) if entry.part \
            else names.to_hf(entry, parts[0][1])
        stem, module = convert_lora.PEFT_PREFIX + name.removesuffix(".weight"), name.split(".")[-2]
        scale = settings["alpha_pattern"].get(module, settings["lora_alpha"]) / settings["rank_pattern"].get(
            module, settings["r"])
        got = scale * written[f"{stem}.lora_B.weight"] @ written[f"{stem}.lora_A.weight"]
        np.testing.assert_allclose(got, update, rtol=1e-5, atol=1e-5, err_msg=name)


def test_adapters_only_export_is_peft_s_layout_of_the_same_update(lora_run, tmp_path, monkeypatch):
    """--adapters-only writes PEFT's files; lora_alpha / r * lora_B @ lora_A of every module equals the merged
    export's change of that weight. (The merged export is given a relative step directory, as docs/fine-tuning.md's
    command.)"""
    root, _, _ = lora_run
    monkeypatch.chdir(root)
    assert convert_cli.main(["to_hf", str(_step_dir(root).relative_to(root)), str(tmp_path / "merged")]) == 0
    assert convert_cli.main(["to_hf", str(_step_dir(root)), str(tmp_path / "peft"), "--adapters-only"]) == 0
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == RANK
    assert adapter_config["lora_alpha"] == ALPHA and sorted(adapter_config["target_modules"]) == sorted(HF_TARGETS)
    adapters = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    merged, base = load_file(str(tmp_path / "merged" / "model.safetensors")), _base_tensors()
    assert len(adapters) == 2 * 2 * len(HF_TARGETS)  # A and B, two layers
    for key, lora_a in adapters.items():
        if ".lora_A." not in key:
            continue
        lora_b = adapters[key.replace(".lora_A.", ".lora_B.")]
        weight = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        update = ALPHA / RANK * lora_b.astype(np.float64) @ lora_a.astype(np.float64)
        assert lora_a.shape[0] == lora_b.shape[1] == RANK
        np.testing.assert_allclose(update, merged[weight].astype(np.float64) - base[weight], atol=1e-6)
    with pytest.raises(SystemExit):  # argparse: the flag belongs to to_hf only
        convert_cli.main(["from_hf", str(QWEN), str(tmp_path / "x"), "--adapters-only"])


def test_generation_applies_the_adapters(lora_run, tmp_path):
    """maxshard.generate from the LoRA step (its base read through the run's load_parameters_path) gives the reply."""
    root, argv, _ = lora_run
    prompt = template("chatml").render([{"role": "user", "content": "wobbly snarf glim"}], add_generation_prompt=True)
    out = tmp_path / "out.jsonl"
    trained = f"load_parameters_path={_step_dir(root)}"
    assert generate.main([*argv, trained, f"prompt={prompt}", "max_new_tokens=14", "temperature=0",
                          f"generate_output={out}"]) == 0
    assert json.loads(out.read_text())["completion"] == REPLY


def test_resume_reads_the_base_again_and_continues(lora_run, capsys):
    """A LoRA run restarted with more steps resumes from its own adapters (step 30) on the base of
    load_parameters_path; the loss stays where it was."""
    root, argv, records = lora_run
    assert train.main([a if not a.startswith("steps=") else f"steps={STEPS + 2}" for a in argv]) == 0
    assert f"resuming from step {STEPS}" in capsys.readouterr().out
    lines = (root / "lora" / "metrics.jsonl").read_text().splitlines()
    resumed = [json.loads(line) for line in lines[len(records):]]
    losses = [r["loss"] for r in resumed if "loss" in r and "step" in r]
    assert len(losses) == 2 and max(losses) < 0.05


def test_lora_keys_fail_in_one_line(tmp_path):
    base = ["configs/base.yml", "dataset_type=synthetic"]
    cases = [(["lora_rank=4", "lora_targets=q,x"], r"^lora_targets=\['q', 'x'\]: names from q, k, v, o, gate, up, down"),
             (["lora_rank=-1"], "^lora_rank must be >= 0"),
             (["lora_rank=4", "lora_targets=q,gate", "num_experts=4", "num_experts_per_tok=2"],
              "^lora_targets=.*gate.*MoE")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message) as info:
            config.load([*base, *overrides])
        assert "\n" not in str(info.value)
    argv = [*base, "lora_rank=4", f"base_output_directory={tmp_path}", "steps=1", "model_name=tiny"]
    with pytest.raises(ConfigError, match="^lora_rank=4 trains adapters on a frozen base: set load_parameters_path"):
        train.run(argv)


def test_the_base_is_the_one_the_adapters_were_trained_on(lora_run):
    """Resuming on another base, or starting a new run from a LoRA step (its adapters on its base) with other LoRA
    keys than the step's: one line each. (Starting from a LoRA step with its keys: tests/test_peft.py.)"""
    root, argv, _ = lora_run
    other = f"load_parameters_path={_step_dir(root, 20)}"  # a LoRA step: adapters only
    with pytest.raises(ConfigError, match="adapters in .* were trained on .*imported") as info:
        train.run([*argv, other])
    assert "\n" not in str(info.value)
    fresh = [a for a in argv if not a.startswith(("run_name=", "lora_rank="))] + ["run_name=lora_on_lora", other]
    with pytest.raises(ConfigError, match="^lora_rank=8: the adapters of load_parameters_path=.* have lora_rank=4"):
        train.run([*fresh, "lora_rank=8"])


def test_generation_with_the_training_command_samples_the_adapters(lora_run, tmp_path):
    """The training command line names the base as load_parameters_path; generation takes the run's own latest
    step (the adapters) on it, not the base alone."""
    root, argv, _ = lora_run
    prompt = template("chatml").render([{"role": "user", "content": "snarf"}], add_generation_prompt=True)
    out = tmp_path / "out.jsonl"
    assert generate.main([*argv, f"prompt={prompt}", "max_new_tokens=14", "temperature=0",
                          f"generate_output={out}"]) == 0
    assert json.loads(out.read_text())["completion"] == REPLY


def test_an_untied_head_has_no_adapter_pair():
    """The export asks each kernel whether the checkpoint holds its adapters: never the head (a global parameter
    whose lora_a would be looked up at the top level)."""
    from types import SimpleNamespace

    from maxshard.convert import layout, names
    from maxshard.convert.lora import Adapters

    query = ("decoder", "layers", "attention", "query")
    reader = SimpleNamespace(arrays={(*query, "lora_a"): None, (*query, "lora_b"): None})
    adapters = Adapters(reader, rank=4, alpha=8.0)
    entry = names.ATTENTION[1]
    assert adapters.has(layout.Param((*query, "kernel"), (2, 64, 4, 16), entry, stacked=True))
    assert not adapters.has(layout.Param(("logits", "kernel"), (64, 256), names.HEAD, stacked=False))


# ---------------------------------------------------------------- layouts and memory, through the Trainer


# An MoE model whose every other layer is dense: attention adapters everywhere, MLP adapters on the dense layers.
MOE = ("num_experts=4", "num_experts_per_tok=2", "moe_layer_interval=2", "capacity_factor=0")


def _lora_config(*layout: str, num_devices: int = 8):
    return tiny_config("lora_rank=4", "lora_targets=q,k,v,o,gate,up,down", "lora_alpha=8", *layout,
                       num_devices=num_devices)


def _train_lora(cfg, base, batches):
    """(losses, final adapters in the scanned layout, final state) of three steps from `base` (scanned) with fresh
    adapters."""
    trainer = Trainer(cfg, mesh_for(cfg))
    if cfg.model.pipeline is not None:
        base = pipeline.from_scanned(base, cfg.model.pipeline)
    base = jax.device_put(base, trainable.frozen_subset(trainer.state_shardings.params, cfg.model))
    state = trainer.state_from(base)
    step = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    adapters = jax.device_get(trainable.trainable_subset(state.params, cfg.model))
    return losses, adapters if cfg.model.pipeline is None else pipeline.to_scanned(adapters), state


def _one_device(*model: str):
    cfg = _lora_config(*model, "ici_fsdp_parallelism=1", num_devices=1)
    trainer = Trainer(cfg, mesh_for(cfg))
    base = jax.device_get(trainable.frozen_subset(trainer.init_state().params, cfg.model))
    it = data.make_input(cfg, trainer.mesh)
    batches = [jax.device_get(next(it)) for _ in range(3)]
    return base, batches, _train_lora(cfg, base, batches)


@pytest.fixture(scope="module")
def one_device():
    return _one_device()


@pytest.mark.parametrize("layout", [("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
                                    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"),
                                    (*MOE, "ici_expert_parallelism=2", "ici_fsdp_parallelism=4")],
                         ids=["fsdp4_tp2", "pipeline2_fsdp4", "moe_expert2_fsdp4"])
def test_lora_layout_equals_one_device(one_device, layout):
    """Adapters shard by their logical axes: fsdp=4 x tensor=2, a pipeline and an MoE model under expert
    parallelism train exactly as one device (losses 1e-5; adapters after three AdamW steps 5e-4, as
    tests/test_parity.py bounds Adam's magnification); the base never moves."""
    is_moe = MOE[0] in layout
    base, batches, (ref_losses, ref_adapters, _) = _one_device(*MOE) if is_moe else one_device
    cfg = _lora_config(*layout)
    losses, adapters, state = _train_lora(cfg, base, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_relative_difference(adapters, ref_adapters) < 5e-4
    assert ref_losses[-1] < ref_losses[0]
    if is_moe:  # attention adapters in every layer, MLP adapters on the dense layer, none on the experts
        names = [jax.tree_util.keystr(p, simple=True, separator="/")
                 for p, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]]
        assert any("layer_1/attention" in n for n in names) and any("layer_0/mlp" in n for n in names)
        assert not any("/moe/" in n for n in names)
    if cfg.model.pipeline is None:
        frozen = jax.device_get(trainable.frozen_subset(state.params, cfg.model))  # the base never moved
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(base)))


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nn.unbox(tree)))


def test_optimizer_state_and_gradients_are_the_adapters_alone():
    """The optimizer holds Adam's two moments of the adapters only, the planner counts gradients and moments of
    the adapters alone, and the compiled step's arguments are the whole parameters plus those moments."""
    cfg = _lora_config("ici_fsdp_parallelism=1", num_devices=1)
    trainer = Trainer(cfg, mesh_for(cfg))
    state = trainer.abstract_state
    adapter_bytes = _bytes(trainable.trainable_subset(state.params, cfg.model))
    assert _bytes(state.opt_state) == 2 * adapter_bytes + 8  # mu, nu and two int32 step counts (Adam, schedule)
    assert adapter_bytes < _bytes(state.params) / 10
    report = build_report(cfg, dict(trainer.mesh.shape), trainer.rules, state)
    assert report.gradient_bytes_per_device == adapter_bytes
    assert report.optimizer_bytes_per_device == _bytes(state.opt_state)
    batch = data.batch_sharding(cfg, trainer.mesh)
    compiled = trainer.jit_train_step(batch).lower(*abstract_inputs(trainer, batch)).compile()
    batch_bytes = 5 * cfg.global_batch_size * cfg.max_target_length * 4
    assert compiled.memory_analysis().argument_size_in_bytes == _bytes(state) + batch_bytes


def test_eval_scores_the_adapters_as_the_merged_export_scores(lora_run, tmp_path):
    """maxshard.eval of the LoRA step (adapters on the base of its load_parameters_path) gives the per-request
    log-likelihoods of its merged export imported back (which are not the base's:
    test_merged_export_computes_what_the_adapters_compute)."""
    pytest.importorskip("lm_eval")
    from maxshard import eval as eval_cli
    from tests.test_eval import TASKS_DIR, _numbers

    root, argv, _ = lora_run
    assert convert_cli.main(["to_hf", str(_step_dir(root)), str(tmp_path / "hf")]) == 0
    assert convert_cli.main(["from_hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    tasks = ("local_choice", "local_rolling")

    def loglikelihoods(name: str, *keys: str) -> list[float]:
        out = tmp_path / name
        ours = [f"tasks={','.join(tasks)}", f"eval_tasks_dir={TASKS_DIR}", "max_target_length=32",
                f"eval_output={out}", f"base_output_directory={out}", "eval_batch_size=4"]
        mine = {key.split("=")[0] for key in ours}
        assert eval_cli.run([k for k in keys if k.split("=")[0] not in mine] + ours, jax.devices()[:1]) == 0
        (directory,) = [p for p in out.iterdir() if p.is_dir() and p.name != "default"]
        rows = []
        for task in tasks:
            (samples,) = directory.glob(f"samples_{task}_*.jsonl")
            records = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
            rows += _numbers([r["resps"] for r in records])
        return rows

    with_adapters = loglikelihoods("lora", *argv, f"load_parameters_path={_step_dir(root)}")
    merged = loglikelihoods("merged", str(tmp_path / "back" / "config.yml"))
    assert with_adapters == pytest.approx(merged, abs=1e-4)
