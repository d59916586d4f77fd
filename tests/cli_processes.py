"""`python -m maxshard.<tool> ...` processes for the tests, forked from a process that has done the imports already.

A tiny training run on a warm compilation cache costs ~7 CPU seconds, and ~3 of them are the interpreter starting
and importing jax, flax, orbax and maxshard before the first line of work (`python -X importtime -c "import
maxshard.train"`). The suite starts many such processes (the checkpoint, resume, preemption and multi-process tests),
so each test worker keeps one multiprocessing fork server whose preload has imported the tools' modules, and each CLI
run is a fork of it that runs the tool's `__main__` as `python -m` would (`runpy`, `sys.argv`, the working directory,
the environment, stdout and stderr on the pipes the test reads), then exits as the interpreter does: non-daemon
threads joined, atexit handlers run, streams flushed, the exit status of `SystemExit` or 1 after a traceback. The
process is a real one with its own pid, so signals (SIGTERM, SIGKILL) reach it as they reach a training process.

The fork server never starts a JAX backend (no XLA threads to fork), and the tool's own module is executed afresh
in each fork. What JAX reads from the environment at import (JAX_*, XLA_*, TPU and CUDA settings) was read by the
server, so a run whose environment differs there, or a command that is not one of TOOLS, starts a fresh interpreter
through `subprocess` as before: `run` and `Popen` take subprocess's arguments and return what it returns.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import re
import runpy
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from multiprocessing.reduction import DupFd
from typing import Any

from maxshard.planning.tpu_compile import ABSTRACT_TPU_VARIABLES

# The modules the fork server imports (those of every tool the tests run; `maxshard.train` imports most of them).
TOOLS = ("maxshard.train", "maxshard.eval", "maxshard.generate", "maxshard.convert", "maxshard.plan")
# And what a training run imports only when it gets there (the input pipeline with grain, the metrics writer, jax's
# MLIR dialect for the sharding annotations): ~0.35 s of each run's imports (python -X importtime), none of them
# starting a thread.
IMPORTED_LATER = ("maxshard.data.pipeline", "tensorboardX", "jaxlib.mlir.dialects.mhlo")
# Environment variables read at import (by jax's config, jaxlib, libtpu, the CUDA plugin): a run that sets them
# otherwise than the fork server saw them gets a fresh interpreter.
READ_AT_IMPORT = re.compile(r"^(JAX_|XLA_|TF_|TPU_|LIBTPU|CUDA|NCCL|PYTHON|LD_)")
# What pytest puts on sys.path (the tests and the repository), which a fresh interpreter does not have.
_TEST_PATHS = {os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}


def _read_at_import(env: Mapping[str, str]) -> dict[str, str]:
    """What of `env` JAX reads at import. Not the variables an ahead-of-time TPU compile in the test process sets
    for libtpu (planning/tpu_compile.py): libtpu reads them when a backend starts, which each fork does afresh; with
    them counted, every run after a worker's first XLA:TPU compile started a fresh interpreter when the fork server
    was started before it."""
    return {k: v for k, v in env.items() if READ_AT_IMPORT.match(k) and k not in ABSTRACT_TPU_VARIABLES}


@functools.cache
def _fork_server() -> tuple[Any, dict[str, str]]:
    """This process's forkserver context, its server started now (once per test worker) to import TOOLS and
    IMPORTED_LATER, and what of READ_AT_IMPORT the server's environment (this process's of now) holds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*TOOLS, *IMPORTED_LATER])
    multiprocessing.forkserver.ensure_running()
    return context, _read_at_import(os.environ)


def _program(args: Sequence[str]) -> list[str] | None:
    """`["-m", TOOL, *argv]` or `[SCRIPT, *argv]` (a .py file) of a command that runs this interpreter on one."""
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m":
        return list(args[1:]) if len(args) > 2 and args[2] in TOOLS else None
    return list(args[1:]) if str(args[1]).endswith(".py") else None


def _forkable(args: Sequence[str], env: Mapping[str, str] | None, kwargs: Mapping[str, Any]) -> bool:
    """Whether `args` is `python -m TOOL ...` or `python SCRIPT.py ...` with no option this module does not
    reproduce."""
    if _program(args) is None:
        return False
    if set(kwargs) - {"cwd", "stdout", "stderr", "text"}:
        return False
    if any(kwargs.get(stream) not in (None, subprocess.PIPE, subprocess.STDOUT) for stream in ("stdout", "stderr")):
        return False
    return _read_at_import(os.environ if env is None else env) == _fork_server()[1]


