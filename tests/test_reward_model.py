"""Reward models (objective=reward_model) against TRL's RewardTrainer (tests/fixtures/preference, made by
tools/make_preference_fixtures.py with TRL 1.16): the qwen3 fixture as a sequence-classification model (its score
head drawn by TRL's script) gives TRL's Bradley-Terry loss, logged metrics and every gradient within 1e-5 on the
fixture's pairs, packed into rows as the preference reader packs them, on one device and under fsdp=4 x tensor=2;
the reward model converts from and to Hugging Face's Qwen3ForSequenceClassification bit for bit (its config.yml
says objective=reward_model); and a fresh run through `maxshard.train` learns to score the chosen style above the
other. What remains of the issue: GRPO reading a trained reward model as its reward.

The fixture's reward model is a Hugging Face checkpoint written here: the policy's config.json as a
Qwen3ForSequenceClassification with one label, its tensors and the stored score.weight. TRL's gradients come in
the same way, beside that config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import max_relative_difference
from safetensors.numpy import load_file, save_file
from test_convert import read_all, start_from_converted
from test_objectives import CASES, FIXTURE, LAYOUTS, LENGTH, POLICY, TOLERANCE, pair_rows, style_pairs

from maxshard import config, data, train
from maxshard.convert import __main__ as convert_cli
from maxshard.convert import hf_config
from maxshard.errors import ConfigError
from maxshard.training.step import mesh_context

WANT = CASES["reward"]
# TRL's metric names -> maxshard's
METRICS = {"accuracy": "rewards/accuracy", "margin": "rewards/margin", "mean_reward": "rewards/mean"}


def reward_checkpoint(directory: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A Qwen3ForSequenceClassification directory (one label) of the policy's config.json and `tensors`."""
    directory.mkdir()
    cfg = json.loads((POLICY / "config.json").read_text())
    cfg |= {"architectures": ["Qwen3ForSequenceClassification"], "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0}}
    (directory / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward")
    score = np.asarray(WANT["score_weight"], np.float32)[None, :]
    model = reward_checkpoint(root / "model_hf", {**load_file(POLICY / "model.safetensors"), "score.weight": score})
    grads = reward_checkpoint(root / "grads_hf", load_file(FIXTURE / "reward_grads.safetensors"))
    for name, source in (("model", model), ("grads", grads)):
        assert convert_cli.main(["from_hf", str(source), str(root / name)]) == 0
    return {"model_hf": model, "model": root / "model", "grads": root / "grads"}


def step(imported, tmp_path, layout: str) -> tuple[float, dict, object]:
    """(loss, metrics, gradients per pair) of maxshard's reward-model step on the fixture's pairs."""
    knobs, devices = LAYOUTS[layout]
    trainer, state = start_from_converted(imported["model"], tmp_path / layout, f"max_target_length={LENGTH}",
                                          *knobs, num_devices=devices)
    batch = jax.device_put(pair_rows(), trainer.batch_shardings(data.batch_sharding(trainer.cfg, trainer.mesh)))
    with mesh_context(trainer.mesh, trainer.rules):
        grads, sums = jax.jit(trainer._grads)(state.params, batch, None, None)
        metrics = jax.jit(trainer.objective.metrics)(sums)
    pairs = float(sums["weight_sum"])
    return (float(sums["loss_sum"]) / pairs, jax.device_get(metrics),
            jax.tree.map(lambda g: np.asarray(g) / pairs, jax.device_get(grads)))


@pytest.fixture(scope="module")
def one_device(imported, tmp_path_factory):
    return step(imported, tmp_path_factory.mktemp("one_device"), "one_device")


def test_loss_metrics_and_gradients_equal_trl(imported, one_device, tmp_path):
    loss, metrics, grads = one_device
    assert len(CASES["pairs"]) == 4 and WANT["metrics"]["accuracy"] not in (0.0, 1.0)  # pairs both ways
    assert loss == pytest.approx(WANT["loss"], abs=TOLERANCE)
    for trl_name, name in METRICS.items():
        assert float(metrics[name]) == pytest.approx(WANT["metrics"][trl_name], abs=TOLERANCE), name
    chosen, rejected = np.mean(WANT["rewards_chosen"]), np.mean(WANT["rewards_rejected"])
    assert (float(metrics["rewards/chosen"]), float(metrics["rewards/rejected"])) == pytest.approx(
        (chosen, rejected), abs=TOLERANCE)
    trl_grads = start_from_converted(imported["grads"], tmp_path / "grads", f"max_target_length={LENGTH}")[1].params
    assert max_relative_difference(grads, trl_grads) < TOLERANCE


def test_fsdp_x_tensor_equals_one_device(imported, one_device, tmp_path):
    loss, metrics, grads = step(imported, tmp_path, "fsdp4_tensor2")
    assert loss == pytest.approx(one_device[0], abs=1e-6)
    assert float(metrics["rewards/accuracy"]) == float(one_device[1]["rewards/accuracy"])
    assert max_relative_difference(grads, one_device[2]) < TOLERANCE


def test_round_trip_is_a_sequence_classification_model_bit_for_bit(imported, tmp_path):
    out = tmp_path / "hf"
    assert convert_cli.main(["to_hf", str(imported["model"] / "checkpoints" / "0"), str(out)]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3ForSequenceClassification"] and len(exported["id2label"]) == 1
    source, back = read_all(imported["model_hf"]), read_all(out)
    assert sorted(back) == sorted(source) and "score.weight" in back
    assert all(back[name].tobytes() == array.tobytes() for name, array in source.items())


def test_mistakes_are_one_line():
    cfg = json.loads((POLICY / "config.json").read_text())
    with pytest.raises(ConfigError, match="one label"):
        hf_config.model_keys({**cfg, "architectures": ["Qwen3ForSequenceClassification"],
                              "id2label": {"0": "bad", "1": "good"}})
    base = str(Path(__file__).resolve().parent.parent / "configs" / "base.yml")
    for keys, says in ((("objective=reward_model", "dataset_type=synthetic"), "needs score_head=true"),
                       (("score_head=true",), "score_head=true with objective=lm"),
                       (("objective=reward_model", "score_head=true", "dataset_type=synthetic",
                         "ici_pipeline_parallelism=2"), "does not run under a pipeline")):
        with pytest.raises(ConfigError, match=says):
            config.finalize(config.parse([base, "model_name=tiny", *keys]), 2)




def test_a_run_through_the_cli_learns_to_score_the_chosen_style_higher(tmp_path):
    """A fresh tiny reward model (its score head initialised by the run) on preference JSONL through
    `maxshard.train`: rewards/accuracy reaches 0.95 with a positive margin."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in style_pairs(64, seed=1)))
    argv = ["configs/base.yml", "model_name=tiny", "objective=reward_model", "score_head=true",
            "dataset_type=preference", f"dataset_path={pairs}", "learning_rate=3e-3", "steps=30",
            "checkpoint_period=30", f"base_output_directory={tmp_path}", "run_name=rm", "log_period=1",
            "eval_period=0", "max_target_length=64", "warmup_steps_fraction=0.1", "eval_fraction=0",
            "enable_tensorboard=false"]
    assert train.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rewards/accuracy" in r]
    assert len(steps) == 30
    assert steps[-1]["rewards/accuracy"] >= 0.95 and steps[-1]["rewards/margin"] > 0, steps[-1]
