"""GRPO (`objective: grpo`): the loss against TRL's own numbers, and training through `maxshard.train`.

The loss tests read the rollouts TRL 1.16 scored (tests/fixtures/preference/cases.json, `grpo`: 2 prompts x 4
completions on the qwen3 fixture, the log-probabilities of an older policy, a perturbed reference model) and check
that maxshard's step on the same rows gives TRL's loss, KL and clip fraction and every parameter's gradient within
1e-5 for TRL's defaults (`loss_type: dapo`, `use_bias_correction_kl: true`: maxshard's) and each variant
(VARIANTS: the grpo normalisation, the plain k3 KL, temperature 0.7, DAPO's epsilon_high, GSPO's sequence ratio;
dr_grpo), and the rollout policy's log-probabilities at temperature 0.7 as TRL takes them. The CLI test trains a tiny model
on a task a reward function in a file verifies, from a mean reward below 0.3 to at least 0.8; another samples and
trains under a pipeline as on one device.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import cli_processes
from helpers import finished, max_relative_difference
from test_objectives import CASES, LAYOUTS, import_fixtures, start

from maxshard import data, train
from maxshard.generation import rollouts
from maxshard.model import trainable
from maxshard.training.step import mesh_context

REPO = Path(__file__).resolve().parent.parent
GRPO = CASES["grpo"]
CASE = GRPO["grpo_k3"]
JAX_0_12 = jax.__version_info__ >= (0, 12)  # its XLA:CPU rounds the KL of test_a_pipeline_samples_... otherwise
LENGTH = 64
KEYS = ("objective=grpo", "grpo_group_size=4", f"grpo_kl_beta={CASE['config']['beta']}",
        f"grpo_epsilon={CASE['config']['epsilon_low']}", "grpo_max_prompt_length=8", "grpo_max_new_tokens=16")
# fixture case -> the keys beyond KEYS that ask maxshard for TRL's configuration of it (none: TRL's defaults are
# maxshard's: loss_type dapo, the bias-corrected KL, the ratio per token, one clip range, temperature 1)
VARIANTS = {
    "dapo": (),
    "grpo": ("grpo_loss_type=grpo",),
    "grpo_k3": ("grpo_loss_type=grpo", "grpo_kl_estimator=k3"),
    "dapo_t07": ("grpo_temperature=0.7",),
    "dapo_eps_high": ("grpo_epsilon_high=0.28",),
    "gspo": ("grpo_importance_sampling=sequence",),
}
TRL_OPTIONS = {  # the fixture's TRL config key -> maxshard's value of it, as VARIANTS set them
    "loss_type": lambda keys: _value(keys, "grpo_loss_type", "dapo"),
    "use_bias_correction_kl": lambda keys: _value(keys, "grpo_kl_estimator", "bias_corrected") == "bias_corrected",
    "temperature": lambda keys: float(_value(keys, "grpo_temperature", "1.0")),
    "epsilon_high": lambda keys: float(_value(keys, "grpo_epsilon_high", CASE["config"]["epsilon_low"])),
    "importance_sampling_level": lambda keys: _value(keys, "grpo_importance_sampling", "token"),
}


def _value(keys: tuple[str, ...], key: str, default: str) -> str:
    return dict(item.split("=") for item in keys).get(key, default)


def merged(*groups: tuple[str, ...]) -> list[str]:
    """key=value items of `groups` in order, a later one replacing an earlier one of its key (the loader refuses a
    key given twice)."""
    return list({item.split("=")[0]: item for group in groups for item in group}.values())


def fixture_rows(case: dict = CASE) -> dict[str, np.ndarray]:
    """The fixture's rollouts as maxshard lays them out (rollouts.rows), with TRL's old log-probabilities of `case`
    (at its temperature) on each completion target."""
    out = GRPO["rollouts"]
    host = rollouts.rows(out["prompt_ids"], out["completion_ids"], np.asarray(case["advantages"], np.float32), LENGTH)
    for i, old in enumerate(case["old_token_logps"]):
        host["old_logps"][i, host["loss_weights"][i] > 0] = old
    return host


def test_advantages_are_trl_s():
    want = np.asarray(CASE["advantages"], np.float32)
    got = rollouts.advantages(np.asarray(GRPO["rollouts"]["rewards"], np.float32), GRPO["rollouts"]["group_size"])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_each_variant_asks_for_the_trl_configuration_of_its_fixture():
    """The keys of VARIANTS are what TRL ran for each case: otherwise the comparisons below prove nothing."""
    for case, keys in VARIANTS.items():
        config = GRPO[case]["config"]
        for option, ours in TRL_OPTIONS.items():
            assert ours(keys) == pytest.approx(config[option]) if isinstance(config[option], float) \
                else ours(keys) == config[option], (case, option)


def grads_and_metrics(imported, tmp_path, case: str, *knobs: str, devices: int = 1):
    """maxshard's (loss, metrics, gradients / weight_sum, weight_sum) for the fixture case `case` on its rows."""
    trainer, state = start(imported, tmp_path, "policy", *merged(KEYS, VARIANTS.get(case, ()), knobs), devices=devices)
    reference = start(imported, tmp_path, "reference", *knobs, devices=devices)[1].params
    batch = jax.device_put(fixture_rows(GRPO[case]),
                           trainer.batch_shardings(data.batch_sharding(trainer.cfg, trainer.mesh)))
    with mesh_context(trainer.mesh, trainer.rules):
        grads, sums = jax.jit(trainer._grads)(state.params, batch, None, reference)
        metrics = jax.device_get(jax.jit(trainer.objective.metrics)(sums))
    weight = float(sums["weight_sum"])
    return float(sums["loss_sum"]) / weight, metrics, jax.tree.map(lambda g: np.asarray(g) / weight, grads), weight


