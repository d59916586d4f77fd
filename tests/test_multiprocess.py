"""Two processes x 4 CPU devices on loopback train exactly like one process with 8 devices, and resume together.

Each process is a slice (`num_slices=2`); a DCN axis spans them. The synthetic batches are the same global arrays
in both runs, so the losses must agree (to 1e-5: the collectives sum in another order across processes). All runs
share the session's persistent compilation cache (conftest.py's `env`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import cli_processes
from helpers import process_env

pytestmark = pytest.mark.slow

TINY = [
    "dataset_type=synthetic", "emb_dim=64", "num_layers=2", "num_heads=4", "num_kv_heads=4", "head_dim=16",
    "mlp_dim=128", "max_target_length=32", "per_device_batch_size=2", "eval_period=0", "log_period=1",
    "warmup_steps_fraction=0", "steps=4", "distributed_timeout=30",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(env: dict[str, str], args: list[str], **kwargs) -> subprocess.Popen:
    overrides = {item.split("=", 1)[0]: item for item in (*TINY, *args)}  # later wins
    cmd = [sys.executable, "-m", "maxshard.train", "configs/base.yml", *overrides.values()]
    env = process_env(env)
    return cli_processes.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


@contextlib.contextmanager
def _killed_on_exit(procs: list[subprocess.Popen]) -> Iterator[list[subprocess.Popen]]:
    """The processes, SIGKILLed and reaped on the way out if still running: no test leaves one behind."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


def _two_processes(env: dict[str, str], tmp_path: Path, layout: list[str]) -> list[subprocess.Popen]:
    port = _free_port()
    common = [f"base_output_directory={tmp_path}", "run_name=multi", "cpu_device_count=4", "num_slices=2",
              f"coordinator_address=127.0.0.1:{port}", "process_count=2", *layout]
    return [_trainer(env, [*common, f"process_id={i}"]) for i in range(2)]


@pytest.mark.parametrize(
    "layout",
    [
        ["dcn_data_parallelism=2", "ici_fsdp_parallelism=4"],
        ["dcn_data_parallelism=1", "dcn_fsdp_parallelism=2", "ici_fsdp_parallelism=4"],
    ],
    ids=["dcn_data", "dcn_fsdp"],
)
def test_two_processes_match_one_process(env, tmp_path, layout):
    procs = _two_processes(env, tmp_path, layout)
    single = _trainer(env, [f"base_output_directory={tmp_path}", "run_name=single", "cpu_device_count=8",
                       "ici_fsdp_parallelism=8"])
    with _killed_on_exit([*procs, single]):
        outputs = [p.communicate(timeout=240)[0] for p in [*procs, single]]
    for p, out in zip([*procs, single], outputs):
        assert p.returncode == 0, out[-3000:]
    multi_losses, single_losses = _losses(tmp_path / "multi"), _losses(tmp_path / "single")
    assert len(multi_losses) == 4  # one line per step: only process 0 writes metrics
    np.testing.assert_allclose(multi_losses, single_losses, rtol=1e-5)


def test_survivor_exits_when_a_peer_dies(env, tmp_path):
    procs = _two_processes(env, tmp_path, ["dcn_data_parallelism=2", "ici_fsdp_parallelism=4", "steps=100000",
                                     "distributed_timeout=15"])
    with _killed_on_exit(procs):
        deadline = time.time() + 180
        metrics = tmp_path / "multi" / "metrics.jsonl"
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.5)
        assert metrics.exists(), "training never started: " + "".join(
            p.poll() is not None and p.stdout.read() or "" for p in procs)
        procs[1].send_signal(signal.SIGKILL)
        start = time.time()
        procs[0].wait(timeout=120)
    assert procs[0].returncode != 0
    assert time.time() - start < 120


def _run_two(env: dict[str, str], tmp_path: Path, layout: list[str]) -> list[str]:
    """Both processes' outputs after they ran to their end (both must exit 0)."""
    with _killed_on_exit(_two_processes(env, tmp_path, layout)) as procs:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


