"""The README's two commands, as a newcomer runs them.

The first command sets up a venv, installs the project and trains the default model from a fresh clone's working
directory (relative paths: `configs/base.yml`, outputs under `runs/`). CI (`.ci/run`) performs its set-up half
literally; this test checks that, then runs its training half as written, from a temporary directory holding a
clone's `configs/`, adding only overrides that shorten it. The second command is what CI runs: `.ci/run` must run
exactly it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHORTEN = ("steps=2", "eval_period=2", "eval_steps=1", "checkpoint_period=1", "log_period=1")


def readme_commands() -> tuple[str, str]:
    """(set up and train, run the tests): the indented command lines that follow the README's two sentences."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first = re.search(r"Set up and train[^\n]*:\n\n    (.+)\n", text)
    second = re.search(r"Run the tests:\n\n    (.+)\n", text)
    assert first and second, "README.md lost its two commands"
    return first[1].strip(), second[1].strip()


def test_the_front_page_is_short_and_starts_with_the_two_commands():
    """README.md is the product's first screen: the two commands in its first 25 lines, at most ~150 lines, and no
    compiler-release figures or dates (those live in docs/toolchains.md and benchmarks/README.md)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    head = "\n".join(text.splitlines()[:25])
    assert all(command in head for command in readme_commands())
    assert len(text.splitlines()) <= 150
    assert re.findall(r"libtpu \d|jax(?:lib)? \d|\b20\d\d-\d\d-\d\d\b", text) == []


def ci_script() -> list[str]:
    lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def without_flags(command: str, flags: set[str]) -> list[str]:
    return [token for token in shlex.split(command, comments=True) if token not in flags]


def test_ci_runs_the_readme_setup_and_test_command():
    setup_and_train, tests = readme_commands()
    venv, install, train = [part.strip() for part in setup_and_train.split("&&")]
    ci = ci_script()
    quiet = {"-q", "--clear"}
    assert any(without_flags(line, quiet) == shlex.split(venv) for line in ci), venv
    assert any(without_flags(line, quiet) == shlex.split(install) for line in ci), install
    assert tests in ci
    assert shlex.split(train)[:3] == [".venv/bin/python", "-m", "maxshard.train"]


@pytest.mark.slow
def test_the_readme_training_command_runs_as_written(tmp_path):
    """In a clone's layout with relative paths: exit 0, a committed checkpoint at the last step, and a second
    start that reports the run complete."""
    train = shlex.split(readme_commands()[0].split("&&")[-1])
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    argv = [sys.executable, *train[1:], *SHORTEN]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    first = run()
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert f"run: {tmp_path / 'runs' / 'default'}" in first.stdout  # the resolved run directory is printed
    assert "remat: auto -> minimal, the least recompute that fits: planned peak" in first.stdout  # the default
    startup = json.loads((tmp_path / "runs" / "default" / "metrics.jsonl").read_text().splitlines()[0])["startup"]
    assert startup["remat_policy"] == "minimal" and startup["memory_fit"]["requested"] == "auto"
    assert startup["memory_fit"]["planned_bytes"] < startup["memory_fit"]["usable_bytes"]
    checkpoints = tmp_path / "runs" / "default" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2"]  # committed: no *.orbax-checkpoint-tmp
    assert "Traceback" not in first.stderr
    again = run()
    assert again.returncode == 0, again.stderr[-2000:]
    assert "run already complete: step 2 of steps=2" in again.stdout


def test_help_prints_usage_and_where_the_keys_are():
    done = subprocess.run([sys.executable, "-m", "maxshard.train", "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0
    assert done.stdout.startswith("usage: python -m maxshard.train CONFIG.yml")
    assert "configs/base.yml" in done.stdout and "maxshard.launch" in done.stdout
