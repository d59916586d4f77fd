"""SimPO, ORPO and KTO through `maxshard.train` (the CLI's entry point, in this process) on a preference JSONL: the
tiny preset, byte-level tokenizer, a few steps. Their math against TRL is test_objectives.py's (KTO's test_kto.py's);
here the path a user runs: the keys parse, the reader packs the pairs (KTO: unpaired records), the step trains, and
the metrics each objective reports reach metrics.jsonl with a finite loss that moves. DPO's CLI run is
test_objectives.py's."""

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


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sixteen unpaired records (TRL's KTO form): replies of one word desirable, of another undesirable."""
    path = tmp_path_factory.mktemp("unpaired") / "unpaired.jsonl"
    records = [{"prompt": f"q{i}:", "completion": (" yes" if i % 2 else " no") * (1 + i % 3), "label": bool(i % 2)}
               for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_kto_trains_through_the_cli_and_writes_its_metrics(tmp_path, unpaired):
    """A fresh KTO run's policy is its (frozen) reference: every log-ratio and the KL point are 0, so the first loss
    is 1 - sigmoid(0) = 0.5; then it falls, desirable rewards rise above undesirable ones, and kl is reported; with
    the reference precomputed the losses are the same."""
    argv = ["configs/base.yml", "model_name=tiny", "dataset_type=preference", f"dataset_path={unpaired}",
            "objective=kto", "kto_beta=0.5", "kto_undesirable_weight=1.5", f"steps={STEPS}", "log_period=1",
            "eval_period=0", "eval_fraction=0", f"checkpoint_period={STEPS}", "per_device_batch_size=1",
            "learning_rate=3e-3", "warmup_steps_fraction=0", f"base_output_directory={tmp_path}", "run_name=kto",
            "enable_tensorboard=false"]
    assert train.main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "kto" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in steps]
    assert losses[0] == pytest.approx(0.5 * (1 + 1.5) / 2, abs=0.1) and losses[-1] < losses[0], losses
    for record in steps:
        assert all(math.isfinite(record[name]) for name in ("rewards/chosen", "rewards/rejected", "rewards/margin",
                                                            "logps/chosen", "logps/rejected", "kl")), sorted(record)
    assert steps[0]["kl"] == 0.0 and steps[-1]["rewards/margin"] > steps[0]["rewards/margin"]
    # kto_reference=precomputed: a first pass scores every train batch's completions and KL completions with the
    # starting model, and the run keeps no reference, yet trains as the frozen one
    stored = [*argv[:-2], "run_name=stored", "kto_reference=precomputed", argv[-1]]
    assert train.main(stored) == 0
    again = [json.loads(line) for line in (tmp_path / "stored" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again if "loss" in r and "step" in r] == pytest.approx(losses, abs=1e-6)
    assert len(list((tmp_path / "stored" / "reference_logps").glob("*.npy"))) == STEPS
