"""Preference objectives against TRL's own numbers (tests/fixtures/preference, made by tools/make_preference_fixtures.py
with TRL 1.16): on the imported qwen3 fixture, DPO (sigmoid and robust), SimPO and ORPO give TRL's loss, logged
metrics and gradients w.r.t. every parameter within 1e-5, with the pairs packed into rows as the preference reader
packs them (several pairs in a row, rows left empty), on one device; and the same on other layouts as on one
device: fsdp=4 x tensor=2, context=2 x fsdp=4, sequence=2 x fsdp=4 (with 2 accumulation microbatches),
pipeline=2 x fsdp=4 (circular, and 1f1b: the table runner computes the objective per pipeline microbatch, ORPO's
batch-wide normaliser from `totals`), and a tiny MoE on synthetic pairs under expert=4 x fsdp=2. Every split of
the batch (accumulation, pipeline microbatches) is by rows, so a pair is never cut.

TRL's gradients are keyed by Hugging Face names; they are brought into maxshard's layout by the converter itself: a
copy of the policy's config.json beside the gradients is a Hugging Face checkpoint that `from_hf` imports.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_relative_difference, mesh_for, tiny_config
from test_convert import start_from_converted

from maxshard import data, generate, train
from maxshard.checkpoint import manager as checkpoint
from maxshard.convert import __main__ as convert_cli
from maxshard.model.layers import pipeline
from maxshard.objectives import preference
from maxshard.planning import estimate
from maxshard.training.step import Trainer, mesh_context

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "preference"
POLICY = REPO / "tests" / "fixtures" / "hf" / "qwen3"
CASES = json.loads((FIXTURE / "cases.json").read_text())
LENGTH = 64
ROWS = ((0, 1), (2,), (), (3,), (), (), (), ())  # which pairs each row of the batch of 8 holds, in order
TOLERANCE = 1e-5
# case -> the run's objective keys
OBJECTIVES = {
    "dpo": ("objective=dpo", "dpo_beta=0.1"),
    "dpo_smooth": ("objective=dpo", "dpo_beta=0.5"),  # TRL 1.16's sigmoid DPO ignores its label_smoothing
    "dpo_robust": ("objective=dpo", "dpo_beta=0.5", "dpo_label_smoothing=0.2"),
    "simpo": ("objective=simpo", "simpo_beta=2.0", "simpo_gamma=0.5"),
    "orpo": ("objective=orpo", "orpo_lambda=0.1"),
}
LAYOUTS = {"one_device": (("ici_fsdp_parallelism=1",), 1),  # name -> (mesh knobs, devices)
           "fsdp4_tensor2": (("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"), 8),
           "context2_fsdp4": (("ici_fsdp_parallelism=4", "ici_context_parallelism=2"), 8),
           # and 2 accumulation microbatches (rows 0, 2, 4, 6 and 1, 3, 5, 7: pairs 0, 1 and 2, 3)
           "sequence2_fsdp4": (("ici_fsdp_parallelism=4", "ici_sequence_parallelism=2",
                                "gradient_accumulation_steps=2"), 8),
           "pipeline2_fsdp4": (("ici_fsdp_parallelism=4", "ici_pipeline_parallelism=2"), 8),
           "pipeline2_fsdp4_1f1b": (("ici_fsdp_parallelism=4", "ici_pipeline_parallelism=2",
                                     "pipeline_schedule=1f1b"), 8)}


def pair_rows() -> dict[str, np.ndarray]:
    """The fixture's pairs in rows of LENGTH as `data/preference.py` lays them out: pair p of a row is segments
    2p - 1 (prompt + chosen) and 2p (prompt + rejected), each shifted by one, weight 1 on completion targets."""
    fields = {k: np.zeros((len(ROWS), LENGTH), np.float32 if k == "loss_weights" else np.int32)
              for k in ("inputs", "targets", "segment_ids", "positions", "loss_weights")}
    for r, members in enumerate(ROWS):
        at, segment = 0, 0
        for index in members:
            pair = CASES["pairs"][index]
            for completion in (pair["chosen_ids"], pair["rejected_ids"]):
                tokens, segment = np.asarray(pair["prompt_ids"] + completion), segment + 1
                n = len(tokens) - 1
                fields["inputs"][r, at:at + n], fields["targets"][r, at:at + n] = tokens[:-1], tokens[1:]
                fields["segment_ids"][r, at:at + n], fields["positions"][r, at:at + n] = segment, np.arange(n)
                fields["loss_weights"][r, at:at + n] = np.arange(1, n + 1) >= len(pair["prompt_ids"])
                at += n
    return fields


def import_fixtures(root: Path, cases: tuple[str, ...]) -> dict[str, Path]:
    """The policy, the reference and each case's gradients under `root`, each imported once by `from_hf`."""
    out = {}
    for name, source in (("policy", POLICY), ("reference", FIXTURE / "reference")):
        assert convert_cli.main(["from_hf", str(source), str(root / name)]) == 0
        out[name] = root / name
    for case in cases:
        hf = root / f"{case}_hf"
        hf.mkdir()
        shutil.copy(POLICY / "config.json", hf / "config.json")
        shutil.copy(FIXTURE / f"{case}_grads.safetensors", hf / "model.safetensors")
        assert convert_cli.main(["from_hf", str(hf), str(root / f"{case}_grads")]) == 0
        out[case] = root / f"{case}_grads"
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return import_fixtures(tmp_path_factory.mktemp("imported"), tuple(OBJECTIVES))


