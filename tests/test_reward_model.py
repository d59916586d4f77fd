"""Reward models (objective=reward_model) against TRL's RewardTrainer (tests/fixtures/preference, made by
tools/make_preference_fixtures.py with TRL 1.16): the qwen3 fixture as a sequence-classification model (its score
head drawn by TRL's script) gives TRL's Bradley-Terry loss, logged metrics and every gradient within 1e-5 on the
fixture's pairs, packed into rows as the preference reader packs them, on one device and under fsdp=4 x tensor=2;
the reward model converts from and to Hugging Face's Qwen3ForSequenceClassification bit for bit (its config.yml
says objective=reward_model); and a fresh run through `maxshard.train` learns to score the chosen style above the
other; GRPO rewarded by such a trained reward model (reward=model:STEP_DIR) scores each completion as the reward
model scored its training replies, and trains through the CLI.

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
from helpers import max_relative_difference, mesh_for
from safetensors.numpy import load_file, save_file
from test_convert import read_all, start_from_converted
from test_objectives import CASES, FIXTURE, LAYOUTS, LENGTH, POLICY, TOLERANCE, pair_rows, style_pairs

from maxshard import config, data, rewards, train
from maxshard.convert import __main__ as convert_cli
from maxshard.convert import hf_config
from maxshard.data.prompts import Prompt
from maxshard.data.tokenizer import make_tokenizer
from maxshard.errors import ConfigError
from maxshard.generation.reward_model import ModelReward
from maxshard.model.layers import pipeline
from maxshard.model.transformer import Transformer
from maxshard.objectives.reward import last_reply_position
from maxshard.parallel import sharding
from maxshard.run import loading
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
    """(loss, metrics, gradients per pair, in the scanned layout) of maxshard's reward-model step on the fixture's
    pairs."""
    knobs, devices = LAYOUTS[layout]
    trainer, state = start_from_converted(imported["model"], tmp_path / layout, f"max_target_length={LENGTH}",
                                          *knobs, num_devices=devices)
    batch = jax.device_put(pair_rows(), trainer.batch_shardings(data.batch_sharding(trainer.cfg, trainer.mesh)))
    with mesh_context(trainer.mesh, trainer.rules):
        grads, sums = jax.jit(trainer._grads)(state.params, batch, None, None)
        metrics = jax.jit(trainer.objective.metrics)(sums)
    pairs, grads = float(sums["weight_sum"]), jax.device_get(grads)
    if trainer.cfg.model.pipeline is not None:  # [repeats, stages, layers per stage, ...] -> [layers, ...]
        grads = pipeline.to_scanned(grads)
    return (float(sums["loss_sum"]) / pairs, jax.device_get(metrics), jax.tree.map(lambda g: np.asarray(g) / pairs,
                                                                                   grads))


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


@pytest.mark.parametrize("layout", ["fsdp4_tensor2", "pipeline2_fsdp4", "pipeline2_fsdp4_1f1b"])
def test_layouts_equal_one_device(imported, one_device, tmp_path, layout):
    """fsdp x tensor, and a pipeline of two stages, circular and 1F1B (the score head on the last stage's
    outputs, per microbatch in the table runner): loss, accuracy and every gradient as one device."""
    loss, metrics, grads = step(imported, tmp_path, layout)
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
                       (("score_head=true",), "score_head=true with objective=lm")):
        with pytest.raises(ConfigError, match=says):
            config.finalize(config.parse([base, "model_name=tiny", *keys]), 2)




@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A fresh tiny reward model (its score head initialised by the run) trained through `maxshard.train` on
    preference JSONL of style pairs: the run directory."""
    root = tmp_path_factory.mktemp("trained")
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in style_pairs(64, seed=1)))
    argv = ["configs/base.yml", "model_name=tiny", "objective=reward_model", "score_head=true",
            "dataset_type=preference", f"dataset_path={pairs}", "learning_rate=3e-3", "steps=30",
            "checkpoint_period=30", f"base_output_directory={root}", "run_name=rm", "log_period=1",
            "eval_period=0", "max_target_length=64", "warmup_steps_fraction=0.1", "eval_fraction=0",
            "enable_tensorboard=false"]
    assert train.main(argv) == 0
    return root / "rm"


