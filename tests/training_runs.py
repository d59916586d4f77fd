"""Training subprocesses for the checkpoint tests: one tiny text-data run, its command line, output and metrics.

The runs share one persistent compilation cache (the `env` fixture of conftest.py): the tiny model compiles once per
session, later runs load the same executables. Losses are read from each run's metrics.jsonl, where a resumed run
appends to the file of the run it continues.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import cli_processes

REPO = Path(__file__).resolve().parent.parent
BASE = str(REPO / "configs" / "base.yml")
STEPS = 8
RUN = (
    "cpu_device_count=8", "dataset_type=text", "emb_dim=32", "num_layers=2", "num_heads=2", "num_kv_heads=2",
    "head_dim=16", "mlp_dim=64", "max_target_length=32", "per_device_batch_size=1", "eval_period=0", "log_period=1",
    f"learning_rate_schedule_steps={STEPS}", "checkpoint_period=4", "enable_tensorboard=false",
)
TIMEOUT = 240


def keys(base: Path, *extra: str) -> list[str]:
    """The run's key=value arguments; a key given twice is an error for the CLI, so the last one wins here."""
    merged = {item.split("=")[0]: item for item in (*RUN, f"base_output_directory={base}", f"steps={STEPS}", *extra)}
    return list(merged.values())


def argv(base: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "maxshard.train", BASE, *keys(base, *extra)]


def train(env: dict[str, str], base: Path, *extra: str) -> str:
    """Runs a training subprocess to its end; returns its output (stdout and stderr)."""
    done = cli_processes.run(argv(base, *extra), cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@contextlib.contextmanager
def started(env: dict[str, str], base: Path, *extra: str) -> Iterator[subprocess.Popen]:
    """A training subprocess (stdout and stderr in one pipe), killed on the way out if still running."""
    proc = cli_processes.popen(argv(base, *extra), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGKILLs the process if it still runs and reaps it: no test leaves a training process behind."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def read_until(proc: subprocess.Popen, pattern: str) -> str:
    """Output up to and including the first line matching `pattern`; kills the process if it ends first or fails."""
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if re.search(pattern, line):
                return "".join(seen)
        proc.wait()
    except BaseException:
        stop(proc)
        raise
    raise AssertionError(f"no line matched {pattern!r}:\n{''.join(seen)}")


def losses(base: Path) -> dict[int, float]:
    """step -> loss, the last record of each step winning."""
    records = [json.loads(line) for line in (base / "default" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def resumed_step(output: str) -> int:
    found = re.search(r"resuming from step (\d+)", output)
    assert found, output
    return int(found.group(1))


def started_from(output: str) -> int:
    found = re.search(r"resuming from step (\d+)|starting from step 0", output)
    assert found, output
    return int(found.group(1) or 0)


def step_dir(base: Path, step: int) -> Path:
    return base / "default" / "checkpoints" / str(step)


def saved_state(base: Path, step: int) -> Any:
    """The train state of a checkpoint as numpy arrays (no mesh needed)."""
    path = step_dir(base, step) / "state"
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                            ocp.PyTreeCheckpointHandler().metadata(path).tree)
    return ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))


def assert_same_tree(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