def start(imported: dict[str, Path], tmp_path: Path, name: str, *extra: str, devices: int = 1) -> tuple[Any, Any]:
    return start_from_converted(imported[name], tmp_path / name, f"max_target_length={LENGTH}",
                                *extra, num_devices=devices)


@pytest.fixture(scope="module")
def runs(imported, tmp_path_factory) -> Any:
    """runs(case, layout) -> (loss, metrics, gradients) of maxshard's step on the fixture batch; cached."""
    cache: dict[tuple[str, int], Any] = {}
    reference = {}

    def run(case: str, layout: str) -> Any:
        if (case, layout) not in cache:
            tmp = tmp_path_factory.mktemp(f"{case}_{layout}")
            knobs, devices = LAYOUTS[layout]
            trainer, state = start(imported, tmp, "policy", *OBJECTIVES[case], *knobs, devices=devices)
            if layout not in reference:
                reference[layout] = start(imported, tmp, "reference", *knobs, devices=devices)[1].params
            batch = jax.device_put(pair_rows(), trainer.batch_shardings(data.batch_sharding(trainer.cfg, trainer.mesh)))
            with mesh_context(trainer.mesh, trainer.rules):
                grads, sums = jax.jit(trainer._grads)(state.params, batch, None, reference[layout])
                metrics = jax.jit(trainer.objective.metrics)(sums)
            pairs, grads = float(sums["weight_sum"]), jax.device_get(grads)
            if trainer.cfg.model.pipeline is not None:  # [repeats, stages, layers per stage, ...] -> [layers, ...]
                grads = pipeline.to_scanned(grads)
            cache[case, layout] = (float(sums["loss_sum"]) / pairs, jax.device_get(metrics),
                                    jax.tree.map(lambda g: np.asarray(g) / pairs, grads))
        return cache[case, layout]

    return run


# TRL's metric names -> maxshard's
METRICS = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
           "rewards/accuracies": "rewards/accuracy", "rewards/margins": "rewards/margin",
           "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected", "nll_loss": "nll_loss",
           "log_odds_ratio": "log_odds_ratio", "log_odds_chosen": "log_odds_chosen"}


@pytest.mark.parametrize("case", list(OBJECTIVES))
def test_loss_metrics_and_gradients_equal_trl(runs, imported, tmp_path, case):
    want = CASES["preference"][case]
    loss, metrics, grads = runs(case, "one_device")
    assert loss == pytest.approx(want["loss"], abs=TOLERANCE)
    for trl_name, name in METRICS.items():
        if trl_name in want["metrics"] and name in metrics:
            assert float(metrics[name]) == pytest.approx(want["metrics"][trl_name], abs=TOLERANCE, rel=TOLERANCE), name
    trl_grads = start(imported, tmp_path, case)[1].params
    assert max_relative_difference(grads, trl_grads) < TOLERANCE


@pytest.mark.parametrize(("case", "layout"), [("dpo", "fsdp4_tensor2"), ("orpo", "fsdp4_tensor2"),
                                              ("dpo", "context2_fsdp4"), ("dpo", "sequence2_fsdp4"),
                                              ("orpo", "pipeline2_fsdp4"),
                                              ("dpo", "pipeline2_fsdp4_1f1b"), ("orpo", "pipeline2_fsdp4_1f1b")])
def test_layouts_equal_one_device(runs, case, layout):
    loss, metrics, grads = runs(case, layout)
    one_loss, one_metrics, one_grads = runs(case, "one_device")
    assert loss == pytest.approx(one_loss, abs=1e-6)
    assert max_relative_difference(grads, one_grads) < 1e-5
    for name, value in one_metrics.items():
        assert float(metrics[name]) == pytest.approx(float(value), abs=1e-5), name


