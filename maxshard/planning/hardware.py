"""Interconnect bandwidths and memory per device type: the figures the planner divides bytes by.

Peak FLOP/s come from `maxshard/observe/perf.py` (one table for MFU and planning). Here, per XPK device type family:

    ici_bw   bytes/s one device can push into a collective over the fast interconnect inside a slice (TPU ICI,
             NVLink inside a GPU node), one direction
    dcn_bw   bytes/s one device gets across slices (the host's data-center NICs shared by its chips), one direction
    hbm      bytes of device memory a program may allocate (allocatable, not the marketing figure): what XLA:TPU
             reports as "available HBM" when a program does not fit, and on GPUs what JAX's allocator can take
             with XLA_PYTHON_CLIENT_MEM_FRACTION=1 (JAX takes 75% of it unless that variable says otherwise)

Sources (vendor documentation; "assumed" marks a figure no vendor page states for this use):
  TPU v4   ICI: cloud.google.com/tpu/docs/v4 gives no per-chip ICI figure; its "all-reduce bandwidth per Pod
           1.1 PB/s" over 4096 chips = 268 GB/s per chip (derived). DCN: assumed 50 Gbps per chip, as v5p (no
           published v4 figure).
  TPU v5e  cloud.google.com/tpu/docs/v6e (v5e column): ICI "1600 Gbps" = 200 GB/s (also all-reduce bandwidth per
           Pod 51.2 TB/s / 256 chips); "per-host NIC 2 x 100 Gbps", 8 chips per host -> 25 Gbps per chip.
  TPU v5p  cloud.google.com/tpu/docs/v5p: "Interchip Interconnect BW 4800 Gbps" = 600 GB/s (the newer page:
           "bidirectional ICI bandwidth per chip 1200 GBps", i.e. 600 each way); "DCN bandwidth per chip 50 Gbps".
  TPU v6e  cloud.google.com/tpu/docs/v6e: ICI "3200 Gbps" = 400 GB/s (= all-reduce bandwidth per Pod 102.4 TB/s
           / 256 chips; one revision of the page says 3584 Gbps, we take the lower); "per-host NIC 4 x 200 Gbps",
           8 chips per host -> 100 Gbps per chip.
  TPU HBM  XLA:TPU's own figure (libtpu 0.0.42.1, ahead of time): compiling a program too large for one chip says
           "exceeds available HBM (X)": v4 30.75 GiB (of 32), v5e 15.75 GiB (of 16), v5p 95.74 GiB, v6e 31.25 GiB
           (of 32). The vendor pages print 16 GB / 32 GB / 95 GiB for the same chips.
  H100/H200 NVIDIA H100 and H200 datasheets: NVLink "900 GB/s" per GPU, both directions together -> 450 GB/s.
  A100     NVIDIA A100 datasheet: NVLink "600 GB/s" -> 300 GB/s.
  GPU HBM  measured on an H100 80GB (nvidia-smi: 81559 MiB): JAX's allocator limit was 59.4 GiB at its default 75%,
           so 79.2 GiB allocatable, 458 MiB under the card's total. H200 (143771 MiB) and A100 40GB (40960 MiB)
           derived with the same reserve; H100 96GB assumed as 96 GiB less that reserve.
  host     host memory (RAM of the VM) per device, for what an offload remat policy moves there: v5e "DRAM per host
           512 GiB", 8 chips (cloud.google.com/tpu/docs/v6e, v5e column); v6e "RAM per VM" 720 GB for the 4-chip VMs
           of multi-host slices and 1440 GB for the 8-chip one (the same page; its "DRAM per host 1536 GiB" is the
           machine's); v5p "RAM (GB) (4-chip VM) 448" (cloud.google.com/tpu/docs/v5p); A3 High 1,872 GB for 8 GPUs
           (cloud.google.com/compute/docs/accelerator-optimized-machines). None where no source was found (v4, the
           other GPU VMs): their host memory is not checked.
  GPU DCN  cloud.google.com/compute/docs/gpus/gpu-network-bandwidth, per VM of 8 GPUs: A3 High up to 1,000 Gbps,
           A3 Mega 1,600 Gbps (8 x 200 Gbps GPUDirect-TCPXO NICs), A3 Ultra 3,200 Gbps (8 ConnectX-7 NICs for
           GPU traffic), A2 100 Gbps; divided evenly over the 8 GPUs (assumed: all GPUs send at once).

What is *not* modelled: link contention between mesh axes that share ICI links, torus wrap-around, latency, and
the efficiency of real collectives (often 60-90% of these peaks). The times that use these figures are lower bounds.
"""

