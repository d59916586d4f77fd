"""Interconnect bandwidths and memory per XPK device type: the figures the planner divides bytes by.

Every figure, with its source, is a chip's row in the device registry (`maxshard/devices.py`); this module only
puts each node type's figures side by side, keyed as XPK names them, and says how much of the memory JAX takes.
Peak FLOP/s come from the same registry (through `model/quantization.py`, one peak for MFU and planning).

    ici_bw   bytes/s one device can push into a collective over the fast interconnect inside a slice (TPU ICI,
             NVLink inside a GPU node), one direction
    dcn_bw   bytes/s one device gets across slices (the host's data-center NICs shared by its chips), one direction
    hbm      bytes of device memory a program may allocate (allocatable, not the marketing figure)
    host     bytes of host memory per device, for what an offload remat policy moves there (None: not checked)

What is *not* modelled: link contention between mesh axes that share ICI links, torus wrap-around, latency, and
the efficiency of real collectives (often 60-90% of these peaks). The times that use these figures are lower bounds.
"""

from __future__ import annotations

import dataclasses
import os

from maxshard import devices
from maxshard.errors import ConfigError
from maxshard.launch.topologies import Target

__all__ = ["Interconnect", "interconnect", "target_link", "device_memory", "JAX_GPU_FRACTION"]

JAX_GPU_FRACTION = 0.75  # the share of a GPU's memory JAX's allocator takes unless XLA_PYTHON_CLIENT_MEM_FRACTION says


@dataclasses.dataclass(frozen=True)
class Interconnect:
    ici_bw: float  # bytes/s per device, one direction, inside a slice (or GPU node)
    dcn_bw: float  # bytes/s per device, one direction, across slices (or nodes)
    hbm: float  # bytes of device memory a program may allocate
    source: str  # where the figures come from (shown in the printout)
    gpu: bool = False  # JAX's GPU allocator takes a share of `hbm` (`device_memory`)
    host: float | None = None  # bytes of host memory per device (None: unknown, not checked)


def _figures(chip: devices.Chip, node: devices.Node) -> Interconnect:
    """One node type's figures from its registry row: the chip's memory and ICI, the machine's DCN and host memory."""
    assert chip.ici_bw is not None and chip.hbm is not None, f"{chip.name} has nodes but no ICI or HBM figure"
    return Interconnect(chip.ici_bw, node.dcn_bw, chip.hbm, node.source, gpu=chip.accelerator == "gpu", host=node.host)


def interconnect(device_type: str) -> Interconnect:
    """The figures for an XPK device type ('v5p-1024', 'v5e-16', 'h100-80gb-8')."""
    name = device_type.strip().lower()
    found = devices.by_device_type(name) or devices.by_device_type(name.rsplit("-", 1)[0])
    if found is None:
        known = ", ".join(node.names[0] for _, node in devices.nodes())
        raise ConfigError(f"no interconnect figures for device type {device_type!r}; known: {known}")
    return _figures(*found)


def target_link(target: Target | None) -> Interconnect | None:
    """The figures of `target`'s devices; None for no target or for this machine's simulated CPU devices (cpu-N),
    which have no datasheet: their memory is the host's (`planning/fit.host_share`), their links memory copies."""
    if target is None or target.accelerator == "cpu":
        return None
    return interconnect(target.name)


def device_memory(device_type: str) -> tuple[float, str]:
    """(bytes, where they come from) a program may allocate on one device of this type, as the trainer will find
    it there: the allocatable HBM on TPUs; on GPUs the share of it JAX's allocator takes, XLA_PYTHON_CLIENT_MEM_FRACTION
    of this process's environment (the job's, when planned with the same variables) or JAX's default 0.75."""
    link = interconnect(device_type)
    if not link.gpu:
        return link.hbm, f"{device_type} HBM"
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    try:
        fraction = float(text) if text else JAX_GPU_FRACTION
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION must be a fraction such as 0.9, got {text!r}") from None
    return link.hbm * fraction, f"{device_type} HBM x {fraction:g} (JAX's share: XLA_PYTHON_CLIENT_MEM_FRACTION)"