# A tiny MoE (top-2 of 8 experts, dropless: the same function under any expert layout) on synthetic pairs
MOE = ("num_experts=8", "num_experts_per_tok=2", "moe_layer_interval=2", "capacity_factor=-1", "objective=simpo",
       "simpo_beta=2.0", "simpo_gamma=0.5")


def test_simpo_on_a_moe_under_expert_parallelism_equals_one_device():
    """expert=4 x fsdp=2: SimPO's loss, its sums (rewards, log-probabilities, pairs) with the router's losses, and
    every gradient equal one device's on the same parameters and batch of synthetic pairs."""
    results = []
    for knobs, devices in ((("ici_fsdp_parallelism=1",), 1),
                           (("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"), 8)):
        cfg = tiny_config(*MOE, *knobs, num_devices=devices)
        trainer = Trainer(cfg, mesh_for(cfg))
        if not results:
            params = jax.device_get(trainer.init_state().params)
            host = jax.device_get(next(data.make_input(cfg, trainer.mesh)))
        batch = jax.device_put(host, trainer.batch_shardings(data.batch_sharding(cfg, trainer.mesh)))
        with mesh_context(trainer.mesh, trainer.rules):
            results.append(jax.device_get(jax.jit(trainer._grads)(
                jax.device_put(params, trainer.state_shardings.params), batch)))
    (one_grads, one_sums), (grads, sums) = results
    assert float(one_sums["weight_sum"]) > 8 and float(one_sums["moe_lb_loss"]) > 0
    for name, value in one_sums.items():
        np.testing.assert_allclose(sums[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert max_relative_difference(grads, one_grads) < 1e-5


def test_pairs_are_found_from_segments_alone():
    """Per-pair sums: row 0's two pairs, row 1's one, padding and empty rows count no pair."""
    rows = pair_rows()
    logps = jnp.asarray(np.random.default_rng(0).normal(size=rows["targets"].shape), jnp.float32)
    pairs = preference.pairs_of(logps, {k: jnp.asarray(v) for k, v in rows.items()})
    assert np.asarray(pairs.counted).sum(axis=1).tolist() == [len(m) for m in ROWS]
    completion = [(len(p["chosen_ids"]), len(p["rejected_ids"])) for p in CASES["pairs"]]
    assert [int(pairs.chosen_tokens[0, 0]), int(pairs.rejected_tokens[0, 0])] == list(completion[0])
    assert [int(pairs.chosen_tokens[0, 1]), int(pairs.rejected_tokens[0, 1])] == list(completion[1])
    assert [int(pairs.chosen_tokens[3, 0]), int(pairs.rejected_tokens[3, 0])] == list(completion[3])
    chosen_half = (rows["segment_ids"][0] == 1) & (rows["loss_weights"][0] > 0)
    assert float(pairs.chosen[0, 0]) == pytest.approx(float(np.asarray(logps)[0][chosen_half].sum()), rel=1e-6)


# ------------------------------------------------------------------ the reference model and the runs users start


@pytest.mark.parametrize("lora", [False, True], ids=["frozen", "lora_base"])
def test_first_step_is_ln2_and_the_reference_stays_put(lora):
    """A fresh DPO run's policy is its reference, so its first loss is ln 2; the frozen copy lives in the state (and
    in the plan's memory) and never moves, LoRA's base needs no copy."""
    extra = ("lora_rank=4", "lora_targets=q,v") if lora else ()
    cfg = tiny_config("objective=dpo", "dpo_beta=0.5", *extra)
    trainer = Trainer(cfg, mesh_for(cfg))
    assert trainer.reference_kind == ("lora_base" if lora else "frozen")
    state = trainer.init_state()
    start_params = jax.device_get(state.params)
    step = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))
    batches = data.make_input(cfg, trainer.mesh)
    losses = []
    for _ in range(3):
        state, metrics = step(state, next(batches))
        losses.append(float(metrics["loss"]))
    assert losses[0] == pytest.approx(np.log(2.0), abs=1e-5) and losses[-1] < losses[0] - 1e-3, losses
    plan = estimate.make_plan(cfg)
    if lora:
        assert state.reference is None and plan.reference == 0
    else:
        assert max_relative_difference(state.reference, start_params) == 0.0
        assert max_relative_difference(state.params, start_params) > 1e-4
        assert plan.reference == plan.params > 0


