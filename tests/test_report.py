"""The layout report and `tools/sharding_report.py`: the classic per-device shapes table of each strategy preset.

Shapes use D = emb_dim, F = mlp_dim, H = num_heads, K = head_dim, L = num_layers, V = vocab. The golden table under
tests/golden/ is regenerated deliberately with `UPDATE_GOLDEN=1 pytest tests/test_report.py`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from maxshard.config import MESH_AXES
from maxshard.observe import report
from maxshard.parallel.sharding import ParamLayout
import cli_processes

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "sharding_report.py"
GOLDEN = Path(__file__).resolve().parent / "golden"
CONFIGS = REPO / "configs"

# A small model whose every dimension divides by 8, so all four strategies apply on 8 devices.
L, D, H, K, F = 2, 64, 8, 8, 256
SMALL = [f"num_layers={L}", f"emb_dim={D}", f"num_heads={H}", f"num_kv_heads={H}", f"head_dim={K}", f"mlp_dim={F}",
         "max_target_length=16", "per_device_batch_size=1"]
V = 384  # the byte tokenizer's 259 ids padded to a multiple of 128


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sharding_report", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def plan(preset: str, *overrides: str, num_devices: int = 8) -> report.Report:
    cfg = tool.load_config([str(CONFIGS / preset), *overrides], num_devices)
    return tool.make_report(cfg)


def by_name(rep: report.Report) -> dict[str, ParamLayout]:
    return {p.name.removeprefix("params/decoder/layers/").removeprefix("params/"): p for p in rep.params}


def shown(sizes: dict[str, int]) -> dict[str, int]:
    return {axis: size for axis, size in sizes.items() if size > 1}


# --------------------------------------------------------------------------------------------- strategies


def test_dp_keeps_everything_whole_on_every_device() -> None:
    rep = plan("dp.yml", *SMALL)
    assert shown(rep.mesh) == {"data": 8}
    for p in rep.params:
        assert (p.local_shape, p.replication) == (p.global_shape, 8), p.name
    assert rep.replicated_fraction == 1.0
    assert (rep.batch.global_shape, rep.batch.local_shape, rep.batch.replication) == ((8, 16), (1, 16), 1)


def test_fsdp_shards_embed_eight_ways() -> None:
    rep = plan("fsdp.yml", *SMALL)
    rows = by_name(rep)
    assert shown(rep.mesh) == {"fsdp": 8}
    assert rows["mlp/wi_0/kernel"].local_shape == (L, D // 8, F)
    assert rows["mlp/wo/kernel"].local_shape == (L, F, D // 8)
    assert rows["attention/query/kernel"].local_shape == (L, D // 8, H, K)
    assert rows["token_embed/embedding"].local_shape == (V, D // 8)
    assert rows["final_norm/scale"].replication == 8
    assert all(p.replication == 1 for name, p in rows.items() if "kernel" in name)


def test_tp_splits_heads_mlp_and_vocab_eight_ways() -> None:
    rep = plan("tp.yml", *SMALL)
    rows = by_name(rep)
    assert shown(rep.mesh) == {"tensor": 8}
    assert rows["mlp/wi_0/kernel"].local_shape == (L, D, F // 8)
    assert rows["mlp/wo/kernel"].local_shape == (L, F // 8, D)
    for proj in ("query", "key", "value"):
        assert rows[f"attention/{proj}/kernel"].local_shape == (L, D, H // 8, K)
    assert rows["attention/out/kernel"].local_shape == (L, H // 8, K, D)
    assert rows["logits/kernel"].local_shape == (D, V // 8)
    assert rep.batch.replication == 8  # the batch is not split: every device sees all of it


def test_fsdp_tp_on_a_4x2_mesh() -> None:
    rep = plan("fsdp_tp.yml", *SMALL)
    rows = by_name(rep)
    assert shown(rep.mesh) == {"fsdp": 4, "tensor": 2}
    assert rows["mlp/wi_0/kernel"].local_shape == (L, D // 4, F // 2)  # W_in [D, F] -> [D/4, F/2]
    assert rows["mlp/wo/kernel"].local_shape == (L, F // 2, D // 4)  # W_out [F, D] -> [F/2, D/4]
    assert rows["attention/query/kernel"].local_shape == (L, D // 4, H // 2, K)
    assert rows["attention/out/kernel"].local_shape == (L, H // 2, K, D // 4)
    assert rows["mlp/wi_0/kernel"].bytes_per_device == L * D // 4 * F // 2 * 4
    assert rep.batch.local_shape == (2, 16) and rep.batch.replication == 2


@pytest.mark.parametrize("preset", ["dp.yml", "fsdp.yml", "tp.yml", "fsdp_tp.yml"])
def test_strategy_presets_only_set_ici_knobs(preset: str) -> None:
    lines = [ln for ln in (CONFIGS / preset).read_text(encoding="utf-8").splitlines() if ln and ln[0] != "#"]
    assert lines[0] == "base_config: base.yml"
    assert all(ln.startswith("ici_") and "#" in ln for ln in lines[1:]), lines


def test_totals_add_up() -> None:
    rep = plan("fsdp_tp.yml", *SMALL)
    assert rep.param_bytes_per_device == sum(p.bytes_per_device for p in rep.params)
    assert rep.gradient_bytes_per_device == rep.param_bytes_per_device
    extra = rep.optimizer_bytes_per_device - 2 * rep.param_bytes_per_device  # AdamW: mu and nu
    assert 0 <= extra <= 64  # plus step counters (int32 scalars)
    assert 0 < rep.replicated_fraction < 0.05  # only the norm scales are whole on every device


def test_8b_plans_for_256_devices_without_them() -> None:
    rows = by_name(plan("fsdp_tp.yml", "model_name=8b", num_devices=256))
    assert rows["mlp/wi_0/kernel"].local_shape == (32, 4096 // 128, 14336 // 2)
    assert rows["token_embed/embedding"].local_shape == (128256 // 2, 4096 // 128)


# --------------------------------------------------------------------------------------------- the tool


def run_tool(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = tool.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_tool(capsys, str(CONFIGS / "base.yml"), "--json", "--num-devices", "8",
                              "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", *SMALL)
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert set(data) == {"mesh", "params", "batch", "totals"}
    assert shown(data["mesh"]) == {"fsdp": 4, "tensor": 2} and len(data["mesh"]) == len(MESH_AXES)
    keys = {"name", "logical_axes", "spec", "global_shape", "local_shape", "bytes_per_device", "replication"}
    assert all(keys <= set(p) for p in data["params"])
    wi = next(p for p in data["params"] if p["name"] == "params/decoder/layers/mlp/wi_0/kernel")
    assert wi["logical_axes"] == ["layers", "embed", "mlp"]
    assert wi["spec"][0] == "stage" and wi["spec"][1][0] == "fsdp" and "tensor" in wi["spec"][2]
    assert (wi["global_shape"], wi["local_shape"]) == ([L, D, F], [L, D // 4, F // 2])
    assert (wi["bytes_per_device"], wi["replication"]) == (L * D // 4 * F // 2 * 4, 1)
    totals = data["totals"]
    assert totals["param_bytes_per_device"] == sum(p["bytes_per_device"] for p in data["params"])
    assert data["batch"]["local_shape"] == [2, 16]


def test_tool_without_num_devices_uses_the_devices_jax_sees(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_tool(capsys, str(CONFIGS / "tp.yml"), "--json", *SMALL)
    assert code == 0 and shown(json.loads(out)["mesh"]) == {"tensor": 8}


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["steps=x"], "steps expects int"),
        (["ici_fsdp_parallelism=3"], "ici parallelism product 3"),
        (["ici_fsdp_parallelism=1", "ici_tensor_parallelism=8", "num_heads=4"], "is not divisible by 8"),
        (["--num-devices", "0"], "--num-devices must be >= 1"),
    ],
)
def test_tool_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    code, out, err = run_tool(capsys, str(CONFIGS / "base.yml"), "--num-devices", "8", *argv)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("sharding_report: error: ") and fragment in err


def test_tool_runs_as_a_script() -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, str(TOOL), "configs/fsdp_tp.yml", "model_name=tiny", "--num-devices", "8", "--json"]
    result = cli_processes.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert shown(json.loads(result.stdout)["mesh"]) == {"fsdp": 4, "tensor": 2}


# --------------------------------------------------------------------------------------------- golden table


def test_golden_table_tiny_fsdp4_tp2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_tool(capsys, str(CONFIGS / "fsdp_tp.yml"), "model_name=tiny", "--num-devices", "8")
    assert code == 0
    golden = GOLDEN / "sharding_report_tiny_fsdp4_tp2.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(out, encoding="utf-8")
    assert golden.exists(), f"missing {golden}; create it with UPDATE_GOLDEN=1"
    assert out == golden.read_text(encoding="utf-8")
