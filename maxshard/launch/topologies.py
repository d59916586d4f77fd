"""What a target device type holds: chips per slice, hosts, and the `device_kind` JAX reports on it.

The launcher validates a trainer config for hardware it is not running on, so it needs the same two numbers the
trainer would read from JAX there: the device count and the device kind (which `mesh_rules` and the device registry
match). A JAX device is one chip on TPU v4 and later (megacore) and one GPU on NVIDIA. How each family counts, its
hosts and its device kind are the chip's row in `maxshard/devices.py`; this module only parses names with them.

TPU names count differently per generation, as Cloud TPU and XPK spell them:

    v4-N, v5p-N              N counts TensorCores, 2 per chip: v5p-256 = 128 chips = 32 hosts of 4 chips
    v5litepod-N (v5e-N), v6e-N   N counts chips; a slice of up to 8 chips is one host (the 1-, 4- and 8-chip
                             machine types), larger slices use hosts of 4 chips: v5litepod-16 = 4 hosts

A GPU "slice" is one node of 8 GPUs; `--num-slices` then counts nodes, and each node is one JAX process.

The planner also takes `cpu-N` (`parse(..., cpu=True)`): N simulated CPU devices on this machine, as the trainer
runs with `cpu_device_count=N`. No launcher submits it; it plans the run a laptop simulates, compiled by XLA:CPU.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from maxshard import devices
from maxshard.errors import ConfigError

__all__ = ["Target", "TpuFamily", "GpuType", "TPU_FAMILIES", "GPU_TYPES", "parse", "accepted_forms"]


@dataclasses.dataclass(frozen=True)
class TpuFamily:
    """One TPU generation: how its names count and what JAX calls its chips."""

    names: tuple[str, ...]  # first one is XPK's spelling, the others are accepted aliases
    device_kind: str  # jax.Device.device_kind on this chip
    cores_per_unit: int  # TensorCores per unit of N in the name (2: N counts cores; 1: N counts chips)
    chips_per_host: int  # chips of one host in a multi-host slice
    one_host_up_to: int  # slices of at most this many chips fit on one host
    sizes: tuple[int, ...] = ()  # accepted N ((): any multiple of 8)


@dataclasses.dataclass(frozen=True)
class GpuType:
    device_kind: str  # the CUDA device name JAX reports
    gpus_per_node: int
    xpk: bool = True  # an XPK --device-type (False: a node type the planner knows, launched by other means)


def _tpu_family(chip: devices.Chip, node: devices.Node, slices: devices.Slices) -> TpuFamily:
    """A TPU family's naming rules from its registry row."""
    return TpuFamily(node.names, chip.device_kinds[0], slices.cores_per_unit, node.chips_per_host,
                     slices.one_host_up_to, slices.sizes)


# In registry order: the order the accepted forms are listed in.
TPU_FAMILIES: tuple[TpuFamily, ...] = tuple(
    _tpu_family(chip, node, node.slices) for chip, node in devices.nodes() if node.slices is not None)

GPU_TYPES: dict[str, GpuType] = {
    node.names[0]: GpuType(chip.device_kinds[0], node.chips_per_host, node.xpk)
    for chip, node in devices.nodes() if chip.accelerator == "gpu"
}


@dataclasses.dataclass(frozen=True)
class Target:
    """`num_slices` slices (TPU) or nodes (GPU) of one device type, as the trainer will see them."""

    name: str  # XPK's --device-type value (cpu-N: this machine's simulated devices)
    accelerator: Literal["tpu", "gpu", "cpu"]
    device_kind: str
    chips_per_slice: int
    hosts_per_slice: int
    num_slices: int

    @property
    def chips_per_host(self) -> int:
        return self.chips_per_slice // self.hosts_per_slice

    @property
    def num_devices(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def num_hosts(self) -> int:
        """JAX processes of the run: one per host."""
        return self.hosts_per_slice * self.num_slices


def accepted_forms(cpu: bool = False) -> str:
    """The accepted device types, for error messages (`cpu`: the planner's cpu-N too)."""
    tpu = ", ".join(
        f"{'/'.join(n + '-N' for n in f.names)} ({'N cores' if f.cores_per_unit > 1 else 'N chips'}: "
        f"{', '.join(map(str, f.sizes)) if f.sizes else 'a multiple of 8'})"
        for f in TPU_FAMILIES
    )
    local = "; cpu-N (N simulated CPU devices on this machine)" if cpu else ""
    return f"{tpu}; GPU nodes: {', '.join(GPU_TYPES)}{local}"


def _tpu(family: TpuFamily, n: int, num_slices: int, text: str, cpu: bool) -> Target:
    valid = n in family.sizes if family.sizes else n >= 8 and n % 8 == 0
    if not valid:
        raise ConfigError(f"device type {text!r}: N={n} is not a {family.names[0]} slice size; "
                          f"{accepted_forms(cpu)}")
    chips = n // family.cores_per_unit
    hosts = 1 if chips <= family.one_host_up_to else chips // family.chips_per_host
    return Target(f"{family.names[0]}-{n}", "tpu", family.device_kind, chips, hosts, num_slices)


def _cpu(n: int, num_slices: int, text: str) -> Target:
    """N simulated CPU devices of one process: one host, one slice (simulated devices have no slices to span)."""
    if n < 1:
        raise ConfigError(f"device type {text!r}: cpu-N needs N >= 1 simulated devices")
    if num_slices != 1:
        raise ConfigError(f"--num-slices={num_slices}: cpu-N is one process's simulated devices, one slice")
    return Target(f"cpu-{n}", "cpu", "cpu", n, 1, 1)


def parse(device_type: str, num_slices: int = 1, cpu: bool = False) -> Target:
    """'v5p-256', 2 -> Target(128 chips and 32 hosts per slice, 2 slices); with `cpu` (the planner) also 'cpu-8';
    ConfigError listing accepted forms."""
    if num_slices < 1:
        raise ConfigError(f"--num-slices must be >= 1, got {num_slices}")
    text = device_type.strip().lower()
    if text in GPU_TYPES:
        gpu = GPU_TYPES[text]
        return Target(text, "gpu", gpu.device_kind, gpu.gpus_per_node, 1, num_slices)
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    if match and cpu and match.group(1) == "cpu":
        return _cpu(int(match.group(2)), num_slices, device_type)
    if match:
        for family in TPU_FAMILIES:
            if match.group(1) in family.names:
                return _tpu(family, int(match.group(2)), num_slices, device_type, cpu)
    raise ConfigError(f"unknown device type {device_type!r}; accepted: {accepted_forms(cpu)}")
