"""The tests' forked CLI processes (tests/cli_processes.py) behave as a fresh interpreter does: the same argv, working
directory, environment, sys.path[0], `__main__`, output streams, exit statuses, atexit handlers and threads joined."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import cli_processes

PROBE = textwrap.dedent("""
    import atexit, os, sys, threading, time
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE_VALUE"), "path0", sys.path[0],
          "name", __name__, "tests on path", any(p.endswith("tests") for p in sys.path))
    print("to stderr", file=sys.stderr)
    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished", flush=True))).start()
    mode = sys.argv[1]
    if mode == "raise":
        raise RuntimeError("uncaught")
    if mode == "wait":
        print("waiting", flush=True)
        time.sleep(60)
    sys.exit({"exit3": 3, "message": "a message", "none": None}[mode])
""")


def _both(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    command = [sys.executable, str(script), *args]
    kwargs = dict(cwd=tmp_path, env={**os.environ, "PROBE_VALUE": "x"}, capture_output=True, text=True, timeout=60)
    return cli_processes.run(command, **kwargs), subprocess.run(command, **kwargs)


def test_a_forked_run_prints_and_exits_as_a_fresh_interpreter(tmp_path):
    for mode in ("exit3", "message", "none"):
        forked, fresh = _both(tmp_path, mode)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 0 and "tests on path False" in fresh.stdout
    assert fresh.stdout.endswith("thread finished\natexit ran\n")


def test_an_uncaught_exception_is_exit_1_with_its_traceback(tmp_path):
    forked, fresh = _both(tmp_path, "raise")
    assert forked.returncode == fresh.returncode == 1 and forked.stdout == fresh.stdout
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "RuntimeError: uncaught"
    assert "Traceback" in forked.stderr


def test_a_forked_run_is_a_process_that_signals_reach(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    process = cli_processes.popen([sys.executable, str(script), "wait"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
    assert isinstance(process, cli_processes.Popen)  # forked, not a fresh interpreter
    while "waiting" not in process.stdout.readline():
        time.sleep(0.01)
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
    process.stdout.close()


def test_what_jax_reads_at_import_set_otherwise_gets_a_fresh_interpreter(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    process = cli_processes.popen([sys.executable, str(script), "none"], env={**os.environ, "JAX_ENABLE_X64": "1"})
    assert isinstance(process, subprocess.Popen) and process.wait(timeout=60) == 0


def test_what_an_xla_tpu_compile_sets_for_libtpu_still_forks(tmp_path, monkeypatch):
    """An ahead-of-time TPU compile in the test process sets libtpu's variables (planning/tpu_compile.py); a run
    started after it is still a fork, whenever the fork server started."""
    cli_processes._fork_server()  # started before the compile sets them
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    process = cli_processes.popen([sys.executable, str(script), "none"])
    assert isinstance(process, cli_processes.Popen) and process.wait(timeout=60) == 0
