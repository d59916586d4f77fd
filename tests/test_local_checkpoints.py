"""Local checkpoints with replicas (orbax's emergency manager, `checkpoint_local_dir`) and goodput over restarts.

Three processes on loopback, each a slice (`dcn_data_parallelism=3`, one CPU device each): slice 0 is orbax's
primary slice and writes the persistent checkpoints (every `checkpoint_period`), slices 1 and 2 keep local copies
(every `checkpoint_local_period`), each in its own directory. One chain of three starts on text data (the data
position matters):

1. killed (SIGKILL, every process) after step 7, past local step 6 (local saves at 3, 6, 9), persistent step 5
   (persistent saves at 5, 10) being the newest persistent one; process 2's local directory, which held step 6,
   is wiped.
2. resumes at the newest local step, 6, from slice 1's copy (broadcast to slices 0 and 2), and is killed again
   after step 8.
3. every local copy wiped: falls back to persistent step 5 and runs to the end.

Every step run again logs the loss it logged before, bit for bit, and the last start's goodput counts the steps
run twice as lost work, its categories summing to the wall time.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
import cli_processes
from helpers import process_env

from maxshard.checkpoint import emergency
from maxshard.errors import ConfigError
from maxshard.observe import goodput

REPO = Path(__file__).resolve().parent.parent
KEYS = [
    "dataset_type=text", "emb_dim=32", "num_layers=2", "num_heads=2", "num_kv_heads=2", "head_dim=16", "mlp_dim=64",
    "max_target_length=32", "per_device_batch_size=1", "eval_period=0", "log_period=1", "steps=10",
    "enable_tensorboard=false", "cpu_device_count=1", "num_slices=3", "dcn_data_parallelism=3",
    "ici_fsdp_parallelism=1", "process_count=3", "distributed_timeout=120", "async_checkpointing=false",
    "checkpoint_local_period=3", "checkpoint_period=5", "run_name=r", "remat_policy=full",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _start(env: dict[str, str], base: Path) -> Iterator[tuple[list[subprocess.Popen], list[list[str]]]]:
    """Every process, the output of all but process 0 collected by threads; SIGKILLed and reaped on the way out."""
    port = _free_port()
    env = process_env(env)
    procs, outputs = [], [[], [], []]
    for i in range(3):
        args = [*KEYS, f"base_output_directory={base}", f"checkpoint_local_dir={base / 'local'}",
                f"coordinator_address=127.0.0.1:{port}", f"process_id={i}"]
        procs.append(cli_processes.popen([sys.executable, "-m", "maxshard.train", "configs/base.yml", *args], cwd=REPO,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    readers = [threading.Thread(target=lambda p=p, out=out: out.extend(p.stdout), daemon=True)
               for p, out in zip(procs[1:], outputs[1:])]
    for r in readers:
        r.start()
    try:
        yield procs, outputs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _killed_after(env: dict[str, str], base: Path, pattern: str) -> str:
    """Starts the run and SIGKILLs every process once process 0 prints a line matching `pattern`."""
    with _start(env, base) as (procs, outputs):
        for line in procs[0].stdout:
            outputs[0].append(line)
            if re.search(pattern, line):
                for p in procs:
                    p.send_signal(signal.SIGKILL)
                break
        else:
            procs[0].wait()
            pytest.fail(f"no line matched {pattern!r}:\n{''.join(outputs[0])[-3000:]}")
    return "".join(outputs[0])


def _finished(env: dict[str, str], base: Path) -> str:
    with _start(env, base) as (procs, outputs):
        outputs[0].extend(procs[0].stdout)
        for p in procs:
            p.wait(timeout=240)
    assert [p.returncode for p in procs] == [0, 0, 0], "".join(outputs[0])[-3000:] + "".join(outputs[1])[-3000:]
    return "".join(outputs[0])


def _local_steps(base: Path, process: int) -> list[int]:
    directory = base / "local" / f"process_{process}"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _logged(base: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (base / "r" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


@pytest.mark.slow
def test_kill_wipe_one_slice_resume_from_a_peer_slice_then_persistent_fallback_with_goodput(env, tmp_path):
    out = _killed_after(env, tmp_path, r"^step 7/")
    persistent = sorted(int(p.name) for p in (tmp_path / "r" / "checkpoints").iterdir() if p.name.isdigit())
    assert persistent == [5]
    assert _local_steps(tmp_path, 0) == []  # orbax's primary slice keeps no local copy
    newest = _local_steps(tmp_path, 2)[-1]
    assert _local_steps(tmp_path, 1)[-1] == newest == 6, out  # the kill lands before the save at 9
    shutil.rmtree(tmp_path / "local" / "process_2")

    out = _killed_after(env, tmp_path, r"^step 8/")
    assert f"resuming from step {newest} (local copy of slice 1)" in out, out[-3000:]
    shutil.rmtree(tmp_path / "local")

    out = _finished(env, tmp_path)
    assert "resuming from step 5 (persistent" in out, out[-3000:]

    logged = _logged(tmp_path)
    first: dict[int, float] = {}
    for step, loss in logged:
        assert first.setdefault(step, loss) == loss, (step, logged)  # a step run again: the same loss, bit for bit
    assert sorted(first) == list(range(1, 11))
    steps = [step for step, _ in logged]
    assert steps.count(7) == 3 and steps.count(6) == 2  # 7 after each resume; 6 again from persistent step 5

    record = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["step"] == 10 and record["goodput/restarts"] == 2
    seconds = [record[f"goodput/{c}_seconds"] for c in goodput.CATEGORIES]
    assert min(seconds) >= 0 and record["goodput/lost_progress_seconds"] > 0
    assert record["goodput/recovery_seconds"] > 0 and record["goodput/checkpoint_restore_seconds"] > 0
    np.testing.assert_allclose(sum(seconds), record["goodput/wall_seconds"], rtol=1e-9)
    assert re.search(r"^goodput \d+\.\d% of .* wall over 3 starts; badput: .*lost progress", out, re.M), out[-2000:]


def test_one_slice_is_refused_naming_the_key():
    """Orbax's emergency manager needs a second replica to hold the copies: one slice is one line, never a silent
    persistent-only run."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "fsdp"))
    with pytest.raises(ConfigError, match=r"^checkpoint_local_dir needs at least 2 data-parallel replicas"):
        emergency.check_topology(mesh, {})
    sharded = jax.ShapeDtypeStruct((8,), np.float32, sharding=jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp")),
        jax.sharding.PartitionSpec("data")))
    # One process holds both replicas here: refused before the state is looked at.
    with pytest.raises(ConfigError, match=r"^checkpoint_local_dir: process 0 holds devices of 2 replicas"):
        emergency.check_topology(sharded.sharding.mesh, {"w": sharded})
