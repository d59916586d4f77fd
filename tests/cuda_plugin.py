"""JAX's CUDA plugin for the tests that compile for NVIDIA GPUs without one (planning/gpu_compile.py), installed once
per machine and jax release into a directory only their subprocesses see (PYTHONPATH).

Where the plugin is installed, every JAX process prints a line at startup that it found no CUDA driver, which the
rest of the suite (exact stderr of the CLIs) must not see; so it never enters the test venv. It matches the
installed jax exactly, as `jax[cuda12-local]` pins it. The directory is shared by the suite's worker processes and
later runs (a lock file orders the first install), so the 175 MB download happens once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")


def plugin_dir() -> Path:
    """The plugin of the installed jax, installed on first use."""
    home = Path(tempfile.gettempdir()) / f"maxshard-jax-cuda12-{jax.__version__}"
    done = home / ".installed"
    with open(f"{home}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(home, ignore_errors=True)
            install = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(home),
                 *(f"{name}=={jax.__version__}" for name in PACKAGES)], capture_output=True, text=True, timeout=900)
            assert install.returncode == 0, install.stderr[-2000:]
            done.touch()
    return home


@pytest.fixture(scope="session")
def cuda_plugin() -> Path:
    return plugin_dir()


def with_plugin(plugin: Path, code: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` on CPU with the plugin importable and the repository on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), str(REPO)]), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