@pytest.mark.parametrize("case, layout, chunks", [(case, "one_device", 0) for case in VARIANTS] +
                         [("dapo", "fsdp4_tensor2", 0), ("dapo_t07", "fsdp4_tensor2", 2)])
def test_loss_kl_clipping_and_gradients_equal_trl(imported, tmp_path, case, layout, chunks):
    """Each GRPO variant (VARIANTS) on TRL's rollouts: TRL's loss, KL and clip fraction (`clip_ratio/region_mean`:
    of tokens, of completions with the sequence ratio) and every parameter's gradient within 1e-5; sharded, and at
    a temperature with the head over loss pieces (its logits divided there: `Trainer._head`)."""
    want = GRPO[case]
    knobs, devices = LAYOUTS[layout]
    loss, metrics, grads, weight = grads_and_metrics(imported, tmp_path, case, *knobs, f"loss_chunks={chunks}",
                                                     devices=devices)
    assert weight == (8 if want["config"]["loss_type"] == "grpo" else want["num_items_in_batch"])
    assert loss == pytest.approx(want["loss"], abs=1e-5)
    assert float(metrics["kl"]) == pytest.approx(want["metrics"]["kl"], rel=1e-5)
    assert float(metrics["clip_fraction"]) == pytest.approx(want["metrics"]["clip_ratio/region_mean"], abs=1e-6)
    trl = start(imported, tmp_path, f"grpo_{case}")[1].params
    assert max_relative_difference(grads, trl) < 1e-5


def test_each_variant_changes_the_loss():
    """The fixture's variants differ from TRL's defaults where they should: otherwise a key that did nothing
    would pass the comparisons above."""
    default = GRPO["dapo"]
    for case in ("grpo", "grpo_k3", "dapo_t07", "dapo_eps_high", "gspo", "dr_grpo"):
        assert GRPO[case]["loss"] != pytest.approx(default["loss"], abs=1e-3), case
    assert GRPO["dapo_eps_high"]["metrics"]["clip_ratio/high_mean"] < default["metrics"]["clip_ratio/high_mean"]
    assert GRPO["dapo_t07"]["old_token_logps"] != default["old_token_logps"]