from __future__ import annotations

import dataclasses
import os

from maxshard.errors import ConfigError

__all__ = ["Interconnect", "INTERCONNECTS", "interconnect", "device_memory", "JAX_GPU_FRACTION"]

_GB = 1e9  # bytes
_GBIT = 1e9 / 8  # bytes per second in one Gbps
_GIB = 2**30
_MIB = 2**20
JAX_GPU_FRACTION = 0.75  # the share of a GPU's memory JAX's allocator takes unless XLA_PYTHON_CLIENT_MEM_FRACTION says
_GPU_RESERVE_MIB = 458  # the CUDA context's share of an H100 80GB that JAX's allocator cannot have (measured)


def _gpu(total_mib: int) -> float:
    """Allocatable bytes of a GPU whose total nvidia-smi prints as `total_mib` MiB."""
    return (total_mib - _GPU_RESERVE_MIB) * _MIB


@dataclasses.dataclass(frozen=True)
class Interconnect:
    ici_bw: float  # bytes/s per device, one direction, inside a slice (or GPU node)
    dcn_bw: float  # bytes/s per device, one direction, across slices (or nodes)
    hbm: float  # bytes of device memory a program may allocate
    source: str  # where the figures come from (shown in the printout)
    gpu: bool = False  # JAX's GPU allocator takes a share of `hbm` (`device_memory`)
    host: float | None = None  # bytes of host memory per device (None: unknown, not checked)


# Keyed by the family part of the XPK device type ("v5p" of "v5p-1024") or the whole GPU type name.
INTERCONNECTS: dict[str, Interconnect] = {
    "v4": Interconnect(1.1e15 / 4096, 50 * _GBIT, 30.75 * _GIB, "Cloud TPU v4 docs (ICI derived, DCN assumed)"),
    "v5litepod": Interconnect(1600 * _GBIT, 2 * 100 * _GBIT / 8, 15.75 * _GIB, "Cloud TPU v5e/v6e docs",
                              host=512 * _GIB / 8),
    "v5p": Interconnect(4800 * _GBIT, 50 * _GBIT, 95.74 * _GIB, "Cloud TPU v5p docs", host=448 * _GB / 4),
    "v6e": Interconnect(3200 * _GBIT, 4 * 200 * _GBIT / 8, 31.25 * _GIB, "Cloud TPU v6e docs", host=720 * _GB / 4),
    "h100-80gb-8": Interconnect(450 * _GB, 1000 * _GBIT / 8, _gpu(81559), "NVIDIA H100 datasheet; GCE A3 High",
                                gpu=True, host=1872 * _GB / 8),
    "h100-mega-80gb-8": Interconnect(450 * _GB, 1600 * _GBIT / 8, _gpu(81559), "NVIDIA H100 datasheet; GCE A3 Mega",
                                     gpu=True),
    "h100-96gb-8": Interconnect(450 * _GB, 1600 * _GBIT / 8, _gpu(96 * 1024),
                                "NVIDIA H100 datasheet; 8 x 200 Gbps NICs assumed", gpu=True),
    "h200-141gb-8": Interconnect(450 * _GB, 3200 * _GBIT / 8, _gpu(143771), "NVIDIA H200 datasheet; GCE A3 Ultra",
                                 gpu=True),
    "a100-40gb-8": Interconnect(300 * _GB, 100 * _GBIT / 8, _gpu(40960), "NVIDIA A100 datasheet; GCE A2", gpu=True),
}


def interconnect(device_type: str) -> Interconnect:
    """The figures for an XPK device type ('v5p-1024', 'v5e-16', 'h100-80gb-8')."""
    name = device_type.strip().lower()
    if name in INTERCONNECTS:
        return INTERCONNECTS[name]
    family = name.rsplit("-", 1)[0]
    family = "v5litepod" if family == "v5e" else family
    if family not in INTERCONNECTS:
        raise ConfigError(f"no interconnect figures for device type {device_type!r}; known: {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[family]


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