def _exit_code(error: SystemExit) -> int:
    """The process's status for `sys.exit(code)`, as the interpreter sets it."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _forget_tools() -> None:
    """The fork server imported the tools' modules for what they import; each fork executes its tool as `__main__`
    afresh, as `python -m` does (runpy warns about a module it runs that is imported already)."""
    for tool in TOOLS:
        package, _, name = tool.rpartition(".")
        sys.modules.pop(tool, None)
        if hasattr(sys.modules.get(package), name):
            delattr(sys.modules[package], name)


def _main(program: list[str], cwd: str | None, env: dict[str, str], out: DupFd, err: DupFd,
          gc_threshold: tuple[int, ...]) -> None:
    """In the fork: `python *program` (`-m TOOL ...` or `SCRIPT ...`) with this environment and working directory,
    output on the test's pipes, sys.path as that interpreter starts it (the test process's additions left out), and
    the test process's garbage collector thresholds (tests/conftest.py)."""
    gc.set_threshold(*gc_threshold)
    for fd, target in ((out.detach(), 1), (err.detach(), 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    _forget_tools()
    script = program[0] != "-m"
    first = os.path.dirname(os.path.abspath(program[0])) if script else os.getcwd()
    sys.path[:] = [first, *(entry for entry in sys.path if os.path.abspath(entry or ".") not in _TEST_PATHS)]
    sys.argv = list(program) if script else ["-m", *program[2:]]  # runpy sets argv[0] to the module's file
    code = 0
    try:
        if script:
            runpy.run_path(program[0], run_name="__main__")
        else:
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException:  # noqa: BLE001 - the interpreter's own handling of an uncaught exception
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined] # non-daemon threads first, as at interpreter exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


class Popen:
    """The part of `subprocess.Popen` the tests use, for a process forked from the fork server."""

    def __init__(self, args: Sequence[str], *, cwd: Any = None, env: Mapping[str, str] | None = None,
                 stdout: Any = None, stderr: Any = None, text: bool = False) -> None:
        self.args, self.returncode = list(args), None
        reads, writes = {}, {}
        for name, wanted in (("stdout", stdout), ("stderr", stderr)):
            if wanted == subprocess.PIPE:
                reads[name], writes[name] = os.pipe()
        out = writes.get("stdout", 1)
        err = out if stderr == subprocess.STDOUT else writes.get("stderr", 2)
        self._process = _fork_server()[0].Process(
            target=_main, args=(_program(self.args), None if cwd is None else str(cwd),
                                dict(os.environ if env is None else env), DupFd(out), DupFd(err), gc.get_threshold()))
        self._process.start()
        for fd in writes.values():
            os.close(fd)
        mode = "r" if text else "rb"
        self.stdout = os.fdopen(reads["stdout"], mode) if "stdout" in reads else None
        self.stderr = os.fdopen(reads["stderr"], mode) if "stderr" in reads else None
        self.pid = self._process.pid

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, number: int) -> None:
        """As subprocess does: nothing once the process has ended, also when it ends between the poll and the kill
        (the fork server reaps it, so its pid can be gone before its exit reaches this process)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Both streams read to their end (in threads: a full pipe would stall the process), then the exit."""
        results: dict[str, Any] = {}
        readers = [threading.Thread(target=lambda n=name, s=stream: results.__setitem__(n, s.read()), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr)) if stream is not None]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:
            reader.join()
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return results.get("stdout"), results.get("stderr")


def popen(args: Sequence[str], **kwargs: Any) -> Popen | subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)`, forked from the fork server where the command allows."""
    env = kwargs.pop("env", None)
    if _forkable(args, env, kwargs):
        return Popen(args, env=env, **kwargs)
    return subprocess.Popen(args, env=env, **kwargs)


def run(args: Sequence[str], *, capture_output: bool = False, timeout: float | None = None,
        **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(args, ...)` with Popen's arguments, the process from `popen`: killed on a timeout
    (TimeoutExpired) as subprocess.run kills it."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process = popen(args, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
