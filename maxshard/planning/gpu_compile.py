"""XLA:GPU programs compiled ahead of time on a machine without a GPU, for a GPU node type named like XPK names it.

JAX's CUDA plugin (the `gpu-aot` extra: `jax[cuda12]`, the plugin and NVIDIA's CUDA wheels) describes a GPU
topology without opening a device when it is given the GPU's target description: the device facts XLA:GPU's
compiler reads (its SM count, compute capability, shared memory, L2, clock and memory size), as the
`GpuTargetConfigProto` text XLA's own `gpu_specs` files hold. The devices it returns are compile-only: a mesh of
them lowers and compiles the run's real init and train step, and `memory_analysis()` is XLA:GPU's own figure for
that program, the same as `planning/tpu_compile.py` gives for a TPU slice through libtpu. The plugin alone compiles
XLA's own programs; cuDNN's fused attention needs the cuDNN library to trace (the CUDA wheels); tokamax's kernel
cannot be compiled without a GPU (`why_not_compiled` says so in one line).

The target descriptions are one row per chip (`SPECS`, keyed by the chip's row in `maxshard/devices.py`, which holds
its memory): a GPU the table lacks is refused in one line naming those it has, never guessed from a neighbour.
Facts are from NVIDIA's datasheets and CUDA's device query of each GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from maxshard import devices as chips
from maxshard.errors import ConfigError
from maxshard.launch.topologies import Target

__all__ = ["INSTALL", "GpuSpec", "SPECS", "missing", "target_config", "abstract_devices", "why_not_compiled"]

INSTALL = 'pip install -e ".[gpu-aot]"'
# What a compile without a GPU cannot do, by the words the library raises with: cuDNN's fused attention is traced
# against the cuDNN library (the `gpu-aot` extra's CUDA wheels carry it); tokamax's Mosaic GPU kernel asks the local
# device what it is, and a CPU is not a Hopper.
_LIMITS = (("cuDNN not found", f"tracing cuDNN's fused attention needs the cuDNN library: {INSTALL}"),
           ("Not supported on cpu", "tokamax's kernel checks the local device, so it compiles only on a GPU; plan "
                                    "with attention=cudnn, whose program XLA:GPU compiles here"))
_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA:GPU's compiler reads of one GPU model (a `GpuTargetConfigProto`'s device info)."""

    compute_capability: tuple[int, int]
    sms: int  # streaming multiprocessors ("cores" to XLA)
    fp32_lanes_per_sm: int
    shared_memory_per_sm: int  # bytes
    shared_memory_per_block_optin: int  # bytes a block may opt in to
    l2_cache: int  # bytes
    clock_ghz: float  # boost clock
    memory_bandwidth: float  # bytes/s


_KIB, _MIB = 1024, 2**20
SPECS: dict[str, GpuSpec] = {
    chips.H100.name: GpuSpec((9, 0), 132, 128, 228 * _KIB, 227 * _KIB, 50 * _MIB, 1.98, 3.35e12),
    chips.H100_96GB.name: GpuSpec((9, 0), 132, 128, 228 * _KIB, 227 * _KIB, 50 * _MIB, 1.98, 3.35e12),
    chips.H200.name: GpuSpec((9, 0), 132, 128, 228 * _KIB, 227 * _KIB, 50 * _MIB, 1.98, 4.8e12),
    chips.A100.name: GpuSpec((8, 0), 108, 64, 164 * _KIB, 163 * _KIB, 40 * _MIB, 1.41, 1.555e12),
}


def target_config(chip: chips.Chip, device_kind: str) -> str:
    """The `GpuTargetConfigProto` text of `chip`: the device JAX will report as `device_kind`, with the memory
    maxshard's chip registry gives it."""
    spec = _spec(chip)
    major, minor = spec.compute_capability
    info = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 48 * _KIB,
        "shared_memory_per_core": spec.shared_memory_per_sm, "threads_per_core_limit": 2048,
        "core_count": spec.sms, "fpus_per_core": spec.fp32_lanes_per_sm, "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535, "block_dim_limit_z": 65535, "memory_bandwidth": int(spec.memory_bandwidth),
        "l2_cache_size": spec.l2_cache, "clock_rate_ghz": spec.clock_ghz, "device_memory_size": int(chip.hbm),
        "shared_memory_per_block_optin": spec.shared_memory_per_block_optin, "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
    }
    fields = "\n".join(f"  {key}: {value}" for key, value in info.items())
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 0 patch: 0 }}\n'
            f'device_description_str: "{device_kind}"\n')


def _spec(chip: chips.Chip) -> GpuSpec:
    if chip.name not in SPECS:
        raise ConfigError(f"compiling for a {chip.name} without one needs its XLA:GPU target description, which "
                          f"maxshard has for {', '.join(SPECS)}")
    return SPECS[chip.name]


def abstract_devices(target: Target) -> list[Any]:
    """The compile-only GPU devices of `target` (every node); ConfigError (one line) without JAX's CUDA plugin or
    for a GPU `SPECS` lacks."""
    chip = chips.by_kind(target.device_kind)
    if chip is None:
        raise ConfigError(f"no chip row for device kind {target.device_kind!r} of {target.name}")
    config = target_config(chip, target.device_kind)
    reason = missing()
    if reason is not None:
        raise ConfigError(f"{reason}, which is not installed: {INSTALL}")
    from jax.experimental.topologies import get_topology_desc

    shape = f"{target.num_slices}x{target.hosts_per_slice}x{target.chips_per_host}"  # slices x hosts x GPUs
    try:
        found = list(get_topology_desc(platform="cuda", topology=shape, target_config=config).devices)
    except Exception as e:  # the plugin's own words
        raise ConfigError(f"JAX's CUDA plugin cannot describe {target.name} x {target.num_slices} as {shape}: "
                          f"{str(e).splitlines()[0]}") from None
    if len(found) != target.num_devices:
        raise ConfigError(f"JAX's CUDA plugin describes {shape} with {len(found)} devices, {target.name} x "
                          f"{target.num_slices} has {target.num_devices}")
    return found


def missing() -> str | None:
    """Why this machine cannot compile for a GPU (None: JAX's CUDA plugin is installed, so it can)."""
    if any(_installed(plugin) for plugin in _PLUGINS):
        return None
    return "compiling for a GPU without one needs JAX's CUDA plugin"


def why_not_compiled(error: Exception) -> str | None:
    """One line for a compile that failed only because no GPU or no CUDA library is here, else None."""
    return next((line for words, line in _LIMITS if words in str(error)), None)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False
