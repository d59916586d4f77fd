"""Every test sees 8 simulated CPU devices (this must run before JAX starts its backend); shared training runs."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of training subprocesses: one persistent compilation cache for the whole session."""
    cache = tmp_path_factory.mktemp("jax_cache")
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@pytest.fixture(scope="session")
def reference(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run of tests/training_runs.py: STEPS steps straight, checkpoints at 4 and 8."""
    from training_runs import STEPS, losses, train

    base = tmp_path_factory.mktemp("reference")
    train(env, base)
    assert sorted(losses(base)) == list(range(1, STEPS + 1))
    return base
