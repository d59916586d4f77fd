"""XLA:TPU programs compiled ahead of time on a machine without a TPU, for a TPU slice named like XPK names it.

libtpu (the `tpu-aot` extra: `jax[tpu]` pins the libtpu that matches jax) describes any TPU topology as abstract
devices (`jax.experimental.topologies.get_topology_desc`); a mesh of them lowers and compiles the run's real
programs, Pallas kernels through Mosaic included, and `memory_analysis()` is the TPU program's own. A program over
the chip's memory fails at compile with RESOURCE_EXHAUSTED, which `compile_run` reports in one line.

Topology names: v5e/v6e slices are 2-D (v6e-256 -> "v6e:16x16", v5litepod-8 -> "v5e:2x4"); v5p and v4 slices are
3-D, in chips (v5p-1024 = 512 chips -> "v5p:8x8x8", v5p-12288 -> "v5p:16x16x24"). The shape is the most even one of
that many chips; the compiled program depends on the device count and kind, and on the torus only through
collective timing. v4 chips are described as one device each (megacore), as JAX sees them on a v4 VM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from maxshard.config import Config
from maxshard.devices import by_device_type
from maxshard.errors import ConfigError
from maxshard.launch.topologies import Target

if TYPE_CHECKING:
    from maxshard.planning.compiled import StepMemory

__all__ = ["INSTALL", "CompiledRun", "TpuOutOfMemory", "missing", "topology_name", "abstract_devices", "compile_run",
           "compile_step"]

INSTALL = 'pip install -e ".[tpu-aot]"'


class TpuOutOfMemory(ConfigError):
    """XLA:TPU found a program over the chip's memory: one line with XLA's own figures."""


@dataclasses.dataclass(frozen=True)
class CompiledRun:
    """Per-device peaks (bytes) and compile seconds of a run's two programs on the target; `step` splits the train
    step's peak (`planning/compiled.StepMemory`: state, batch, temporaries)."""

    init_peak: int
    init_seconds: float
    step_seconds: float
    step: StepMemory

    @property
    def step_peak(self) -> int:
        return self.step.peak

    @property
    def step_host(self) -> int:
        """The train step's host memory buffers per device (what an offload policy moves there)."""
        return self.step.host

    def as_json(self) -> dict[str, Any]:
        return {"init_peak": self.init_peak, "step_peak": self.step_peak, "init_seconds": self.init_seconds,
                "step_seconds": self.step_seconds, "step_host": self.step_host, "step": self.step.as_json()}


def missing() -> str | None:
    """Why this machine cannot compile for a TPU (None: libtpu is installed, so it can)."""
    return None if importlib.util.find_spec("libtpu") is not None else "compiling for a TPU needs libtpu"


def topology_name(target: Target) -> str:
    """get_topology_desc's name for one slice of `target`: 'v6e:16x16', 'v5p:8x8x8'."""
    if target.accelerator != "tpu":
        raise ConfigError(f"--compile compiles for TPU slices (XLA:TPU through libtpu); {target.name} is a GPU node")
    _, node = by_device_type(target.name.rsplit("-", 1)[0])
    slices = node.slices
    return f"{slices.libtpu_name}:{'x'.join(map(str, _slice_shape(target.chips_per_slice, slices.torus_rank)))}"


