"""The XPK launcher: target table, workload names, config validation for the target, quoting, golden commands."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from maxshard import devices
from maxshard.errors import ConfigError
from maxshard.launch import topologies, xpk

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
FLAGS = ["--cluster", "c1", "--project", "p1", "--zone", "us-east5-a", "--docker-image", "gcr.io/p1/maxshard:v1"]
# Values with everything a shell would act on; str keys keep text exactly as typed, so the config accepts them.
NASTY = [
    "base_output_directory=gs://b/two words",
    "dataset_path=it's \"quoted\" ; rm -rf / && echo $HOME `whoami` $(touch PWNED) \\ * ?",
    "mesh_selector=",
    "tokenizer_path=tab\there|pipe>redirect<in&bg #comment ~user {a,b} [x] !!",
]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer argv names configs/base.yml relative to the repository, as a user would."""
    monkeypatch.chdir(REPO)


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str], **kwargs: object) -> tuple[int, str, str]:
    code = xpk.main(argv, **kwargs)  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------------------------- topologies


@pytest.mark.parametrize(
    "device_type, slices, name, chips, hosts, devices, kind",
    [
        ("v5p-256", 2, "v5p-256", 128, 32, 256, "TPU v5"),
        ("v4-8", 1, "v4-8", 4, 1, 4, "TPU v4"),
        ("v4-16", 1, "v4-16", 8, 2, 8, "TPU v4"),
        ("v5e-8", 1, "v5litepod-8", 8, 1, 8, "TPU v5 lite"),
        ("v5litepod-16", 3, "v5litepod-16", 16, 4, 48, "TPU v5 lite"),
        ("V6E-256", 1, "v6e-256", 256, 64, 256, "TPU v6 lite"),
        ("h100-80gb-8", 2, "h100-80gb-8", 8, 1, 16, "NVIDIA H100 80GB HBM3"),
        ("h200-141gb-8", 4, "h200-141gb-8", 8, 1, 32, "NVIDIA H200"),
    ],
)
def test_topology_table(device_type, slices, name, chips, hosts, devices, kind):
    target = topologies.parse(device_type, slices)
    assert (target.name, target.chips_per_slice, target.hosts_per_slice) == (name, chips, hosts)
    assert (target.num_devices, target.num_hosts, target.device_kind) == (devices, hosts * slices, kind)


def test_every_device_kind_has_a_peak_for_mfu():
    kinds = [f.device_kind for f in topologies.TPU_FAMILIES] + [g.device_kind for g in topologies.GPU_TYPES.values()]
    assert [k for k in kinds if devices.peak_flops(k) is None] == []


@pytest.mark.parametrize("bad", ["v5p-12", "v5e-2", "v7x-8", "h100", "tpu"])
def test_unknown_device_type_lists_accepted_forms(bad):
    with pytest.raises(ConfigError, match="v5p-N.*v5litepod-N/v5e-N.*h100-80gb-8") as e:
        topologies.parse(bad)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------- workload names


@pytest.mark.parametrize("name", ["a", "run-1", "maxshard-1121-2345-ab12", "x" * 40])
def test_valid_workload_names(name):
    assert xpk.validate_workload_name(name) == name


@pytest.mark.parametrize("name", ["", "Run", "run_1", "1run", "run-", "-run", "run.1", "x" * 41])
def test_invalid_workload_names(name):
    with pytest.raises(ConfigError, match="--workload"):
        xpk.validate_workload_name(name)


@pytest.mark.parametrize(
    "run_name, expected",
    [
        ("default", "maxshard-1121-2345-ab12"),
        ("My_Run.7", "my-run-7-1121-2345-ab12"),
        ("007", "run-007-1121-2345-ab12"),
        ("__", "maxshard-1121-2345-ab12"),
        ("a-very-long-experiment-n-for-llama", "a-very-long-experiment-n-1121-2345-ab12"),  # no "--"
        ("a-very-long-experiment-name-for-llama", "a-very-long-experiment-na-1121-2345-ab12"),  # 40 chars
    ],
)
def test_generated_workload_names(run_name, expected):
    assert xpk.make_workload_name(run_name, "1121-2345-ab12") == expected


