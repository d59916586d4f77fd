"""benchmarks/gpu_suite.py, the GPU measurements of issue 72 as one command: its dry run, on CPU, lists every
measurement, and each is a run config that loads for the GPU it is meant for (nothing is trained or compiled)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the suite imports its sibling scripts as the scripts do

import gpu_suite  # noqa: E402

from maxshard.run.target import load_for_target  # noqa: E402


@pytest.fixture(scope="module")
def printed() -> tuple[int, list[str]]:
    """(the deepest 8B depth the planner fits on one H200, the dry run's lines)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gpu_suite.main(["--dry-run"]) == 0
    return gpu_suite.largest_depth("h200-141gb-8"), out.getvalue().splitlines()


def test_the_dry_run_lists_every_measurement_as_a_command(printed: tuple[int, list[str]]) -> None:
    depth, lines = printed
    suite = gpu_suite.measurements(depth, 3)
    assert lines[0].startswith(f"# the 8B widths at {depth} layers"), lines[0]
    assert lines[1:] == [f"{m.name}: {shlex.join(['python', *m.command])}" for m in suite]
    names = {m.name for m in suite}
    assert {"cli", "attention", "remat-8b"} <= names
    for model in ("1b", "8b"):  # bf16 vs 8-bit, default vs tuned XLA:GPU options, for both models
        assert {f"kernels-{model}-{v}" for v in ("bf16", "int8", "fp8", "tuned")} <= names, names
    assert {f"loss-8b-{v}" for v in ("bf16", "int8", "fp8")} <= names, names  # the 8-bit loss curves, 200 steps


def test_every_measurement_loads_as_the_run_it_measures_on_an_h200(printed: tuple[int, list[str]]) -> None:
    """Each command's key=value overrides are the config it measures, and that config is valid for one H200: the
    CLI run is the trainer's own command line, and the 8B rows are at the depth whose planned peak fits."""
    depth, _ = printed
    target = gpu_suite.gpu_target("h200-141gb-8")
    for m in gpu_suite.measurements(depth, 3):
        overrides = [word for word in m.command if "=" in word and not word.startswith("-")]
        assert set(overrides) <= set(m.config), (m.name, set(overrides) - set(m.config))
        cfg = load_for_target(["configs/base.yml", *m.config], target)
        assert cfg.max_target_length == 8192, m.name
        if m.name.startswith("kernels-8b"):
            assert (cfg.model.num_layers, cfg.model.emb_dim, cfg.model.mlp_dim) == (depth, 4096, 14336), m.name
            assert cfg.memory_fit.fits, (m.name, cfg.memory_fit)
        expected = {"int8": "int8", "fp8": "fp8"}.get(m.name.split("-")[-1], "none")
        assert cfg.quantization == expected, m.name
        assert cfg.xla_gpu_options == ("tuned" if m.name.endswith("tuned") else "default"), m.name
    deeper = load_for_target(["configs/base.yml", *gpu_suite.EIGHT_B, f"num_layers={depth + 4}"], target)
    assert depth == 32 or not deeper.memory_fit.fits, "the depth is the deepest that fits"


def test_without_a_gpu_the_suite_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gpu_suite, "has_gpu", lambda: False)
    assert gpu_suite.main(["--only", "cli"]) == 2
    assert capsys.readouterr().err.strip().startswith("gpu_suite.py needs an NVIDIA GPU")


def test_the_kernel_rows_are_printed_in_the_h200_tables_layout(printed: tuple[int, list[str]]) -> None:
    """gpu_kernels.py's RESULT line becomes one row (speed against the table's first row); a failed run says why."""
    depth, _ = printed
    suite = {m.name: m for m in gpu_suite.measurements(depth, 3)}
    bf16 = {"attention": "tokamax", "remat": "none", "peak": "bf16", "step_ms": 400.0, "tokens_per_sec": 40960.0,
            "mfu": 0.4, "kernel_ms": 380.0, "kinds_ms": {"attention": 95.0, "matmul": 190.0, "other fusion": 85.0,
                                                        "copy": 10.0}}
    fp8 = {**bf16, "peak": "fp8 for 75% of the FLOPs, bf16 for the rest", "step_ms": 320.0}
    text = gpu_suite.report([(suite["kernels-1b-bf16"], bf16), (suite["kernels-1b-fp8"], fp8),
                             (suite["kernels-1b-int8"], {"error": "exit 1: out of memory"})], depth)
    lines = text.splitlines()
    assert lines[0] == "1b preset, 8,192 x 2 tokens:" and lines[2].startswith("| run | step | tokens/s/device | MFU |")
    assert lines[4] == ("| bf16, attention auto (tokamax, remat none) | 400.0 ms (1.00x) | 40,960 | 40.0% (bf16) | "
                        "95.0 ms (25.0%) | 190.0 | 85.0 | 10.0 |")
    assert lines[5].startswith("| fp8, attention auto (tokamax, remat none) | 320.0 ms (1.25x) | 40,960 | 40.0% (fp8 ")
    assert lines[6] == "| int8, attention auto | exit 1: out of memory | | | | | | |"


def test_a_cli_run_is_read_from_its_metrics_file(tmp_path: Path) -> None:
    """Medians of the logged steps after the first period (which holds the compile), the last quarter's mean loss."""
    run = tmp_path / "loss-8b-fp8"
    run.mkdir()
    records = [{"step": 0, "startup": {"attention": "tokamax"}}] + [
        {"step": 10 * i, "loss": 10.0 - i, "step_time": 9.0 if i == 1 else 0.5 + 0.1 * i,
         "tokens_per_sec_per_device": 1000.0 * i, "mfu": 0.1 * i} for i in range(1, 9)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    figures = gpu_suite.cli_figures(str(tmp_path), "loss-8b-fp8")
    assert figures["step_ms"] == pytest.approx(1000 * (0.5 + 0.5))  # the median of steps 2..8, not step 1's 9 s
    assert figures["tokens_per_sec"] == 5000.0 and figures["mfu"] == pytest.approx(0.5)
    assert figures["loss_tail"] == pytest.approx(2.5) and figures["startup"] == {"attention": "tokamax"}
