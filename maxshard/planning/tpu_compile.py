"""XLA:TPU programs compiled ahead of time on a machine without a TPU, for a TPU slice named like XPK names it.

libtpu (the `tpu-aot` extra: `jax[tpu]` pins the libtpu that matches jax) describes any TPU topology as abstract
devices (`jax.experimental.topologies.get_topology_desc`); a mesh of them lowers and compiles the run's real
programs, Pallas kernels through Mosaic included, and `memory_analysis()` is the TPU program's own. A program over
the chip's memory fails at compile with RESOURCE_EXHAUSTED, which `compile_run` reports in one line.

Topology names: v5e/v6e slices are 2-D (v6e-256 -> "v6e:16x16", v5litepod-8 -> "v5e:2x4"); v5p and v4 slices are
3-D, in chips (v5p-1024 = 512 chips -> "v5p:8x8x8"). The shape is the most square one of that many chips; the
compiled program depends on the device count and kind, and on the torus only through collective timing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any

from maxshard.config import Config, ConfigError
from maxshard.launch.topologies import Target

__all__ = ["INSTALL", "CompiledRun", "topology_name", "abstract_devices", "compile_run"]

INSTALL = 'pip install -e ".[tpu-aot]"'
_NAMES = {"v5litepod": "v5e", "v6e": "v6e", "v5p": "v5p", "v4": "v4"}
_DIMENSIONS = {"v5e": 2, "v6e": 2, "v5p": 3, "v4": 3}


@dataclasses.dataclass(frozen=True)
class CompiledRun:
    """Per-device peaks (bytes) and compile seconds of a run's two programs on the target."""

    init_peak: int
    step_peak: int
    init_seconds: float
    step_seconds: float


def topology_name(target: Target) -> str:
    """get_topology_desc's name for one slice of `target`: 'v6e:16x16', 'v5p:8x8x8'."""
    if target.accelerator != "tpu":
        raise ConfigError(f"--compile compiles for TPU slices (XLA:TPU through libtpu); {target.name} is a GPU node")
    family = _NAMES[target.name.rsplit("-", 1)[0]]
    dims = [1] * _DIMENSIONS[family]
    while dims[0] * dims[1] * (dims[2] if len(dims) == 3 else 1) < target.chips_per_slice:
        dims[dims.index(min(dims))] *= 2
    shape = sorted(d for d in dims if d > 1) + [d for d in dims if d == 1]
    return f"{family}:{'x'.join(map(str, shape))}"


def abstract_devices(target: Target) -> list[Any]:
    """The abstract TPU devices of `target` (all slices); ConfigError (one line) without libtpu or for a slice that
    libtpu does not describe."""
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(f"compiling for a TPU needs libtpu, which is not installed: {INSTALL}")
    # No TPU VM here: libtpu is not to ask a metadata server, and is told the host and slice type it would ask for
    # (without them it prints a screen of warnings). No chip is opened either, so several processes may compile at
    # once (libtpu's lockfile would refuse the second).
    for variable, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                            ("TPU_ACCELERATOR_TYPE", target.name), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(variable, value)
    from jax.experimental.topologies import get_topology_desc

    name = topology_name(target)
    try:
        devices = list(get_topology_desc(topology_name=name, platform="tpu", num_slices=target.num_slices).devices)
    except Exception as e:  # libtpu's own words for a shape it does not know (e.g. 1 chip)
        raise ConfigError(f"libtpu cannot describe {target.name} as {name!r}: {str(e).splitlines()[0]}") from None
    if len(devices) != target.num_devices:
        raise ConfigError(f"libtpu describes {name!r} with {len(devices)} devices, {target.name} x "
                          f"{target.num_slices} has {target.num_devices}")
    return devices


def compile_run(cfg: Config, target: Target, progress: Callable[[str], None] = lambda line: None) -> CompiledRun:
    """The fresh-run init and the train step of `cfg` compiled for `target`; ConfigError (one line) when XLA:TPU
    finds a program over the chip's memory."""
    from maxshard import mesh
    from maxshard.planning.compiled import compile_init, compile_train_step, peak_bytes

    run_mesh = mesh.build(cfg, abstract_devices(target))
    peaks, seconds = {}, {}
    for name, compile_one in (("init", compile_init), ("train step", compile_train_step)):
        progress(f"compiling the {name} for {target.name} with libtpu ...")
        started = time.perf_counter()
        try:
            compiled = compile_one(cfg, run_mesh)
        except Exception as e:
            message = str(e)
            if "RESOURCE_EXHAUSTED" not in message:
                raise
            raise ConfigError(f"XLA:TPU cannot fit the {name} on {target.name}: {_first_oom_line(message)}") from None
        seconds[name] = time.perf_counter() - started
        peaks[name] = peak_bytes(compiled.memory_analysis())
        progress(f"compiled the {name} in {seconds[name]:.1f}s")
    return CompiledRun(peaks["init"], peaks["train step"], seconds["init"], seconds["train step"])


def _first_oom_line(message: str) -> str:
    """XLA's sentence that says what the program needs and what the chip has."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return next((line for line in lines if "exceeds" in line or "Ran out of memory" in line), lines[0])