def test_damage_only_one_process_sees_makes_both_fall_back(env, tmp_path):
    """Process 1 alone reads the shards in its own data files: truncate one and only it sees the damage."""
    layout = ["dcn_data_parallelism=1", "dcn_fsdp_parallelism=2", "ici_fsdp_parallelism=4", "checkpoint_period=2",
              "enable_tensorboard=false", "distributed_timeout=120"]  # 4 process starts: slack for a loaded machine
    _run_two(env, tmp_path, layout)
    first = _losses(tmp_path / "multi")
    checkpoints = tmp_path / "multi" / "checkpoints"
    shard = max((checkpoints / "4" / "state" / "ocdbt.process_1" / "d").iterdir(), key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    outputs = _run_two(env, tmp_path, layout)
    assert re.search(r"checkpoint step 4 is damaged \(ValueError: [A-Z_]+: .+\); set aside as 4.damaged", outputs[1])
    assert "checkpoint step 4 is damaged (unreadable on another process); set aside as 4.damaged" in outputs[0]
    assert all("resuming from step 2" in out for out in outputs)
    assert _losses(tmp_path / "multi") == first + first[2:]  # steps 3 and 4 again, bit for bit
    assert (checkpoints / "4.damaged").is_dir() and (checkpoints / "4" / "state").is_dir()


def _reading(procs: list[subprocess.Popen]) -> list[Future[str]]:
    """Each process's whole output, read in a thread from now on: a full pipe would stall its process mid-run."""
    pool = ThreadPoolExecutor(len(procs))
    readers = [pool.submit(p.stdout.read) for p in procs]
    pool.shutdown(wait=False)
    return readers


def _outputs(procs: list[subprocess.Popen], readers: list[Future[str]], timeout: float) -> list[str]:
    """The outputs once every process ended; any still running after `timeout` seconds is killed (exit -9), so a
    hang fails the test showing what each process printed."""
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [r.result() for r in readers]


def test_sigterm_to_one_process_stops_both_at_one_step_and_resume_is_exact(env, tmp_path):
    """Real preemption: SIGTERM reaches process 1 only; JAX's preemption sync point makes both save step N and exit 0.

    The restart resumes from N and logs the losses of an uninterrupted run, bit for bit (the same layout, so the
    collectives sum in the same order). A fixed schedule length keeps the learning rate independent of `steps`.
    """
    layout = ["dcn_data_parallelism=1", "dcn_fsdp_parallelism=2", "ici_fsdp_parallelism=4", "steps=100000",
              "learning_rate_schedule_steps=100", "checkpoint_period=100000", "enable_tensorboard=false",
              "distributed_timeout=120"]
    interrupted = tmp_path / "interrupted"
    with _killed_on_exit(_two_processes(env, interrupted, layout)) as procs:
        readers = _reading(procs)
        metrics = interrupted / "multi" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and "loss" in metrics.read_text()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail("training never started:\n" + "\n".join(_outputs(procs, readers, 0)))
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)  # process 0 gets nothing: JAX's coordination service tells it
        sent = time.monotonic()
        outputs = _outputs(procs, readers, 120)
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(out[-3000:] for out in outputs)
    assert time.monotonic() - sent < 60
    stops = [re.findall(r"preempted: stopping after step (\d+), checkpoint saved", out) for out in outputs]
    assert len(stops[0]) == 1 and stops[0] == stops[1], stops  # the signalled process and the other, same step
    stopped = int(stops[0][0])
    checkpoints = interrupted / "multi" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == [str(stopped)]  # the preemption save, no periodic one
    assert (checkpoints / str(stopped) / "state").is_dir()
    assert len(_losses(interrupted / "multi")) == stopped

    # One two-process run at a time: under load, four processes on two cores can leave a peer more than gloo's fixed
    # 30 s behind at the first collective ("Gloo context initialization failed: DEADLINE_EXCEEDED").
    finish = [*layout, f"steps={stopped + 2}"]
    assert all(f"resuming from step {stopped} " in out for out in _run_two(env, interrupted, finish))
    straight = tmp_path / "straight"
    _run_two(env, straight, finish)
    assert len(_losses(straight / "multi")) == stopped + 2
    assert _losses(interrupted / "multi") == _losses(straight / "multi")  # steps 1..N, then N+1 and N+2 resumed


def test_a_held_run_directory_stops_every_process_in_one_line(env, tmp_path):
    """The primary finds the run directory locked (by this test's process, alive): both processes stop at once,
    each with one line, instead of the other one waiting for a peer that left."""
    from maxshard.run import lock

    with lock.RunLock(str(tmp_path / "multi")) as held:
        held.acquire()
        with _killed_on_exit(_two_processes(env, tmp_path, ["dcn_data_parallelism=2", "ici_fsdp_parallelism=4"])) \
                as procs:
            outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 2, out[-3000:]
    assert f"in use by host {socket.gethostname()} pid {os.getpid()}" in outputs[0]
    assert "maxshard: error: run_dir" in outputs[1] and "(process 0 says who)" in outputs[1]
    assert not (tmp_path / "multi" / "metrics.jsonl").exists()