def test_at_a_temperature_every_log_probability_is_trl_s(imported, tmp_path):
    """grpo_temperature 0.7: the rollout policy's log-probabilities (`rollouts.logps_of`, the function that writes
    old_logps after sampling) of the policy and of the reference model are TRL's, from logits / 0.7, within 1e-5;
    at temperature 1 they are not (the bug this guards: sampling at the temperature, scoring at 1)."""
    want = GRPO["dapo_t07"]
    host = fixture_rows(want)
    mask = host["loss_weights"] > 0
    for name, key in (("policy", "policy_token_logps"), ("reference", "reference_token_logps")):
        got = {}
        for temperature in (0.7, 1.0):
            trainer, state = start(imported, tmp_path, name, *KEYS, f"grpo_temperature={temperature}")
            sharding = data.batch_sharding(trainer.cfg, trainer.mesh)
            batch = jax.device_put(host, trainer.batch_shardings(sharding))
            with mesh_context(trainer.mesh, trainer.rules):
                got[temperature] = np.asarray(rollouts.logps_of(trainer, sharding)(state.params, batch))
        wanted = np.concatenate(want[key])
        np.testing.assert_allclose(got[0.7][mask], wanted, atol=1e-5, rtol=0)
        assert np.max(np.abs(got[1.0][mask] - wanted)) > 1e-2, name


def test_dr_grpo_equals_trl_s(imported, tmp_path):
    """grpo_loss_type dr_grpo with TRL's defaults otherwise: TRL's loss within 1e-5, and the gradient TRL's dapo
    gradient times num_items_in_batch / (completions x max_completion_length) (TRL divides the same masked sum by
    that constant instead; the fixture keeps dapo's gradients only)."""
    want = GRPO["dr_grpo"]
    length = want["config"]["max_completion_length"]
    loss, metrics, grads, weight = grads_and_metrics(imported, tmp_path, "dr_grpo", "grpo_loss_type=dr_grpo",
                                                     f"grpo_max_new_tokens={length}")
    assert weight == 8 and loss == pytest.approx(want["loss"], abs=1e-5)
    assert float(metrics["kl"]) == pytest.approx(want["metrics"]["kl"], rel=1e-5)
    scale = want["num_items_in_batch"] / (8 * length)
    trl = jax.tree.map(lambda g: np.asarray(g) * scale, start(imported, tmp_path, "grpo_dapo")[1].params)
    assert max_relative_difference(grads, trl) < 1e-5


REWARD = '''
def digits(prompt, completion, record):
    """The share of the first four characters of the reply that are digits."""
    return sum(c.isdigit() for c in completion[:4]) / 4
'''


def grpo_argv(root: Path, *keys: str) -> list[str]:
    """A tiny byte-level GRPO run under `root`: prompts from JSONL, a reward from a file, `keys` on top (each
    replaces the default of its key: the CLI refuses a key given twice)."""
    (root / "reward.py").write_text(REWARD)
    rng = np.random.default_rng(0)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "".join(rng.choice(list("abcdef"), 3)) + "="}) + "\n"
                               for _ in range(64)))
    argv = ["configs/base.yml", "model_name=tiny", "cpu_device_count=8", "dataset_type=prompts",
            f"dataset_path={prompts}", "objective=grpo", f"reward={root / 'reward.py'}:digits", "grpo_group_size=8",
            "grpo_max_new_tokens=4", "grpo_max_prompt_length=8", "max_target_length=16", "override_model_config=true",
            "per_device_batch_size=4", "learning_rate=1e-2", "warmup_steps_fraction=0", "eval_fraction=0",
            f"base_output_directory={root}", "enable_tensorboard=false", *keys]
    return list({item.split("=")[0]: item for item in argv}.values())  # a key of `keys` replaces the default


def logged(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "reward/mean" in r}