def test_default_suffix_makes_valid_distinct_names():
    names = {xpk.make_workload_name("x" * 60, xpk.default_suffix()) for _ in range(5)}
    assert len(names) == 5
    assert all(xpk.validate_workload_name(n) and len(n) == 40 for n in names)


# --------------------------------------------------------------------------------------------- trainer argv


def test_num_slices_and_run_name_are_added(capsys):
    code, out, _ = run_main([*FLAGS, "--device-type", "v5p-16", "--num-slices", "2", "--", "configs/base.yml"],
                            capsys, suffix="0101-0000-beef")
    command = shlex.split(out)
    trainer = shlex.split(command[command.index("--command") + 1])
    assert code == 0
    assert trainer[3:] == ["configs/base.yml", "num_slices=2", "run_name=maxshard-0101-0000-beef"]


def test_user_run_name_and_num_slices_are_kept(capsys):
    argv = [*FLAGS, "--device-type", "v5p-16", "--num-slices", "2", "--workload", "w1", "--",
            "configs/base.yml", "num_slices=2", "run_name=mine"]
    code, out, _ = run_main(argv, capsys)
    trainer = shlex.split(shlex.split(out)[-1])
    assert code == 0
    assert trainer[3:] == ["configs/base.yml", "num_slices=2", "run_name=mine"]


