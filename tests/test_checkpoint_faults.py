"""Checkpoint faults: a failed save stops the run in one line; only damage is set aside; the preemption sync point.

A save's background commit is refused by tests/failing_commit.py (the rename that commits it raises EACCES, as in an
unwritable directory). Read faults are injected into orbax's restore, next to real damage (a truncated file).
"""

from __future__ import annotations

import errno
import inspect
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import cli_processes
from helpers import mesh_for, tiny_config
from jax.experimental import multihost_utils
from training_runs import BASE, REPO, TIMEOUT, keys

from maxshard.checkpoint import health as checkpoint_health
from maxshard.checkpoint import manager as checkpoint
from maxshard.checkpoint.manager import CheckpointError
from maxshard.errors import ConfigError
from maxshard.training.step import Trainer

# --------------------------------------------------------------------------------------------- failed saves


@pytest.mark.slow
def test_failed_commit_stops_the_run_within_a_step_in_one_line(env, tmp_path):
    command = [sys.executable, str(REPO / "tests" / "failing_commit.py"), BASE, *keys(tmp_path, "checkpoint_period=2")]
    done = cli_processes.run(command, cwd=REPO, env={**env, "FAIL_STEP": "2"}, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 1, done.stdout + done.stderr
    problems = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(problems) == 1, done.stderr  # no traceback from orbax's threads, no absl error records
    assert re.fullmatch(r"maxshard: error: checkpoint save at step 2 failed: PermissionError: \[Errno 13\] "
                        r"Permission denied: '\S+/checkpoints/2'", problems[0]), problems[0]
    lines = done.stdout.splitlines()
    failed_at = next(i for i, line in enumerate(lines) if line.startswith("injected:"))
    trained_on = [line for line in lines[failed_at + 1:] if re.match(r"step \d+/", line)]
    assert len(trained_on) <= 1, done.stdout  # stopped at the first step boundary after the failure
    assert "Traceback" not in done.stdout
    assert not (tmp_path / "default" / "checkpoints" / "2").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 1.8 MiB tmpfs (the tiny run's checkpoints take about 1 MiB each), grown with `grow()`; unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1800k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a disk that fills needs a tmpfs mount, which needs root: {mounted.stderr.decode().strip()}")

    def grow():
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)

    try:
        yield disk, grow
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
def test_a_disk_that_fills_stops_the_run_in_one_line_and_the_next_start_resumes_exactly(env, reference,
                                                                                         small_disk):
    """A real full disk (ENOSPC from tensorstore, every fragment of the save at once): one line, no asyncio
    tracebacks at exit, the last committed checkpoint kept; with room again the run resumes from it and matches
    the straight run step by step."""
    from training_runs import losses, resumed_step, train

    disk, grow = small_disk
    command = [sys.executable, "-m", "maxshard.train", BASE, *keys(disk, "checkpoint_period=2")]
    done = cli_processes.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 1, done.stdout + done.stderr
    # One error line. Under load tensorstore may still call into orbax's closed event loop and Python prints those
    # "Event loop is closed" tracebacks itself (a known gap: the stop note says so); nothing else may show.
    problems = [line for line in done.stderr.splitlines() if line.startswith("maxshard: error:")]
    assert len(problems) == 1 and "the disk is full" in problems[0], done.stderr
    assert "Task exception was never retrieved" not in done.stderr, done.stderr
    failed = int(re.match(r"maxshard: error: checkpoint save at step (\d+) failed", problems[0]).group(1))
    grow()
    resumed = train(env, disk, "checkpoint_period=2")
    assert resumed_step(resumed) == failed - 2  # the last committed save, never the one the disk refused
    reference_losses = losses(reference)
    assert losses(disk) == {step: reference_losses[step] for step in losses(disk)}
    assert sorted(losses(disk)) == sorted(reference_losses)


# --------------------------------------------------------------------------------------------- damage or not


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory whose only checkpoint is step 5 of the tiny model."""
    base = tmp_path_factory.mktemp("one_checkpoint")
    cfg = tiny_config(f"base_output_directory={base}")
    trainer = Trainer(cfg, mesh_for(cfg))
    zeros = jax.tree.map(lambda leaf: jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding),
                         checkpoint.target_state(trainer))  # the values do not matter here; no init to compile
    with checkpoint.Checkpoints(cfg, trainer) as ckpt:
        ckpt.save(5, zeros, {"step": 5})
    return base


def copy_of(one_checkpoint: Path, tmp_path: Path) -> tuple[checkpoint.Checkpoints, Path]:
    shutil.copytree(one_checkpoint / "default", tmp_path / "default")
    cfg = tiny_config(f"base_output_directory={tmp_path}")
    return checkpoint.Checkpoints(cfg, Trainer(cfg, mesh_for(cfg))), tmp_path / "default" / "checkpoints"


def failing(error: BaseException):
    def restore(*args: object, **kwargs: object) -> None:
        raise error
    return restore


def wrapped(error: BaseException) -> Exception:
    """How orbax reports a failed array read: a plain Exception caused by tensorstore's error."""
    outer = Exception("Encountered error while reading array index: (slice(0, 8, 1),)")
    outer.__cause__ = error
    return outer


NOT_DAMAGE = {
    "permission": PermissionError(errno.EACCES, "Permission denied", "state/d/0"),
    "eio": OSError(errno.EIO, "Input/output error"),
    "enospc": OSError(errno.ENOSPC, "No space left on device"),
    "memory": MemoryError("out of memory allocating 4.0 GiB"),
    "ts_unavailable": wrapped(ValueError('UNAVAILABLE: Error reading "a/0.0": connection reset by peer')),
    "ts_permission": wrapped(ValueError('PERMISSION_DENIED: Error reading local file "state/d/0"')),
}


@pytest.mark.parametrize("fault", NOT_DAMAGE.values(), ids=NOT_DAMAGE.keys())
def test_read_fault_that_is_not_damage_stops_in_one_line_and_touches_nothing(one_checkpoint, tmp_path, monkeypatch,
                                                                              fault):
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore", failing(fault))
    ckpt, directory = copy_of(one_checkpoint, tmp_path)
    with ckpt, pytest.raises(CheckpointError) as error:
        ckpt.restore_or_init()
    message = str(error.value)
    assert "\n" not in message
    named = type(fault.__cause__ or fault).__name__  # the error orbax wrapped, if it wrapped one
    assert message.startswith(f"checkpoint step 5 in {directory} could not be read ({named}: ")
    assert "not damage, so nothing was set aside" in message
    assert sorted(p.name for p in directory.iterdir()) == ["5"]


def truncate_arrays(directory: Path) -> None:
    files = [p for p in (directory / "5" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files
    for path in files:
        os.truncate(path, path.stat().st_size // 2)


DAMAGE = {
    "truncated_arrays": truncate_arrays,
    "deleted_data_item": lambda directory: (directory / "5" / "data" / "metadata").unlink(),
    "injected_data_loss": lambda directory: None,
}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damage_is_set_aside(one_checkpoint, tmp_path, monkeypatch, capsys, damage):
    ckpt, directory = copy_of(one_checkpoint, tmp_path)
    if damage is DAMAGE["injected_data_loss"]:
        error = ValueError('DATA_LOSS: Error decoding b-tree node: Invalid key order; at byte 383')
        monkeypatch.setattr(ocp.StandardCheckpointHandler, "restore", failing(wrapped(error)))
    damage(directory)
    with ckpt, pytest.raises(ConfigError, match="no checkpoint .* can be read"):
        ckpt.restore_or_init()
    assert re.search(r"checkpoint step 5 is damaged \(\w+: .+\); set aside as 5.damaged", capsys.readouterr().out)
    assert sorted(p.name for p in directory.iterdir()) == ["5.damaged"]


def test_damage_is_recognised_by_its_kind_and_status_code():
    damage = [FileNotFoundError(2, "No such file"), wrapped(ValueError("OUT_OF_RANGE: Requested byte range")),
              ValueError("NOT_FOUND: Metadata at \"a/.zarray\" does not exist"),
              wrapped(ValueError("FAILED_PRECONDITION: Error reading \"a/0.0\": Truncated Zstd-compressed stream")),
              checkpoint_health.Damaged("the state metadata is empty")]
    faults = [ValueError("FAILED_PRECONDITION: the lock is held by another writer"), ValueError("bad shape"),
              RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"), wrapped(MemoryError()),
              wrapped(ValueError("DEADLINE_EXCEEDED: Error reading \"a/0.0\""))]
    assert [checkpoint_health.is_damage(e) for e in damage] == [True] * len(damage)
    assert [checkpoint_health.is_damage(e) for e in faults] == [False] * len(faults)


# --------------------------------------------------------------------------------------------- preemption


def test_preemption_sync_point_ignores_only_the_service_being_off(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    source = inspect.getsource(multihost_utils.reached_preemption_sync_point)
    assert checkpoint._PREEMPTION_SERVICE_OFF in source  # the wording matched below is JAX's own

    def service_off(step: int) -> bool:
        raise RuntimeError(f"{checkpoint._PREEMPTION_SERVICE_OFF}. Make sure the 'jax_enable_preemption_service' "
                           "config is enabled.")

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", service_off)
    assert checkpoint.preemption_reached(7, threading.Event()) is False

    def coordination_lost(step: int) -> bool:
        raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", coordination_lost)
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        checkpoint.preemption_reached(7, threading.Event())