def test_grpo_through_the_cli_learns_what_the_reward_asks(tmp_path, capsys):
    """Acceptance: a tiny byte-level model, prompts from JSONL, a reward function from a file: the untrained
    model's mean reward is below 0.3, GRPO brings it to at least 0.8; the KL at the first step is 0. The rollouts
    decode 16 rows at once for the 32 completions, refilling finished rows (generation/refill.py). Each logged
    step carries its rollout's speed (completion tokens per second of its wall time, the decode steps), also on the
    console line."""
    assert train.main(grpo_argv(tmp_path, "run_name=grpo", "steps=40", "log_period=5", "checkpoint_period=40",
                                "grpo_rollout_rows=16")) == 0
    steps = list(logged(tmp_path / "grpo").values())
    assert steps[0]["reward/mean"] < 0.3 and steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert max(r["reward/mean"] for r in steps[-3:]) >= 0.8, [round(r["reward/mean"], 2) for r in steps]
    for r in steps:  # 32 completions a rollout, of at most 4 tokens, in 16 rows: 3 steps each row, twice at most
        assert 0 < r["completion_length"] <= 4 and 0 < r["rollout/decode_steps"] <= 6
        assert r["rollout/tokens_per_sec"] == pytest.approx(32 * r["completion_length"] / r["rollout/seconds"])
    assert re.search(r"step 40/40 .* \| reward [\d.]+ \| rollout [\d.]+s [\d,]+ tok/s", capsys.readouterr().out)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return import_fixtures(tmp_path_factory.mktemp("imported"), tuple(f"grpo_{case}" for case in VARIANTS))


