"""Preference objectives against TRL's own numbers (tests/fixtures/preference, made by tools/make_preference_fixtures.py
with TRL 1.16): on the imported qwen3 fixture, DPO (sigmoid and robust), SimPO and ORPO give TRL's loss, logged
metrics and gradients w.r.t. every parameter within 1e-5, with the pairs packed into rows as the preference reader
packs them (several pairs in a row, rows left empty), on one device and on fsdp=4 x tensor=2.

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
from helpers import max_relative_difference
from test_convert import start_from_converted

from maxshard import data
from maxshard.convert import __main__ as convert_cli
from maxshard.objectives import preference
from maxshard.training.step import mesh_context

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
LAYOUTS = {1: ("ici_fsdp_parallelism=1",), 8: ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")}


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


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The policy, the reference and every case's gradients, each imported once by `from_hf`."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for name, source in (("policy", POLICY), ("reference", FIXTURE / "reference")):
        assert convert_cli.main(["from_hf", str(source), str(root / name)]) == 0
        out[name] = root / name
    for case in OBJECTIVES:
        hf = root / f"{case}_hf"
        hf.mkdir()
        shutil.copy(POLICY / "config.json", hf / "config.json")
        shutil.copy(FIXTURE / f"{case}_grads.safetensors", hf / "model.safetensors")
        assert convert_cli.main(["from_hf", str(hf), str(root / f"{case}_grads")]) == 0
        out[case] = root / f"{case}_grads"
    return out


def start(imported: dict[str, Path], tmp_path: Path, name: str, *extra: str, devices: int = 1) -> tuple[Any, Any]:
    return start_from_converted(imported[name], tmp_path / name, f"max_target_length={LENGTH}",
                                *extra, num_devices=devices)


@pytest.fixture(scope="module")
def runs(imported, tmp_path_factory) -> Any:
    """runs(case, devices) -> (loss, metrics, gradients) of maxshard's step on the fixture batch; cached."""
    cache: dict[tuple[str, int], Any] = {}
    reference = {}

    def run(case: str, devices: int) -> Any:
        if (case, devices) not in cache:
            tmp = tmp_path_factory.mktemp(f"{case}_{devices}")
            trainer, state = start(imported, tmp, "policy", *OBJECTIVES[case], *LAYOUTS[devices], devices=devices)
            if devices not in reference:
                reference[devices] = start(imported, tmp, "reference", *LAYOUTS[devices], devices=devices)[1].params
            batch = jax.device_put(pair_rows(), trainer.batch_shardings(data.batch_sharding(trainer.cfg, trainer.mesh)))
            with mesh_context(trainer.mesh, trainer.rules):
                grads, sums = jax.jit(trainer._grads)(state.params, batch, None, reference[devices])
                metrics = jax.jit(trainer.objective.metrics)(sums)
            pairs = float(sums["weight_sum"])
            cache[case, devices] = (float(sums["loss_sum"]) / pairs, jax.device_get(metrics),
                                    jax.tree.map(lambda g: np.asarray(g) / pairs, jax.device_get(grads)))
        return cache[case, devices]

    return run


# TRL's metric names -> maxshard's
METRICS = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
           "rewards/accuracies": "rewards/accuracy", "rewards/margins": "rewards/margin",
           "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected", "nll_loss": "nll_loss",
           "log_odds_ratio": "log_odds_ratio", "log_odds_chosen": "log_odds_chosen"}


@pytest.mark.parametrize("case", list(OBJECTIVES))
def test_loss_metrics_and_gradients_equal_trl(runs, imported, tmp_path, case):
    want = CASES["preference"][case]
    loss, metrics, grads = runs(case, 1)
    assert loss == pytest.approx(want["loss"], abs=TOLERANCE)
    for trl_name, name in METRICS.items():
        if trl_name in want["metrics"] and name in metrics:
            assert float(metrics[name]) == pytest.approx(want["metrics"][trl_name], abs=TOLERANCE, rel=TOLERANCE), name
    trl_grads = start(imported, tmp_path, case)[1].params
    assert max_relative_difference(grads, trl_grads) < TOLERANCE


@pytest.mark.parametrize("case", ["dpo", "orpo"])
def test_fsdp_and_tensor_equal_one_device(runs, case):
    loss, metrics, grads = runs(case, 8)
    one_loss, one_metrics, one_grads = runs(case, 1)
    assert loss == pytest.approx(one_loss, abs=1e-6)
    assert max_relative_difference(grads, one_grads) < 1e-5
    for name, value in one_metrics.items():
        assert float(metrics[name]) == pytest.approx(float(value), abs=1e-5), name


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
