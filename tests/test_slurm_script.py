"""The SLURM launcher without SLURM: the script's text, the checks on every flag, and the script itself run by bash
with stand-ins for srun and scontrol (the requeue decision, the wiring, hostile values). tests/test_slurm.py runs the
same scripts on a real SLURM."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from maxshard.errors import ConfigError
from maxshard.launch import __main__ as launch_main
from maxshard.launch import slurm

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer argv names configs/base.yml relative to the repository, as a user would."""
    monkeypatch.chdir(REPO)


def make(*argv: str, suffix: str = "0000-0000-abcd") -> slurm.Job:
    args = slurm.build_parser().parse_intermixed_args(list(argv))
    return slurm.make_job(args, suffix)


def sbatch_lines(job: slurm.Job) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in slurm.render(job).splitlines() if line.startswith("#SBATCH ")]


# --------------------------------------------------------------------------------------------- the script's text


def test_one_task_per_node_with_all_its_gpus(tmp_path):
    job = make("configs/base.yml", "steps=10", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
               "--time", "4:00:00", "--account", "proj", "--log-dir", str(tmp_path))
    assert sbatch_lines(job) == [
        "--job-name=maxshard-0000-0000-abcd", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8",
        "--partition=gpu", "--time=4:00:00", "--account=proj", f"--output={tmp_path}/slurm-%j.out",
        f"--error={tmp_path}/slurm-%j.err", "--open-mode=append", "--signal=TERM@120", "--requeue",
    ]
    # A node is a slice (as on XPK); the run is named after the job, so every requeue resumes the same run.
    assert job.trainers[0][3:] == ("configs/base.yml", "steps=10", "num_slices=4", "run_name=maxshard-0000-0000-abcd")


def test_one_task_per_gpu_binds_one_gpu_each(tmp_path):
    job = make("configs/base.yml", "num_slices=2", "run_name=mine", "--nodes", "2", "--tasks-per-node", "8",
               "--gpus-per-node", "8", "--log-dir", str(tmp_path), "--job-name", "j")
    assert "--ntasks-per-node=8" in sbatch_lines(job) and "--gpus-per-task=1" in sbatch_lines(job)
    assert job.trainers[0][3:] == ("configs/base.yml", "num_slices=2", "run_name=mine")  # the user's values kept


def test_the_run_directory_holds_the_output_unless_remote(tmp_path):
    job = make("configs/base.yml", f"base_output_directory={tmp_path}", "run_name=r")
    assert job.log_dir == str(tmp_path / "r")
    with pytest.raises(ConfigError, match="give --log-dir"):
        make("configs/base.yml", "base_output_directory=gs://bucket/runs")


@pytest.mark.parametrize("value, seconds", [("30", 1800), ("10:30", 630), ("1:00:00", 3600), ("2-0", 172800),
                                             ("1-2:03", 93780), ("0-0:0:5", 5)])
def test_time_limits(value, seconds):
    assert slurm.parse_time(value) == seconds


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--partition", "gpu\n#SBATCH --wrap=id"], "--partition 'gpu\\\\n#SBATCH --wrap=id' cannot go on an #SBATCH"),
        (["--job-name", "a b"], "--job-name 'a b' cannot go on an #SBATCH line"),
        (["--account", "$(id)"], "--account"),
        (["--log-dir", "/tmp/it's"], "--log-dir"),
        (["--time", "1h"], "--time '1h': use MM"),
        (["--time", "2:00", "--signal-lead", "300"], "--signal-lead 300s must be shorter than --time 2:00"),
        (["--nodes", "0"], "--nodes must be >= 1"),
        (["--gpus-per-node", "8", "--tasks-per-node", "3"], "does not split into --tasks-per-node 3"),
        (["--env", "A-B=1"], "--env 'A-B=1'"),
        (["--env", "NOVALUE"], "use NAME=VALUE"),
    ],
)
def test_every_bad_flag_is_one_config_error(flags, message, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("$", r"\$")):
        make("configs/base.yml", "--log-dir", str(tmp_path), *flags)


