"""On CPU every test sees 8 simulated devices (this must run before JAX starts its backend); shared training runs;
the accelerator tests (markers `gpu`, `tpu`) skipped, with the reason, where `jax.devices()` has no such device.

JAX_PLATFORMS defaults to cpu, so a GPU or TPU machine runs the CPU suite as CI does; its accelerator tests run
when the user names the platform: `JAX_PLATFORMS=cuda python -m pytest -m gpu` (or tpu, `-m tpu`). The 8 simulated
devices are asked for only when the CPU backend is among the platforms; on an accelerator they change nothing.
"""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PLATFORMS = os.environ.setdefault("JAX_PLATFORMS", "cpu")
ON_CPU = not PLATFORMS or "cpu" in PLATFORMS.split(",")  # "" lets JAX pick every platform it finds

# XLA:CPU builds each program's kernels with LLVM at its lowest optimization level, in this process and (through the
# environment) in every subprocess the tests start. The suite is bound by compiling small programs, not by running
# them, and LLVM's optimizations are the larger part of an XLA:CPU compile (tests/test_parity.py: 115 -> 61 CPU
# seconds). What XLA decides above the kernels (sharding, collectives, fusion, buffers: what the tests are about) is
# the same program, as planning/compiled.py's memory figures already rely on; the kernels compute the same operations,
# float32 results moving in the last bits (a loss after three steps by 2e-7 relative). Runs of the suite are compared
# with each other, bit for bit where a test says so, and with references at 1e-5 and up. The caller's level in
# XLA_FLAGS wins (for each flag below); accelerator runs (-m gpu, -m tpu) are left as they are.
OPTIMIZATION_LEVEL = "--xla_backend_optimization_level=0"
# Likewise its fusions are emitted by the classic LLVM IR emitter, not by the MLIR fusion emitters (jax 0.10.2's
# default), which build an MLIR context and pipeline per fusion: XLA:CPU's compile is 3x cheaper (test_plan_memory's
# 25 train steps: 66 -> 20 CPU seconds; tests/test_parity.py 64 -> 33). Sharding, collectives and the fusions of
# dense layers are the same; the emitter decides how a few ops fuse (a scatter), so some buffers move: of those 25
# compiled peaks 23 by under 0.05%, two MoE ones by +4.3% (dropping, expert=4) and -0.7%. jax 0.12's XLA has no
# such flag (the fusion emitters are its only ones) and stops any process that names it ("Unknown flag in XLA_FLAGS",
# a fatal abort, so it cannot be caught here): a throwaway process tries it first, and it is left out where it fails.
FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA starts its CPU backend with `flag` in XLA_FLAGS (about 2 s, once per pytest run)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True)
    return probe.returncode == 0


# xdist's workers inherit the XLA_FLAGS their controller settled on (set before it starts them), so only it decides.
if ON_CPU and "PYTEST_XDIST_WORKER" not in os.environ:
    for flag in (OPTIMIZATION_LEVEL, FUSION_EMITTERS):
        if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", "") and (flag != FUSION_EMITTERS
                                                                         or _xla_accepts(flag)):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

# One persistent compilation cache for the whole run: both xdist workers and every training subprocess they start
# (all inherit this environment). Tests build the same small programs again and again in new jitted functions (each
# layout's one-device reference, the CLI's step after a test's own), which JAX's in-memory caches do not share; a
# program already compiled by any process of the run is loaded from disk instead (tests/test_lora.py: 122 -> 104 CPU
# s, -n 0). A loaded executable has the same buffers, memory analysis and instructions (only its text loses source
# locations). Made fresh for each run, so no earlier run or other jaxlib can answer, and removed at the end. A
# caller's JAX_COMPILATION_CACHE_DIR wins.
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="maxshard-tests-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": _CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})

