"""The compiled step has the last word on memory: auto falls back when XLA's peak exceeds the usable memory, and an
explicit policy is refused only by its compiled peak (or by a plan far over).

The plan is made to under-state every policy's peak (as it did for `none` on an H100, 4-6% low), so it lets a
policy through that the compiled program then rejects; the runs go through `maxshard.train.main` as a user's would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maxshard import train
from maxshard.errors import ConfigError
from maxshard.spec.remat import NAMES
from maxshard.planning import fit
from maxshard.planning.compiled import compile_train_step, peak_bytes
from maxshard.run import loading
from tests.helpers import mesh_for, tiny_config

BASE = str(Path(__file__).resolve().parent.parent / "configs" / "base.yml")
RUN = ("dataset_type=synthetic", "emb_dim=64", "num_layers=2", "num_heads=4", "num_kv_heads=4", "head_dim=16",
       "mlp_dim=256", "max_target_length=64", "per_device_batch_size=2", "steps=2", "log_period=1", "eval_period=0",
       "enable_checkpointing=false", "enable_tensorboard=false", "ici_fsdp_parallelism=8")


@pytest.fixture(scope="module")
def compiled_peaks() -> dict[str, int]:
    """XLA's peak per device of the run's step under `none` and `full`, compiled from abstract inputs."""
    peaks = {}
    for policy in ("none", "full"):
        cfg = tiny_config(*RUN[1:], f"remat_policy={policy}")
        peaks[policy] = peak_bytes(compile_train_step(cfg, mesh_for(cfg)).memory_analysis())
    assert peaks["full"] < peaks["none"]
    return peaks


@pytest.fixture
def plan_too_low(monkeypatch):
    """A plan that says every policy needs one byte: it lets everything through."""
    monkeypatch.setattr(fit, "_planned", lambda cfg: (dict.fromkeys(NAMES, 1), dict.fromkeys(NAMES, 0)))


def _gb_for(usable_bytes: float) -> str:
    """device_memory_gb whose usable share (less the 10% headroom) is `usable_bytes`."""
    return f"device_memory_gb={usable_bytes / 0.9 / 1e9:.9f}"


def test_auto_falls_back_until_the_compiled_step_fits(compiled_peaks, plan_too_low, tmp_path, capsys):
    usable = (compiled_peaks["none"] + compiled_peaks["full"]) / 2
    argv = [BASE, *RUN, "remat_policy=auto", _gb_for(usable), f"base_output_directory={tmp_path}"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert "remat: auto -> none" in out  # what the (wrong) plan chose
    assert "remat_policy=none compiled to a peak of" in out and "compiling remat_policy=minimal instead" in out
    chosen = out.split("compiled the train step in ")[1].split("remat_policy=")[1].split(")")[0]
    assert chosen != "none" and "step 2/2" in out
    records = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    peak = next(r["memory/compiled_peak_bytes"] for r in records if "memory/compiled_peak_bytes" in r)
    assert peak <= usable


def test_an_explicit_policy_is_refused_by_its_compiled_peak(compiled_peaks, plan_too_low, tmp_path, capsys):
    usable = compiled_peaks["none"] * 0.8
    argv = [BASE, *RUN, "remat_policy=none", _gb_for(usable), f"base_output_directory={tmp_path}"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxshard: error: remat_policy=none compiles to a peak of "), err
    assert "(XLA's memory analysis)" in err[0] and "try remat_policy=minimal or auto" in err[0]


def test_a_plan_far_over_still_refuses_before_compiling():
    """Beyond the planner's checked error (15%) the plan alone refuses, as before any compile."""
    cfg = tiny_config(*RUN[1:], "remat_policy=none")
    planned = fit.peaks_by_policy(cfg)["none"]
    with pytest.raises(ConfigError, match="remat_policy=none needs .* per device \\(planned peak\\)"):
        loading.check_memory(cfg, fit.Capacity(int(planned / (1 + fit.PLAN_ERROR) / 0.9 * 0.95), "test"))
    slightly_over = fit.Capacity(int(planned / 0.9 / 1.05), "test")  # 5% over: left to the compiled step
    assert loading.check_memory(cfg, slightly_over).memory_fit.fits is False


def test_auto_compiles_a_policy_the_plan_put_just_over_and_takes_it_when_it_fits(monkeypatch, tmp_path, capsys):
    """Compiles decide, in the trainer as in `maxshard.plan` (run/auto_compile.py): a plan that puts the two
    policies that re-run nothing just over the usable memory (within its error) picks a costlier one, but the
    trainer compiles those first and runs the first that fits; its record keeps the request."""
    usable = 0.9e9  # device_memory_gb=1 less the 10% headroom
    over = int(usable * (1 + fit.PLAN_ERROR / 2))
    monkeypatch.setattr(fit, "_planned", lambda cfg: ({p: over if p in ("none", "minimal") else 1 for p in NAMES},
                                                      dict.fromkeys(NAMES, 0)))
    argv = [BASE, *RUN, "remat_policy=auto", "device_memory_gb=1", f"base_output_directory={tmp_path}"]
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    estimated = out.split("remat: auto -> ")[1].split(",")[0]
    assert estimated not in ("none", "minimal"), out
    assert "compiled the train step in " in out and "(remat_policy=none): peak" in out, out
    assert "compiling remat_policy=" not in out  # none, the first compiled, fits
