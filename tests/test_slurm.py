"""`python -m maxshard.launch slurm` against a real SLURM: a one-node cluster on localhost (tests/slurm_cluster.py;
the packages are installed when missing and this is root, as on CI), jobs submitted through the CLI.

- the scripts the CLI wrote and submitted (one task, two tasks with every flag, an array) pass `sbatch --test-only`;
- a 2-task job trains the tiny model with 2 processes (SLURM's task ids and nodelist wired into jax.distributed)
  and logs the losses of the 1-process run, step by step;
- `scancel --signal=TERM` mid-run: the run saves and stops, the job requeues itself, the next start resumes from
  the checkpoint, and the losses are those of the uninterrupted run, bit for bit; a job that completes runs once;
- a sweep of two points as one job array (benchmarks/sweep_slurm.py) runs both and collects their rows;
- values with quotes, `$(...)`, backticks and newlines reach the program exactly and never run.

The uninterrupted 1-process run the others compare with is index 0 of that job array (`straight`). All runs share
conftest's compilation cache (sbatch passes the environment on to the jobs).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import slurm_cluster
from helpers import process_env
from test_multiprocess import TINY

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
# One process with 8 CPU devices; a schedule of fixed length, so the learning rate does not depend on `steps`.
ONE = [*TINY, "cpu_device_count=8", "ici_fsdp_parallelism=8", "learning_rate_schedule_steps=100",
       "checkpoint_period=100000", "enable_tensorboard=false"]
TWO = ["cpu_device_count=4", "num_slices=2", "dcn_data_parallelism=2", "ici_fsdp_parallelism=4"]
STEPS = 50  # the straight run; the preempted one is signalled after its first step
JOB_TIMEOUT_S = 240


def merged(*items: str) -> list[str]:
    """key=value items, the later of a key winning (the trainer refuses a key given twice)."""
    return list({item.split("=", 1)[0]: item for item in items}.values())


@pytest.fixture(scope="session")
def cluster(env):
    reason = slurm_cluster.install()
    if reason is not None:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="maxshard-slurm-"))  # short: munged's socket path has a length limit
    started = slurm_cluster.start(root, process_env(env))
    yield started
    slurm_cluster.stop(started)
    shutil.rmtree(root, ignore_errors=True)


def launch(cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The launcher's CLI in the repository, in the cluster's environment."""
    cmd = [sys.executable, "-m", "maxshard.launch", "slurm", *args]
    done = subprocess.run(cmd, cwd=REPO, env=cluster.env, capture_output=True, text=True)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def submit(cluster, base: Path, name: str, overrides: list[str], *flags: str) -> str:
    """Submits the tiny run `name` under `base` (logs there too); returns the job id."""
    argv = ["configs/base.yml", *merged(*overrides, f"base_output_directory={base}", f"run_name={name}")]
    job_id = launch(cluster, *argv, "--job-name", name, *flags, "--submit").stdout.strip()
    assert job_id.isdigit(), job_id
    return job_id


def passes_test_only(cluster, script: Path) -> None:
    """sbatch accepts the script as it is (`--test-only`: checked and scheduled, not run)."""
    done = cluster.run("sbatch", "--test-only", str(script), check=False)
    assert done.returncode == 0 and "to start at" in done.stderr, done.stderr


def finished(cluster, base: Path, name: str, job_id: str) -> tuple[int, str, str]:
    """Waits for the job; its exit status (from the script's .exit file), stdout and stderr."""
    slurm_cluster.wait_job(cluster, job_id, JOB_TIMEOUT_S)
    logs = base / name / f"slurm-{job_id}"
    out, err = (Path(f"{logs}.{ext}").read_text() if Path(f"{logs}.{ext}").exists() else "" for ext in ("out", "err"))
    exit_file = Path(f"{logs}.exit")
    assert exit_file.exists(), f"no exit status written\n{out[-2000:]}\n{err[-3000:]}\n{cluster.logs()}"
    return int(exit_file.read_text()), out, err


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


def run_sweep(cluster, out: Path) -> list[dict]:
    """A sweep of two points as one job array (benchmarks/sweep_slurm.py, in this process, submitting and waiting
    through the cluster's environment): `straight`, the uninterrupted 1-process run of STEPS steps that the other
    tests compare with, and `four`, the same for 4 steps; and a point the trainer's config parser rejects."""
    from benchmarks import sweep_slurm

    items = (item.split("=", 1) for item in [*ONE, "enable_checkpointing=false"])  # these runs need no save
    fixed = "".join(f"  {key}: {value}\n" for key, value in items if key != "steps")
    sweep_file = out / "pair.yml"
    sweep_file.write_text(f"base_config: configs/base.yml\nfixed:\n{fixed}points: [{{name: straight, steps: {STEPS}}}, "
                          "{name: four, steps: 4}, {name: bad, emb_dim: x}]\n")
    code = sweep_slurm.main([str(sweep_file), "--out", str(out), "--submit"],
                            run=functools.partial(subprocess.run, env=cluster.env))
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert code == 0, rows
    return rows


def signal_after_first_step(cluster, base: Path, name: str, job_id: str) -> None:
    """`scancel --signal=TERM` as soon as the run logged its first step."""
    metrics = base / name / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (metrics.exists() and '"loss"' in metrics.read_text()):
        assert time.monotonic() < deadline and slurm_cluster.job_states(cluster, job_id), "training never started"
        time.sleep(0.1)
    cluster.run("scancel", "--signal=TERM", job_id)