# Tracing allocates millions of short-lived objects: at CPython's default threshold (a collection per 700 net
# allocations) the cyclic collector ran 1,953 times in tests/test_parity.py, 3.1 of its 62.6 CPU s (timed with
# gc.callbacks); with a first generation of 100,000 it runs 7 times, 0.95 s. The training processes the tests fork
# (tests/cli_processes.py) are given the same thresholds.
gc.set_threshold(100_000, 50, 100)

import jax  # noqa: E402
import pytest  # noqa: E402

if ON_CPU:
    jax.config.update("jax_num_cpu_devices", 8)

# marker: (jax's platform of such devices, what the tests need, the JAX_PLATFORMS value that selects it). jax names
# an NVIDIA GPU's platform "gpu", which the cuda plugin provides.
ACCELERATORS = {"gpu": ("gpu", "an NVIDIA GPU", "cuda"), "tpu": ("tpu", "a TPU", "tpu")}


def _device_platforms() -> list[str]:
    """The platforms of `jax.devices()`; a test error naming JAX_PLATFORMS where JAX starts none of them (jax 0.10.2
    fails a bare assert when it names a platform whose plugin is not installed, e.g. cuda without jax[cuda12])."""
    try:
        return sorted({d.platform for d in jax.devices()})
    except (RuntimeError, AssertionError) as error:
        pytest.fail(f"JAX_PLATFORMS={PLATFORMS!r}: JAX started no backend ({type(error).__name__}: {error}); is "
                    "its plugin installed (pip install -e '.[cuda]' or '.[tpu]')?", pytrace=False)


# Test files of few tests that each take minutes in one xdist worker (module fixtures that compile many programs,
# XLA:TPU compiles, multi-process trainings), longest first. pytest-xdist's loadfile hands out files by number of
# tests, most first, so these would start last and run on alone after the other worker has run out of files: on 2
# cores the run is CPU-bound, and its length is the CPU work / 2 only if no file is left to run on by itself.
LONGEST_FILES = ("test_plan_heldout_tpu.py", "test_tpu_aot.py", "test_multiprocess.py",
                 "test_grpo.py", "test_objectives.py", "test_local_checkpoints.py", "test_plan_memory.py",
                 "test_moe_routing.py", "test_elastic.py",
                 "test_eval.py", "test_pipeline_runner.py", "test_mtp.py", "test_blocks.py", "test_peft.py",
                 "test_checkpoint_layouts.py", "test_same_model.py", "test_store.py", "test_convert_gemma.py",
                 "test_convert_gpt_oss.py", "test_pipeline_runner_moe.py", "test_pipeline_tpu.py", "test_slurm.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """LONGEST_FILES first, then the other files by number of tests, most first (loadfile's own order; pyproject's
    --no-loadscope-reorder makes it keep this one), the tests of each file in their order."""
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def rank(path: Path) -> tuple[int, int]:
        first = LONGEST_FILES.index(path.name) if path.name in LONGEST_FILES else len(LONGEST_FILES)
        return first, -len(files[path])

    items[:] = [item for path in sorted(files, key=rank) for item in files[path]]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skips a test marked `gpu` or `tpu` unless JAX has such a device, before its fixtures (which may compile for
    it) are set up. Asked at the first marked test, not at collection: JAX's backend starts no earlier than a test
    needs it."""
    for marker, (platform, needs, name) in ACCELERATORS.items():
        if item.get_closest_marker(marker) is None:
            continue
        found = _device_platforms()
        if platform not in found:
            pytest.skip(f"needs {needs}: jax.devices() are {', '.join(found)} (run JAX_PLATFORMS={name} python -m "
                        f"pytest -m {marker})")


@pytest.fixture(scope="session")
def env() -> dict[str, str]:
    """The environment of training subprocesses: on the CPU, with the run's persistent compilation cache (above)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="session")
def reference(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run of tests/training_runs.py: STEPS steps straight, checkpoints at 4 and 8."""
    from training_runs import STEPS, losses, train

    base = tmp_path_factory.mktemp("reference")
    train(env, base)
    assert sorted(losses(base)) == list(range(1, STEPS + 1))
    return base