def _slice_shape(chips: int, rank: int) -> tuple[int, ...]:
    """The most even `rank`-D shape of `chips` chips, sides ascending and ones last as libtpu names them (2x2x1).
    Not only powers of two: v5p-12288 is 16x16x24."""
    def shapes(n: int, k: int) -> Iterator[tuple[int, ...]]:
        if k == 1:
            yield (n,)
            return
        for d in range(1, n + 1):
            if n % d == 0:
                yield from ((d, *rest) for rest in shapes(n // d, k - 1))

    best = min((tuple(sorted(s)) for s in shapes(chips, rank)), key=lambda s: (s[-1] / s[0], s[-1]))
    return tuple(d for d in best if d > 1) + tuple(d for d in best if d == 1)


def _abstract_tpu_environment(target_name: str) -> dict[str, str]:
    """What abstract_devices sets in this process's environment for libtpu, which reads it when it describes a
    topology (a backend starting), not when jax is imported."""
    return {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": target_name,
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


ABSTRACT_TPU_VARIABLES = tuple(_abstract_tpu_environment(""))


def abstract_devices(target: Target) -> list[Any]:
    """The abstract TPU devices of `target` (all slices); ConfigError (one line) without libtpu or for a slice that
    libtpu does not describe."""
    reason = missing()
    if reason is not None:
        raise ConfigError(f"{reason}, which is not installed: {INSTALL}")
    # No TPU VM here: libtpu is not to ask a metadata server, and is told the host and slice type it would ask for
    # (without them it prints a screen of warnings). No chip is opened either, so several processes may compile at
    # once (libtpu's lockfile would refuse the second).
    for variable, value in _abstract_tpu_environment(target.name).items():
        os.environ.setdefault(variable, value)
    from jax.experimental.topologies import get_topology_desc

    name = topology_name(target)
    try:
        devices = list(get_topology_desc(topology_name=name, platform="tpu", num_slices=target.num_slices,
                                         **_topology_options(target)).devices)
    except Exception as e:  # libtpu's own words for a shape it does not know
        raise ConfigError(f"libtpu cannot describe {target.name} as {name!r}: {str(e).splitlines()[0]}") from None
    if len(devices) != target.num_devices:
        raise ConfigError(f"libtpu describes {name!r} with {len(devices)} devices, {target.name} x "
                          f"{target.num_slices} has {target.num_devices}")
    return devices


def _topology_options(target: Target) -> dict[str, Any]:
    """libtpu's options that make its devices JAX's on that slice: one per chip on v4 (libtpu's default there is
    one per TensorCore, twice the count), and a 1-chip host for a 1-chip slice (its default host is 2x2)."""
    options: dict[str, Any] = {}
    if target.name.startswith("v4-"):
        options["chip_config_name"] = "megacore"
    if target.chips_per_slice == 1:
        options["chips_per_host_bounds"] = (1, 1, 1)
    return options


def compile_run(cfg: Config, target: Target, devices: list[Any],
                progress: Callable[[str], None] = lambda line: None, compiler: str = "libtpu") -> CompiledRun:
    """The fresh-run init and the train step of `cfg` compiled for `target` on its compile-only `devices` (this
    module's `abstract_devices`, or `planning/gpu_compile.py`'s for a GPU node; `compiler` names what compiles them in
    the progress lines); TpuOutOfMemory (one line) when XLA:TPU finds a program over the chip's memory."""
    from maxshard.parallel import mesh
    from maxshard.planning.compiled import compile_init, peak_bytes

    run_mesh = mesh.build(cfg, devices)
    progress(f"compiling the init for {target.name} with {compiler} ...")
    started = time.perf_counter()
    with _over_the_chip("init", target):
        init_peak = peak_bytes(compile_init(cfg, run_mesh).memory_analysis())
    init_seconds = time.perf_counter() - started
    progress(f"compiled the init in {init_seconds:.1f}s")
    step, step_seconds = compile_step(cfg, target, devices, progress, compiler)
    return CompiledRun(init_peak, init_seconds, step_seconds, step)


def compile_step(cfg: Config, target: Target, devices: list[Any], progress: Callable[[str], None] = lambda line: None,
                 compiler: str = "libtpu") -> tuple[StepMemory, float]:
    """(the train step's peak split, its compile seconds) of `cfg` compiled for `target` on `devices`, as
    `compile_run` compiles it, without the init."""
    from maxshard.parallel import mesh
    from maxshard.planning.compiled import compile_step_memory

    progress(f"compiling the train step for {target.name} with {compiler} ...")
    started = time.perf_counter()
    with _over_the_chip("train step", target):
        step = compile_step_memory(cfg, mesh.build(cfg, devices))[1]
    seconds = time.perf_counter() - started
    progress(f"compiled the train step in {seconds:.1f}s")
    return step, seconds


@contextlib.contextmanager
def _over_the_chip(name: str, target: Target) -> Iterator[None]:
    """XLA:TPU's RESOURCE_EXHAUSTED at compile as TpuOutOfMemory, one line with its figures."""
    try:
        yield
    except Exception as e:
        message = str(e)
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        raise TpuOutOfMemory(f"XLA:TPU cannot fit the {name} on {target.name}: {_first_oom_line(message)}") from None


def _first_oom_line(message: str) -> str:
    """XLA's sentence that says what the program needs and what the chip has."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    line = next((line for line in lines if "exceeds" in line or "Ran out of memory" in line), lines[0])
    # newer libtpu (0.0.50+) goes on after the figures on the same line (". HLO module: ..."): cut it there
    figures = re.match(r"(.*?exceeds available HBM \([^)]*\))", line)
    return f"{figures.group(1)}." if figures else line