def test_cli_writes_the_script_or_submits_it(tmp_path, capsys):
    script = tmp_path / "x.sbatch"
    assert slurm.main(["configs/base.yml", "--log-dir", str(tmp_path), "--script", str(script)]) == 0
    assert script.read_text().startswith("#!/bin/bash\n") and f"sbatch {script}" in capsys.readouterr().out
    calls = []

    def sbatch(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "4242;cluster\n", "")

    assert slurm.main(["configs/base.yml", "--log-dir", str(tmp_path), "--script", str(script), "--submit"],
                      run=sbatch) == 0
    assert calls == [["sbatch", "--parsable", str(script)]] and capsys.readouterr().out == "4242\n"
    assert slurm.main(["configs/base.yml", "no_such_key=1", "--log-dir", str(tmp_path)]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert launch_main.main(["slurm", "--help"]) == 0 and "--tasks-per-node" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------- the script, run


STAND_INS = {
    # srun: one task, its SLURM_PROCID, the command as given
    "srun": '#!/bin/bash\nexport SLURM_PROCID=1 SLURM_LOCALID=0\nexec "$@"\n',
    # scontrol: `show hostnames LIST` prints the first host; `requeue ID` is recorded
    "scontrol": '#!/bin/bash\nif [ "$1" = show ]; then echo node7; echo node8; else echo "$@" >> "$CALLS"; fi\n',
}
# The trainer: its argv (NUL-separated) and the wiring it saw; then as MODE says: exit 0, exit 3, or signal the
# wrapper that started it and exit 0 (a trainer that saved on SIGTERM).
TRAINER = """#!/bin/bash
printf '%s\\0' "$@" > "$RECORD"
echo "$JAX_COORDINATOR_ADDRESS $JAX_PROCESS_COUNT $JAX_PROCESS_ID" > "$RECORD.env"
case "$MODE" in
  fail) exit 3 ;;
  signal) kill -TERM "$PPID"; sleep 0.2; exit 0 ;;
esac
"""
HOSTILE = ["dataset_path=it's \"q\" ; $(touch {p}/a) `touch {p}/b` \\ * ?", "tokenizer_path=x\n$(touch {p}/c)\n",
           "base_output_directory={p}/d e && touch {p}/f"]


def run_script(tmp_path: Path, mode: str, *values: str) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    """Renders a job for `values`, runs it with bash as SLURM would start it; (result, trainer argv, log dir)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in {**STAND_INS, "trainer": TRAINER}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    logs = tmp_path / "logs"
    job = make("configs/base.yml", *values, "run_name=r", "--python", str(bin_dir / "trainer"), "--log-dir",
               str(logs), "--env", "EXTRA=$(touch " + str(tmp_path) + "/g)")
    script = Path(slurm.write_script(job, str(tmp_path / "job.sbatch")))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node[7-8]", "SLURM_NTASKS": "2", "RECORD": str(tmp_path / "argv"),
           "CALLS": str(tmp_path / "calls"), "MODE": mode}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    argv = (tmp_path / "argv").read_bytes().decode().split("\0")[:-1]
    return done, argv, logs


def test_script_runs_the_trainer_as_given_and_wires_jax(tmp_path):
    pwned = tmp_path / "pwned"
    pwned.mkdir()
    values = [v.format(p=pwned) for v in HOSTILE]
    done, argv, logs = run_script(tmp_path, "ok", *values)
    assert done.returncode == 0, done.stderr
    assert argv == ["-m", "maxshard.train", "configs/base.yml", *values, "run_name=r"]
    assert list(pwned.iterdir()) == [] and not (tmp_path / "g").exists()
    # the first host, JAX's port for job 4242 (4242 % 4096 + 61440), the task count, this task's SLURM_PROCID
    assert (tmp_path / "argv.env").read_text() == "node7:61586 2 1\n"
    assert (logs / "slurm-4242.exit").read_text() == "0\n" and not (tmp_path / "calls").exists()


def test_a_signalled_run_requeues_and_a_failed_one_does_not(tmp_path):
    done, _, logs = run_script(tmp_path, "signal")
    assert done.returncode == 0 and (tmp_path / "calls").read_text() == "requeue 4242\n", done.stderr
    assert "requeueing job 4242 (restart 0)" in done.stderr and not (logs / "slurm-4242.exit").exists()
    (tmp_path / "calls").unlink()
    done, _, logs = run_script(tmp_path, "fail")
    assert done.returncode == 3 and (logs / "slurm-4242.exit").read_text() == "3\n"
    assert not (tmp_path / "calls").exists()


def test_an_array_runs_the_line_of_its_index(tmp_path):
    job = slurm.Job("sweep", slurm.Resources(), (("echo", "zero"), ("echo", "one $(x)")), str(tmp_path), str(REPO))
    text = slurm.render(job)
    assert "#SBATCH --array=0-1" in text and f"#SBATCH --output={tmp_path}/slurm-%A_%a.out" in text
    assert "  1) trainer=(echo 'one $(x)') ;;" in text
    assert 'printf "%s\\n" "$rc" > ' + str(tmp_path) + '/"slurm-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}.exit"' \
        in text


def test_the_coordinator_is_where_jaxs_own_slurm_detection_puts_it(monkeypatch):
    from jax._src.clusters import slurm_cluster

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[7-8]")
    assert slurm_cluster.SlurmCluster.get_coordinator_address(None, None) == "node7:61586"  # as the script exports


def test_a_sweep_becomes_one_array_of_its_valid_points(tmp_path, capsys):
    from benchmarks import sweep_slurm

    sweep_file = tmp_path / "s.yml"
    sweep_file.write_text("base_config: configs/base.yml\nfixed: {steps: 2}\n"
                          "points: [{name: a}, {name: bad, emb_dim: x}, {name: b, steps: 3}]\n")
    assert sweep_slurm.main([str(sweep_file), "--out", str(tmp_path / "out"), "--nodes", "2"]) == 0
    assert capsys.readouterr().out.startswith("# skipped bad: emb_dim")
    text = (tmp_path / "out" / "slurm" / "s.sbatch").read_text()
    assert "#SBATCH --array=0-1" in text and "#SBATCH --nodes=2" in text
    runs = tmp_path / "out" / "runs"
    assert f"run_name=s-00-a base_output_directory={runs} log_period=1 num_slices=2) ;;" in text
    assert f"steps=3 run_name=s-02-b base_output_directory={runs} log_period=1 num_slices=2) ;;" in text