@pytest.mark.parametrize(
    "device_type, slices, tokens, message",
    [
        ("v5p-256", 2, ["ici_fsdp_parallelism=3"], r"ici_fsdp_parallelism=3.*target v5p-256 x 2 slices"),
        ("h100-80gb-8", 2, ["dcn_data_parallelism=4"], r"dcn_data_parallelism=4.*h100-80gb-8 x 2 nodes"),
        ("v5p-256", 2, ["num_slices=4"], r"num_slices=4 does not match the target's 2 slices"),
        ("v5p-256", 1, ["per_device_batch_size=0.001"], r"per_device_batch_size"),
        ("v5p-256", 1, ["no_such_key=1"], r"unknown key 'no_such_key'"),
        ("v5p-256", 1, ["run_name=a\nb"], r"newline"),
        ("v5p-255", 1, [], r"not a v5p slice size"),
        ("v5p-256", 0, [], r"--num-slices must be >= 1"),
        ("h100-96gb-8", 1, [], r"h100-96gb-8 is a node type for planning.*not one XPK creates"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(capsys, device_type, slices, tokens, message):
    argv = [*FLAGS, "--device-type", device_type, "--num-slices", str(slices), "--", "configs/base.yml", *tokens]
    code, out, err = run_main(argv, capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("maxshard: error: ")
    assert re.search(message, err), err


def test_missing_config_and_bad_flags_exit_2(capsys):
    code, _, err = run_main([*FLAGS, "--device-type", "v5p-8"], capsys)
    assert code == 2 and "after --" in err
    code, _, err = run_main([*FLAGS, "--device-type", "v5p-8", "--priority", "urgent", "--", "configs/base.yml"],
                            capsys)
    assert code == 2 and "--priority" in err
    code, _, err = run_main([*FLAGS, "--device-type", "v5p-8", "--workload", "Bad_Name", "--", "configs/base.yml"],
                            capsys)
    assert code == 2 and "--workload 'Bad_Name'" in err


# --------------------------------------------------------------------------------------------- golden commands


def _golden(name: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(argv, capsys)
    assert (code, err) == (0, "")
    path = GOLDEN / name
    if os.environ.get("MAXSHARD_UPDATE_GOLDEN"):
        path.write_text(out)
    assert out == path.read_text(), f"regenerate with MAXSHARD_UPDATE_GOLDEN=1 if the change is intended: {path}"


def test_golden_tpu(capsys):
    argv = ["--cluster", "c1", "--project", "p1", "--zone", "us-east5-a", "--device-type", "v5p-256",
            "--num-slices", "2", "--docker-image", "us-docker.pkg.dev/p1/repo/maxshard:v1", "--priority", "high",
            "--max-restarts", "3", "--workload", "llama-8b-v5p", "--", "configs/base.yml", "steps=1000",
            "ici_fsdp_parallelism=128", "base_output_directory=gs://bucket/maxshard runs"]
    _golden("xpk_tpu.txt", argv, capsys)


def test_golden_gpu(capsys):
    argv = ["--cluster", "c2", "--project", "p1", "--zone", "us-central1-c", "--device-type", "h100-80gb-8",
            "--num-slices", "2", "--base-docker-image", "us-docker.pkg.dev/p1/repo/maxshard-deps:v1",
            "--workload", "gpu-run", "--", "configs/base.yml", "ici_fsdp_parallelism=8", "run_name=h100-test"]
    _golden("xpk_gpu.txt", argv, capsys)


# --------------------------------------------------------------------------------------------- quoting, for real


def _fake_program(directory: Path, name: str) -> Path:
    """An executable that prints its argv (after argv[0]) as JSON: stands in for xpk or python."""
    path = directory / name
    path.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    path.chmod(0o755)
    return path


def test_command_reaches_the_trainer_byte_identical(tmp_path):
    tokens = ["configs/base.yml", *NASTY, "run_name=r"]
    target = topologies.parse("v5p-8")
    request = xpk.Request("c", "p", "z", target, "w", tuple(tokens), docker_image="i")
    program = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]
    command = xpk.xpk_argv(request, program)[-1]
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert json.loads(done.stdout) == tokens
    assert list(tmp_path.iterdir()) == []  # $(touch PWNED) did not run


def test_printed_line_survives_two_shells(tmp_path, capsys):
    """The printed line through bash into a fake xpk, then its --command through bash into a fake python."""
    argv = [*FLAGS, "--device-type", "v5p-8", "--workload", "w", "--", "configs/base.yml", *NASTY]
    code, out, _ = run_main(argv, capsys)
    assert code == 0 and out.count("\n") == 1
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake_program(bin_dir, "xpk")
    _fake_program(bin_dir, "python")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    xpk_seen = json.loads(subprocess.run(["bash", "-c", out], capture_output=True, text=True, env=env,
                                         cwd=tmp_path, check=True).stdout)
    assert xpk_seen[:2] == ["workload", "create"]
    command = xpk_seen[xpk_seen.index("--command") + 1]
    trainer_seen = json.loads(subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env,
                                             cwd=tmp_path, check=True).stdout)
    assert trainer_seen == ["-m", "maxshard.train", "configs/base.yml", *NASTY, "num_slices=1", "run_name=w"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]


# --------------------------------------------------------------------------------------------- execute


def test_execute_runs_xpk_and_returns_its_code(capsys):
    calls = []

    def fake_run(command, check):
        calls.append(command)
        return subprocess.CompletedProcess(command, 7)

    argv = [*FLAGS, "--device-type", "h100-80gb-8", "--workload", "w", "--execute", "--", "configs/base.yml"]
    code, out, _ = run_main(argv, capsys, which=lambda name: f"/usr/bin/{name}", run=fake_run)
    assert (code, out) == (7, "")
    assert calls[0][:3] == ["xpk", "workload", "create"]
    assert calls[0][calls[0].index("--num-nodes") + 1] == "1"


def test_execute_without_xpk_is_one_line(capsys):
    argv = [*FLAGS, "--device-type", "v5p-8", "--execute", "--", "configs/base.yml"]
    code, out, err = run_main(argv, capsys, which=lambda name: None, run=None)
    assert (code, out) == (2, "")
    assert err == "maxshard: error: xpk is not on PATH; pip install xpk, or drop --execute\n"


def test_module_entry_point_has_no_traceback():
    argv = [sys.executable, "-m", "maxshard.launch", "xpk", *FLAGS, "--device-type", "v5p-256", "--num-slices", "2",
            "--", "configs/base.yml", "ici_fsdp_parallelism=3"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("maxshard: error: ici parallelism product 3 (ici_fsdp_parallelism=3)")
    assert done.stderr.count("\n") == 1