def test_a_resumed_grpo_run_samples_and_trains_as_the_uninterrupted_one(tmp_path):
    """Two updates per rollout, checkpoint at step 3 of 6, inside the second rollout's updates: the checkpoint keeps
    that rollout's batch (sampled from parameters it no longer holds), so step 4 trains on the very rows and the
    same prompts, sampling keys and reference give steps 5-6 (a fresh rollout) the uninterrupted run's rewards and
    losses, bit for bit."""
    keys = ("steps=6", "log_period=1", "checkpoint_period=3", "async_checkpointing=false",
            "grpo_updates_per_rollout=2")
    assert train.main(grpo_argv(tmp_path, "run_name=straight", *keys)) == 0
    saved = tmp_path / "straight" / "checkpoints"
    assert (saved / "3" / "batch").is_dir() and not (saved / "6" / "batch").exists()  # kept only inside a rollout
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(saved / "3", tmp_path / "resumed" / "checkpoints" / "3")
    assert train.main(grpo_argv(tmp_path, "run_name=resumed", *keys)) == 0
    straight, resumed = logged(tmp_path / "straight"), logged(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("loss", "reward/mean", "kl", "clip_fraction", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key)


def test_the_plan_counts_the_sampling_cache_as_generation_lays_it_out():
    """GRPO's plan holds the KV cache of the whole global batch's sampling, per device as the engine shards it
    (keys and values: layers x 2 x kv_heads x (prompt + new tokens) x head_dim per sequence), and its peak takes the
    larger of that cache and the step's gradients and activations; refilled rows hold fewer sequences, and a
    multi-turn run's later turns the whole row."""
    from helpers import tiny_config

    from maxshard.planning import estimate

    keys = ("objective=grpo", "dataset_type=prompts", "grpo_max_prompt_length=24", "grpo_max_new_tokens=8",
            "grpo_group_size=4", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    cfg = tiny_config(*keys)
    plan = estimate.make_plan(cfg)
    rows_per_device = cfg.global_batch_size // 4  # the cache's batch over fsdp; its kv heads over tensor
    per_device = cfg.num_layers * 2 * rows_per_device * (cfg.num_kv_heads // 2) * 32 * cfg.head_dim * 4
    assert plan.rollout_cache == per_device
    state = plan.params + plan.optimizer + plan.reference
    assert plan.peak_bytes == state + max(plan.gradients + plan.activations, plan.rollout_cache)
    lm = estimate.make_plan(tiny_config("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"))
    assert lm.rollout_cache == 0 and lm.peak_bytes == lm.params + lm.optimizer + lm.gradients + lm.activations
    # refilled rows (generation/refill.py): the cache holds grpo_rollout_rows, rounded up to the batch's shards
    refilled = estimate.make_plan(tiny_config(*keys, "grpo_rollout_rows=6"))
    assert refilled.rollout_cache == per_device * 8 // cfg.global_batch_size
    # several turns (generation/environments.py): later turns' contexts reach the whole row
    turns = estimate.make_plan(tiny_config(*keys, "grpo_max_turns=2", "max_target_length=63",
                                           f"grpo_environment={REPO / 'examples' / 'arithmetic_env.py'}:drill"))
    assert turns.rollout_cache == per_device * 64 // 32


def test_with_lora_the_reference_is_the_base_and_the_adapters_learn(imported, tmp_path):
    """GRPO under LoRA: the reference is the base with the adapters off (nothing kept), so on fresh adapters the
    loss is the full model's against itself as reference (KL 0); only the adapters get gradients, and they do."""
    trainer, state = start(imported, tmp_path, "policy", *KEYS, "lora_rank=4", "lora_targets=q,v,down")
    assert trainer.reference_kind == "lora_base" and state.reference is None
    full, full_state = start(imported, tmp_path, "policy", *KEYS)
    host = fixture_rows()
    results = []
    for run, params, reference in ((trainer, state.params, None), (full, full_state.params, full_state.params)):
        batch = jax.device_put(host, run.batch_shardings(data.batch_sharding(run.cfg, run.mesh)))
        trained, frozen = trainable.split(params, run.cfg.model)  # as the train step splits them
        with mesh_context(run.mesh, run.rules):
            results.append(jax.device_get(jax.jit(run._grads)(trained, batch, frozen, reference)))
    (lora_grads, lora_sums), (_, full_sums) = results
    assert float(lora_sums["kl"]) == 0.0 and float(full_sums["kl"]) == 0.0
    assert float(lora_sums["loss_sum"]) == pytest.approx(float(full_sums["loss_sum"]), rel=1e-6)
    leaves = jax.tree_util.tree_flatten_with_path(lora_grads)[0]
    assert leaves and all(str(path[-1].key) in ("lora_a", "lora_b") for path, _ in leaves)
    assert max(float(np.abs(g).max()) for path, g in leaves if str(path[-1].key) == "lora_b") > 0


def test_a_pipeline_samples_and_trains_as_one_device(env, tmp_path):
    """GRPO under pipeline=2 x fsdp=4 (1f1b), at temperature 0.7 (the pipelined head divides the logits as the
    step's does): rollouts are sampled from the stage-laid parameters as they train
    (decode.Engine reads them as the unpipelined stack inside its jitted steps, no copy kept), the rollout policy's
    and the reference's log-probabilities come from the pipelined forward, the loss from the table runner per
    pipeline microbatch; three steps through `maxshard.train` log one device's rewards and losses within 1e-5 and
    its KL within 1e-5 (5e-5 on jax 0.12) (one device: a subprocess, side by side with the pipelined run in this
    process)."""
    keys = ("steps=3", "log_period=1", "enable_checkpointing=false", "grpo_group_size=4", "grpo_temperature=0.7")
    argv = grpo_argv(tmp_path, "run_name=one", *keys, "per_device_batch_size=16", "cpu_device_count=1")
    one = cli_processes.popen([sys.executable, "-m", "maxshard.train", *argv], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert train.main(grpo_argv(tmp_path, "run_name=piped", *keys, "per_device_batch_size=2",
                                    "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
                                    "pipeline_schedule=1f1b")) == 0
    finally:
        out = finished([one], timeout=300)[0]
    assert "mesh: single device" in out, out[:2000]
    one_device, piped = logged(tmp_path / "one"), logged(tmp_path / "piped")
    assert sorted(piped) == sorted(one_device) == [1, 2, 3]
    # The KL is the policy's drift from the reference, so it carries what float32 reassociation leaves in the
    # parameters after two updates; measured at step 3: 2.5e-6 on jax 0.10.2, 1.5e-5 on jax 0.12 (its XLA:CPU
    # fusion emitters round otherwise; docs/toolchains.md, "Which Python gives which toolchain"). The rest: within 1e-5.
    for step in (1, 2, 3):
        for key in ("loss", "reward/mean", "kl", "completion_length"):
            bound = 5e-5 if key == "kl" and JAX_0_12 else 1e-5
            assert piped[step][key] == pytest.approx(one_device[step][key], abs=bound), (step, key)
    assert len({r["loss"] for r in piped.values()}) > 1  # the steps moved the model


def test_each_grpo_loss_type_equals_trl_s(imported, tmp_path):
    """grpo_loss_type dapo and dr_grpo (TRL's loss_type of the name, with the plain k3 KL): the run's objective, on
    the fixture's rollouts, gives TRL's loss within 1e-5; KL and completion length do not depend on the type. (The
    per-token terms and their gradients are the `grpo` type's, checked against TRL's above.)"""
    from helpers import tiny_config

    from maxshard import objectives

    trainer, state = start(imported, tmp_path, "policy", *KEYS)
    reference = start(imported, tmp_path, "reference")[1].params
    batch = jax.device_put(fixture_rows(), trainer.batch_shardings(data.batch_sharding(trainer.cfg, trainer.mesh)))
    types = {}
    for case in ("dapo_k3", "dr_grpo_k3"):
        want = GRPO[case]
        assert want["config"]["loss_type"] == case[:-3] and want["config"]["use_bias_correction_kl"] is False
        cfg = tiny_config(*KEYS[:4], "dataset_type=prompts", f"grpo_loss_type={case[:-3]}", "grpo_kl_estimator=k3",
                          f"grpo_max_new_tokens={want['config']['max_completion_length']}")
        types[case] = objectives.of(cfg)

    def sums_of_each(params, batch, reference):
        logps, ref = trainer._token_logps(params, batch)[0], trainer._token_logps(reference, batch)[0]
        return {case: objective.sums(logps, batch, {}, ref)[1] for case, objective in types.items()}

    with mesh_context(trainer.mesh, trainer.rules):
        got = jax.device_get(jax.jit(sums_of_each)(state.params, batch, reference))
    for case, sums in got.items():
        assert float(sums["loss_sum"]) / float(sums["weight_sum"]) == pytest.approx(GRPO[case]["loss"], abs=1e-5)
        assert GRPO[case]["loss"] != pytest.approx(CASE["loss"], abs=1e-3)  # the normalisation matters here
        metrics = types[case].metrics(sums)
        assert float(metrics["kl"]) == pytest.approx(GRPO[case]["metrics"]["kl"], rel=1e-5)
        assert float(metrics["completion_length"]) == pytest.approx(CASE["num_items_in_batch"] / 8)
    assert float(got["dapo_k3"]["weight_sum"]) == CASE["num_items_in_batch"]
    assert float(got["dr_grpo_k3"]["weight_sum"]) == 8


def test_local_checkpoints_refuse_a_rollout_batch_they_cannot_keep(tmp_path):
    """The emergency tiers keep the state and the data position only: GRPO with several updates per rollout, whose
    checkpoint inside a rollout needs its batch, is refused there in one line before anything is built."""
    from helpers import tiny_config

    from maxshard.checkpoint import emergency
    from maxshard.errors import ConfigError

    cfg = tiny_config("objective=grpo", "dataset_type=prompts", "grpo_updates_per_rollout=2",
                      f"checkpoint_local_dir={tmp_path}")
    with pytest.raises(ConfigError, match="grpo_updates_per_rollout"):
        emergency.open_checkpoints(cfg, trainer=None)


@pytest.mark.parametrize("key, message", [
    ("grpo_kl_estimator=k2", "grpo_kl_estimator expects one of 'bias_corrected', 'k3', got 'k2'"),
    ("grpo_importance_sampling=seq", "grpo_importance_sampling expects one of 'token', 'sequence', got 'seq'"),
    ("grpo_epsilon_high=-0.1", r"grpo_epsilon_high must be >= 0 \(0: grpo_epsilon\), got -0.1"),
])
def test_a_bad_grpo_key_is_one_line_naming_it(key, message):
    from helpers import tiny_config

    from maxshard.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as raised:
        tiny_config("objective=grpo", "dataset_type=prompts", key)
    assert "\n" not in str(raised.value)
