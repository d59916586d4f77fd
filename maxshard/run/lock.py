"""One writer per run directory: a run holds `run_dir/maxshard.lock` from start to exit.

Two runs on one run directory would both write checkpoints into the same `checkpoints/`, and which one wrote a
step would be chance, so a resume could mix their states. The lock file names its holder (host, pid, the process's
start time, when it started, the command) and is refreshed by a heartbeat thread. A start that finds it:

* refuses, in one line naming the holder, while the holder lives;
* takes it over, in one line saying whose it was, when the holder is gone: on the same host a pid that no longer
  runs, or runs another program (its start time differs: the pid was reused); on another host, whose processes
  cannot be asked, a heartbeat older than `STALE_SECONDS` (a job killed with -9, or a node that died).

Taking the lock is atomic (`O_CREAT | O_EXCL`), and so is taking over (the stale file is renamed away first, and only
one renamer wins), so two starts at the same moment cannot both win. With several processes the primary takes the
lock and tells the others whether it got it, so every process of a refused run stops at the same point.

A remote run directory (`gs://...`) is not locked, and a line says so: an object store offers no atomic
create-if-absent through a file API. Not an `fcntl` lock: the filesystems runs share across hosts (NFS, Filestore, gcsfuse) do not all honour one, and an
advisory lock would not tell the user who holds it.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import threading
import time
from typing import Any

from maxshard.errors import ConfigError

__all__ = ["LOCK_FILE", "STALE_SECONDS", "HEARTBEAT_SECONDS", "RunLock", "hold"]

LOCK_FILE = "maxshard.lock"
HEARTBEAT_SECONDS = 15.0  # how often the holder refreshes the file's modification time
STALE_SECONDS = 120.0  # a lock from another host without a heartbeat for this long is taken over


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None where /proc has none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the command, in parentheses, may hold spaces


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None where /proc has none.

    With the pid it names one process for the life of the machine: a pid reused by another program differs here."""
    fields = _stat(pid)
    return None if fields is None else fields[19]  # field 22 of the file: starttime


def _alive(pid: int, start: str | None) -> bool:
    """Whether process `pid` of this host still runs the program that wrote the lock.

    A process killed but not yet reaped by its parent (a zombie) has ended: it will never write again."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    fields = _stat(pid)
    if fields is None:
        return True  # no /proc: the signal's answer is all there is
    return fields[0] not in ("Z", "X") and (start is None or fields[19] == start)


class RunLock:
    """The lock on one run directory, taken by `acquire` and given back by `release` (or the context manager)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
                       "started": time.time(), "command": shlex.join(sys.argv)}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Takes the lock; returns a line to print when it took over a gone holder's. ConfigError while held."""
        os.makedirs(self.run_dir, exist_ok=True)
        took_over = None
        for _ in range(3):  # another start may take it between our read and our create: look again
            if self._create():
                self._start_heartbeat()
                return took_over
            found = self._read()
            if found is None:
                continue  # released (or half-written) just now
            gone = self._gone(found)
            if gone is None:
                raise ConfigError(self._refusal(found))
            took_over = f"run_dir {self.run_dir}: taking over the lock of {_describe(found)}, {gone}"
            self._remove_stale()
        raise ConfigError(f"run_dir {self.run_dir}: another start keeps taking its lock ({self.path}); "
                          "start one run per run_name")

    def release(self) -> None:
        """Stops the heartbeat and removes the lock file if it is still this run's."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        found = self._read()
        if found is not None and self._is_mine(found):
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(self.holder, f)
            f.write("\n")
        return True

    def _read(self) -> dict[str, Any] | None:
        """The holder the lock file names, with `heartbeat_age` (seconds since its last refresh); None if no file.

        A file that is not JSON (cut short by a crash while it was written) names an unknown holder whose
        heartbeat is its modification time."""
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return None
        try:
            found = json.loads(text)
        except ValueError:
            found = {}
        if not isinstance(found, dict):
            found = {}
        return {**found, "heartbeat_age": age}

    def _gone(self, found: dict[str, Any]) -> str | None:
        """Why the holder of `found` is gone (a phrase for the takeover line), or None while it may still run."""
        if found.get("host") == self.holder["host"] and isinstance(found.get("pid"), int):
            if not _alive(found["pid"], found.get("process_start")):
                return "which no longer runs"
            return None
        if found["heartbeat_age"] > STALE_SECONDS:
            return f"whose heartbeat stopped {found['heartbeat_age']:.0f}s ago"
        return None

    def _refusal(self, found: dict[str, Any]) -> str:
        started = found.get("started")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if started else ""
        return (f"run_dir {self.run_dir} is in use by {_describe(found)}{when} (heartbeat "
                f"{found['heartbeat_age']:.0f}s ago; lock {self.path}): wait for it to finish, stop it, or give this "
                f"run another run_name")

    def _remove_stale(self) -> None:
        """Moves the stale file aside and removes it; of several starts doing so at once, one rename succeeds."""
        aside = f"{self.path}.stale.{self.holder['host']}.{self.holder['pid']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        os.remove(aside)

    def _is_mine(self, found: dict[str, Any]) -> bool:
        return all(found.get(k) == self.holder[k] for k in ("host", "pid", "started"))

    def _start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._beat, name="maxshard-run-lock", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(self.path)
            except OSError:  # the directory went away or the disk is read-only: the run itself will say so
                pass


def _describe(found: dict[str, Any]) -> str:
    host, pid = found.get("host", "an unknown host"), found.get("pid", "?")
    command = f" ({found['command']})" if found.get("command") else ""
    return f"host {host} pid {pid}{command}"


def hold(run_dir: str, is_primary: bool, process_count: int = 1) -> RunLock | None:
    """Takes the run directory's lock on the primary and prints the takeover line if there is one.

    With several processes the others learn whether the primary got it (a refusal stops every process alike);
    returns the lock (the primary's) to release at exit, or None on the other processes."""
    if "://" in run_dir:  # an object store has no atomic create-if-absent through the file API
        if is_primary:
            print(f"run_dir {run_dir}: not locked (a remote run directory); start one run per run_name", flush=True)
        return None
    lock, refusal = (RunLock(run_dir), "") if is_primary else (None, "")
    if lock is not None:
        try:
            took_over = lock.acquire()
        except ConfigError as e:
            refusal = str(e)
        else:
            if took_over:
                print(took_over, flush=True)
    if process_count > 1:
        _agree(bool(refusal), run_dir)
    if refusal:
        raise ConfigError(refusal)
    return lock


def _agree(refused: bool, run_dir: str) -> None:
    """Every process learns the primary's outcome; the others raise the refusal too."""
    import numpy as np
    from jax.experimental import multihost_utils  # deferred: one process never needs it

    primary_refused = bool(multihost_utils.broadcast_one_to_all(np.int32(refused)))
    if primary_refused and not refused:
        raise ConfigError(f"run_dir {run_dir} is in use by another run (process 0 says who)")
