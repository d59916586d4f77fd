"""One writer per run directory (maxshard/run/lock.py), through `maxshard.train` where the CLI is what a user runs.

The holders are real processes: this test's own (alive, so a second start is refused), a child that exited (its pid
no longer runs: the lock of a run killed with -9 is taken over), and a lock another host left, fresh or stale.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from maxshard import train
from maxshard.errors import ConfigError
from maxshard.run import lock

BASE = os.path.join(os.path.dirname(__file__), "..", "configs", "base.yml")
TINY = ("model_name=tiny", "dataset_type=synthetic", "cpu_device_count=8", "steps=1", "log_period=1",
        "eval_period=0", "enable_checkpointing=false", "enable_tensorboard=false", "run_name=locked")


def _argv(tmp_path):
    return [BASE, *TINY, f"base_output_directory={tmp_path}"]


def _write_lock(run_dir, **holder):
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, lock.LOCK_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"started": time.time(), "command": "python -m maxshard.train other.yml", **holder}, f)
    return path


def _exited_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_second_start_on_a_held_run_directory_is_refused_in_one_line(tmp_path, capsys):
    run_dir = str(tmp_path / "locked")
    with lock.RunLock(run_dir) as held:
        assert held.acquire() is None
        assert train.main(_argv(tmp_path)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("maxshard: error: run_dir ")
        assert f"in use by host {socket.gethostname()} pid {os.getpid()}" in err[0] and "run_name" in err[0]
        assert not os.path.exists(os.path.join(run_dir, "checkpoints"))  # nothing written by the refused start
    assert not os.path.exists(held.path)  # released on exit


def test_the_lock_of_a_killed_run_is_taken_over_and_released_at_the_end(tmp_path, capsys):
    run_dir = str(tmp_path / "locked")
    _write_lock(run_dir, host=socket.gethostname(), pid=_exited_pid())
    assert train.main(_argv(tmp_path)) == 0
    out = capsys.readouterr().out
    assert f"run_dir {run_dir}: taking over the lock of host {socket.gethostname()} pid" in out
    assert "which no longer runs" in out and "step 1/1" in out
    assert not os.path.exists(os.path.join(run_dir, lock.LOCK_FILE))


def test_a_reused_pid_is_not_the_holder(tmp_path):
    """A live pid whose process started at another time is another program: the lock is taken over."""
    run_dir = str(tmp_path / "run")
    _write_lock(run_dir, host=socket.gethostname(), pid=os.getpid(), process_start="1")
    with lock.RunLock(run_dir) as taken:
        assert "which no longer runs" in taken.acquire()


def test_another_hosts_lock_is_refused_while_its_heartbeat_is_fresh_and_taken_over_when_stale(tmp_path):
    run_dir = str(tmp_path / "run")
    path = _write_lock(run_dir, host="node-7", pid=1234)
    with pytest.raises(ConfigError, match=r"in use by host node-7 pid 1234 .*heartbeat 0s ago"):
        lock.RunLock(run_dir).acquire()
    old = time.time() - lock.STALE_SECONDS - 5
    os.utime(path, (old, old))
    with lock.RunLock(run_dir) as taken:
        line = taken.acquire()
        assert "taking over the lock of host node-7 pid 1234" in line and "heartbeat stopped" in line
        assert json.load(open(path))["pid"] == os.getpid()


def test_a_lock_file_cut_short_by_a_crash_counts_as_held_until_stale(tmp_path):
    run_dir = str(tmp_path / "run")
    path = _write_lock(run_dir)
    with open(path, "w") as f:
        f.write('{"host": "node')  # a crash while the file was written
    with pytest.raises(ConfigError, match="in use by host an unknown host"):
        lock.RunLock(run_dir).acquire()
    old = time.time() - lock.STALE_SECONDS - 5
    os.utime(path, (old, old))
    with lock.RunLock(run_dir) as taken:
        assert "heartbeat stopped" in taken.acquire()


def test_the_heartbeat_refreshes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_SECONDS", 0.05)
    with lock.RunLock(str(tmp_path / "run")) as held:
        held.acquire()
        old = time.time() - 1000
        os.utime(held.path, (old, old))
        time.sleep(0.3)
        assert time.time() - os.stat(held.path).st_mtime < 100


def test_a_killed_holder_not_yet_reaped_is_gone(tmp_path):
    """SIGKILLed but not waited for (a zombie, as a supervisor that restarts at once leaves it): taken over."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.kill()
        time.sleep(0.5)  # dead, not reaped
        run_dir = str(tmp_path / "run")
        _write_lock(run_dir, host=socket.gethostname(), pid=child.pid, process_start=lock._process_start(child.pid))
        with lock.RunLock(run_dir) as taken:
            assert "which no longer runs" in taken.acquire()
    finally:
        child.wait()


def test_a_live_holder_with_its_start_time_is_refused(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_dir = str(tmp_path / "run")
        _write_lock(run_dir, host=socket.gethostname(), pid=child.pid, process_start=lock._process_start(child.pid))
        with pytest.raises(ConfigError, match=f"pid {child.pid} "):
            lock.RunLock(run_dir).acquire()
    finally:
        child.kill()
        child.wait()


def test_a_remote_run_directory_is_not_locked_and_says_so(capsys):
    assert lock.hold("gs://bucket/runs/a", is_primary=True) is None
    assert "gs://bucket/runs/a: not locked" in capsys.readouterr().out
