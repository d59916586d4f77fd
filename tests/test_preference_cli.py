"""SimPO and ORPO through `maxshard.train` (the CLI's entry point, in this process) on a preference JSONL: the tiny
preset, byte-level tokenizer, a few steps. Their math against TRL is test_objectives.py's; here the path a user runs:
the keys parse, the reader packs the pairs, the step trains, and the metrics each objective reports reach
metrics.jsonl with a finite loss that moves. DPO's CLI run is test_objectives.py's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from maxshard import train

STEPS = 4
# objective -> (its keys, the metrics it reports beside the loss)
OBJECTIVES = {
    "simpo": (("objective=simpo", "simpo_beta=2.0", "simpo_gamma=0.5"),
              ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")),
    "orpo": (("objective=orpo", "orpo_lambda=0.1"),
             ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "nll_loss",
              "log_odds_ratio", "log_odds_chosen")),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sixteen pairs whose chosen replies repeat one word and rejected ones another."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    records = [{"prompt": f"q{i}:", "chosen": " yes" * (1 + i % 3), "rejected": " no" * (1 + i % 4)} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_trains_through_the_cli_and_writes_its_metrics(tmp_path, pairs, objective):
    keys, reported = OBJECTIVES[objective]
    argv = ["configs/base.yml", "model_name=tiny", "dataset_type=preference", f"dataset_path={pairs}", *keys,
            f"steps={STEPS}", "log_period=1", "eval_period=0", "eval_fraction=0", f"checkpoint_period={STEPS}",
            "per_device_batch_size=1", "learning_rate=3e-3", "warmup_steps_fraction=0",
            f"base_output_directory={tmp_path}", f"run_name={objective}", "enable_tensorboard=false"]
    assert train.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / objective / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in steps]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    for record in steps:
        assert all(math.isfinite(record[name]) for name in reported), (objective, sorted(record))
    assert 0.0 <= steps[-1]["rewards/accuracy"] <= 1.0 and steps[-1]["rewards/margin"] > steps[0]["rewards/margin"]