def test_a_resumed_dpo_run_keeps_its_reference_bit_for_bit(tmp_path):
    """The frozen reference is saved with the state and restored exactly (a changed reference would change every
    later loss)."""
    cfg = tiny_config("objective=dpo", f"base_output_directory={tmp_path}", "async_checkpointing=false")
    trainer = Trainer(cfg, mesh_for(cfg))
    step = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))
    with checkpoint.Checkpoints(cfg, trainer) as ckpt:
        state, _ = ckpt.restore_or_init()
        state, _ = step(state, next(data.make_input(cfg, trainer.mesh)))
        reference = jax.device_get(state.reference)
        ckpt.save(1, state, {"step": 1})
    with checkpoint.Checkpoints(cfg, Trainer(cfg, mesh_for(cfg))) as ckpt:
        restored, _ = ckpt.restore_or_init()
    assert int(restored.step) == 1 and max_relative_difference(restored.reference, reference) == 0.0


STYLE, OTHER = ("the", "dog"), ("quick", "brown")  # chosen replies use only STYLE's words, rejected ones OTHER's


def style_pairs(count: int, seed: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    noise = np.array(list("abcdefghijklmnoprstuwy "))
    words = lambda vocabulary: "".join(" " + w for w in rng.choice(vocabulary, rng.integers(3, 6)))  # noqa: E731
    return [{"prompt": "".join(rng.choice(noise, rng.integers(6, 16))) + ":", "chosen": words(STYLE),
             "rejected": words(OTHER)} for _ in range(count)]


def test_dpo_through_the_cli_learns_the_chosen_style(tmp_path):
    """Acceptance: DPO on the imported qwen3 fixture through `maxshard.train` (preference JSONL, frozen reference)
    reaches rewards/accuracy >= 0.95, and `maxshard.generate` then writes the chosen replies' words only, which the
    imported model did not."""
    assert convert_cli.main(["from_hf", str(POLICY), str(tmp_path / "imported")]) == 0
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in style_pairs(64, seed=0)))
    argv = [str(tmp_path / "imported" / "config.yml"), "dataset_type=preference", f"dataset_path={pairs}",
            "objective=dpo", "dpo_beta=0.1", "learning_rate=3e-3", "steps=30", "checkpoint_period=30",
            f"base_output_directory={tmp_path}", "run_name=dpo", "log_period=1", "eval_period=0",
            "max_target_length=64", "per_device_batch_size=1", "warmup_steps_fraction=0.1", "eval_fraction=0",
            "enable_tensorboard=false", "dtype=float32", "weight_dtype=float32", "max_new_tokens=12", "temperature=0"]

    def words(*keys: str) -> list[str]:
        out = tmp_path / "generated.jsonl"
        assert generate.main([*argv, "prompt=wobbly snarf glim:", f"generate_output={out}", *keys]) == 0
        return json.loads(out.read_text())["completion"].split()

    before = words()
    assert train.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rewards/accuracy" in r]
    assert steps[0]["loss"] == pytest.approx(np.log(2.0), abs=1e-5)
    assert steps[-1]["rewards/accuracy"] >= 0.95 and steps[-1]["rewards/margin"] > 0
    after = words(f"load_parameters_path={tmp_path / 'dpo' / 'checkpoints' / '30'}")
    assert not set(before) <= set(STYLE), before
    assert after and set(after) <= set(STYLE), after


def _dpo_losses(root: Path, name: str, *keys: str) -> dict[int, float]:
    argv = ["configs/base.yml", "model_name=tiny", "cpu_device_count=8", "dataset_type=synthetic", "objective=dpo",
            "dpo_beta=0.5", "log_period=1", "eval_period=2", "warmup_steps_fraction=0", "learning_rate=3e-3",
            f"base_output_directory={root}", f"run_name={name}", "enable_tensorboard=false", "steps=4",
            "checkpoint_period=2", "async_checkpointing=false", *keys]
    assert train.main(argv) == 0
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step" in r}


def test_a_precomputed_reference_trains_as_the_frozen_one_and_resumes(tmp_path):
    """dpo_reference=precomputed: a first pass writes the starting model's log-probabilities of every train batch;
    the run then keeps no reference, yet logs the frozen reference's losses, and a resume reads on from the store."""
    frozen = _dpo_losses(tmp_path, "frozen", "dpo_reference=frozen")
    stored = _dpo_losses(tmp_path, "stored", "dpo_reference=precomputed")
    assert sorted(stored) == [1, 2, 3, 4] and all(abs(stored[s] - frozen[s]) < 1e-6 for s in frozen), (stored, frozen)
    assert len(list((tmp_path / "stored" / "reference_logps").glob("*.npy"))) == 4
    shutil.rmtree(tmp_path / "stored" / "checkpoints" / "4")
    resumed = _dpo_losses(tmp_path, "stored", "dpo_reference=precomputed")
    assert resumed[3] == stored[3] and resumed[4] == stored[4]