def test_a_run_through_the_cli_learns_to_score_the_chosen_style_higher(trained):
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rewards/accuracy" in r]
    assert len(steps) == 30
    assert steps[-1]["rewards/accuracy"] >= 0.95 and steps[-1]["rewards/margin"] > 0, steps[-1]


def _model_reward(trained: Path, tmp_path: Path):
    argv = ["configs/base.yml", "model_name=tiny", "objective=grpo", "dataset_type=prompts", "dataset_path=x.jsonl",
            "grpo_group_size=2",
            f"reward=model:{trained / 'checkpoints' / '30'}", f"base_output_directory={tmp_path}"]
    cfg = loading.complete(config.finalize(config.parse(argv), 1))
    return cfg, ModelReward(cfg, mesh_for(cfg), sharding.flax_rules(cfg))


def test_grpo_s_model_reward_is_the_reward_models_score_of_the_completion(trained, tmp_path):
    """reward=model:STEP scores each completion as the reward model scored the replies it was trained on (the
    score at the reply's last token of [BOS] prompt reply EOS, objectives/reward.py), and prefers the style it
    learned on pairs it never saw."""
    cfg, reward = _model_reward(trained, tmp_path)
    pairs = style_pairs(8, seed=7)
    asked = [Prompt((), r["prompt"], r) for r in pairs for _ in range(2)]
    completions = [c for r in pairs for c in (r["chosen"], r["rejected"])]
    got = rewards.score(reward, asked, completions)
    assert np.mean(got[0::2] > got[1::2]) >= 0.85, got
    tokenizer = make_tokenizer(cfg)
    start = [] if tokenizer.start_id is None else [tokenizer.start_id]
    for i in (0, 1, 5):  # the objective's own reading of one reply's reward, on the same parameters
        prompt = start + list(tokenizer.encode_array(asked[i].text))
        tokens = np.array(prompt + list(tokenizer.encode_array(completions[i])) + [tokenizer.eos_id], np.int32)
        n = len(tokens) - 1
        row = {"inputs": tokens[None, :-1], "segment_ids": np.ones((1, n), np.int32),
               "loss_weights": (np.arange(1, n + 1) >= len(prompt)).astype(np.float32)[None]}
        scores = Transformer(reward.model_cfg.model).apply({"params": reward.params}, row["inputs"], row["segment_ids"],
                                                     np.arange(n)[None], method="everything")
        want = float(np.sum(np.asarray(scores) * np.asarray(last_reply_position(row))))
        assert got[i] == pytest.approx(want, abs=1e-5), i


def test_grpo_trains_on_a_reward_models_scores_through_the_cli(trained, tmp_path, capsys):
    """A GRPO run rewarded by the trained reward model runs through `maxshard.train` and logs its rewards; a path
    that is no step, or a step without a score head, is one line before anything trains."""
    from test_grpo import grpo_argv, logged

    step = trained / "checkpoints" / "30"
    assert train.main(grpo_argv(tmp_path, "run_name=rm_reward", f"reward=model:{step}", "steps=2",
                                "log_period=1", "checkpoint_period=2")) == 0
    assert sorted(logged(tmp_path / "rm_reward")) == [1, 2]
    capsys.readouterr()
    lm_step = tmp_path / "rm_reward" / "checkpoints" / "2"
    for path, says in ((tmp_path / "nowhere", "is not a maxshard checkpoint step"), (lm_step, "no score head")):
        assert train.main(grpo_argv(tmp_path, "run_name=bad", f"reward=model:{path}")) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