@pytest.fixture(scope="session")
def jobs(cluster, tmp_path_factory) -> dict[str, Future]:
    """Every training job of the file, queued at once from threads: the sweep's array first (its `straight` run
    compiles what the preempted run then loads from the cache), then through the CLI the 2-task job and the job to
    preempt, which gets its SIGTERM once it logged a step. SLURM runs them one after the other as the node's CPUs
    free up, and each CLI start (seconds: it imports JAX) overlaps a running job instead of following it."""
    base = tmp_path_factory.mktemp("jobs")
    sweep_pool, cli_pool = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    (base / "sweep").mkdir()
    futures = {"sweep": sweep_pool.submit(run_sweep, cluster, base / "sweep")}
    deadline = time.monotonic() + 60
    while not cluster.run("squeue", "-h", check=False).stdout.strip() and not futures["sweep"].done():
        assert time.monotonic() < deadline, "the sweep submitted nothing"
        time.sleep(0.1)
    flags = ["--tasks-per-node", "2", "--partition", slurm_cluster.PARTITION, "--time", "10:00", "--account", "lab"]
    futures["two"] = cli_pool.submit(submit, cluster, base, "two", [*ONE, *TWO, "steps=4",
                                                                    "enable_checkpointing=false"], *flags)
    futures["preempted"] = cli_pool.submit(submit, cluster, base, "preempted", [*ONE, f"steps={STEPS}"])
    futures["signalled"] = cli_pool.submit(lambda: signal_after_first_step(cluster, base, "preempted",
                                                                           futures["preempted"].result()))
    yield {"base": base, **futures}
    for pool in (sweep_pool, cli_pool):
        pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="session")
def straight(jobs) -> list[float]:
    """The uninterrupted 1-process run's losses, STEPS of them (array index 0 of the sweep)."""
    jobs["sweep"].result()
    result = losses(jobs["base"] / "sweep" / "runs" / "pair-00-straight")
    assert len(result) == STEPS
    return result


def test_two_task_job_equals_the_one_process_run(cluster, jobs, straight):
    base, job_id = jobs["base"], jobs["two"].result()
    passes_test_only(cluster, base / "two" / "two.sbatch")
    code, out, err = finished(cluster, base, "two", job_id)
    assert code == 0, err[-3000:]
    assert "requeueing" not in err  # a run that completed is not requeued: one start
    assert out.count("resuming from step") == 0 and len(losses(base / "two")) == 4
    close = [abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses(base / "two"), straight[:4])]
    assert all(close), (losses(base / "two"), straight[:4])


def test_sigterm_saves_requeues_and_resumes_bit_exactly(cluster, jobs, straight):
    base, job_id = jobs["base"], jobs["preempted"].result()
    passes_test_only(cluster, base / "preempted" / "preempted.sbatch")
    jobs["signalled"].result()
    code, out, err = finished(cluster, base, "preempted", job_id)
    assert code == 0, err[-3000:]
    stops = [line for line in out.splitlines() if line.startswith("preempted: stopping after step")]
    assert len(stops) == 1, out[-3000:]
    stopped = int(stops[0].split()[4].rstrip(","))
    assert 0 < stopped < STEPS
    assert f"requeueing job {job_id} (restart 0)" in err
    assert f"resuming from step {stopped} " in out
    assert losses(base / "preempted") == straight  # steps 1..N, then N+1..STEPS after the requeue


def test_a_sweep_runs_as_one_job_array(cluster, jobs, straight):
    out, rows = jobs["base"] / "sweep", jobs["sweep"].result()
    assert [(r["name"], r["status"]) for r in rows] == [("straight", "ok"), ("four", "ok"), ("bad", "skipped")]
    assert "emb_dim" in rows[2]["error"]
    assert [r["steps"] for r in rows[:2]] == [STEPS, 4] and rows[1]["final_loss"] == straight[3]
    assert losses(out / "runs" / "pair-01-four") == straight[:4]  # the same run, bit for bit, for 4 steps
    passes_test_only(cluster, out / "slurm" / "pair.sbatch")
    script = (out / "slurm" / "pair.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script and "#SBATCH --output=" + str(out / "slurm") + "/slurm-%A_%a.out" in script


HOSTILE = [
    "dataset_path=it's \"quoted\" ; echo $HOME `touch {pwned}/tick` $(touch {pwned}/dollar) \\ * ?",
    "tokenizer_path=line one\nline two $(touch {pwned}/newline)\n",
    "base_output_directory={pwned}/dir with 'quote' && touch {pwned}/and",
]


def test_hostile_values_reach_the_program_exactly_and_never_run(cluster, tmp_path):
    pwned = tmp_path / "pwned"
    pwned.mkdir()
    record = tmp_path / "argv.json"
    stand_in = tmp_path / "stand_in"
    stand_in.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        f"json.dump([sys.argv[1:], os.environ['HOSTILE']], open({str(record)!r}, 'w'))\n")
    stand_in.chmod(0o755)
    values = [v.format(pwned=pwned) for v in HOSTILE]
    env_value = f"a'b\"c $(touch {pwned}/env) `touch {pwned}/env2`\nnext"
    job_id = launch(cluster, "configs/base.yml", *values, "run_name=hostile", "--python", str(stand_in),
                    "--log-dir", str(tmp_path / "logs"), "--env", f"HOSTILE={env_value}", "--submit").stdout.strip()
    slurm_cluster.wait_job(cluster, job_id, JOB_TIMEOUT_S)
    assert (tmp_path / "logs" / f"slurm-{job_id}.exit").read_text() == "0\n"
    argv, env_seen = json.loads(record.read_text())
    assert argv == ["-m", "maxshard.train", "configs/base.yml", *values, "run_name=hostile"]
    assert env_seen == env_value
    assert list(pwned.iterdir()) == []  # (values on #SBATCH lines are refused: tests/test_slurm_script.py)
