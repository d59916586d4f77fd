"""Interconnect bandwidths and memory per device type: the figures the planner divides bytes by.

Peak FLOP/s come from `maxshard/perf.py` (one table for MFU and planning). Here, per XPK device type family:

    ici_bw   bytes/s one device can push into a collective over the fast interconnect inside a slice (TPU ICI,
             NVLink inside a GPU node), one direction
    dcn_bw   bytes/s one device gets across slices (the host's data-center NICs shared by its chips), one direction
    hbm      bytes of accelerator memory per device

Sources (vendor documentation; "assumed" marks a figure no vendor page states for this use):
  TPU v4   ICI: cloud.google.com/tpu/docs/v4 gives no per-chip ICI figure; its "all-reduce bandwidth per Pod
           1.1 PB/s" over 4096 chips = 268 GB/s per chip (derived). HBM "32 GiB". DCN: assumed 50 Gbps per chip,
           as v5p (no published v4 figure).
  TPU v5e  cloud.google.com/tpu/docs/v6e (v5e column): ICI "1600 Gbps" = 200 GB/s (also all-reduce bandwidth per
           Pod 51.2 TB/s / 256 chips); "per-host NIC 2 x 100 Gbps", 8 chips per host -> 25 Gbps per chip; HBM 16 GB.
  TPU v5p  cloud.google.com/tpu/docs/v5p: "Interchip Interconnect BW 4800 Gbps" = 600 GB/s (the newer page:
           "bidirectional ICI bandwidth per chip 1200 GBps", i.e. 600 each way); "DCN bandwidth per chip 50 Gbps";
           HBM "95 GiB".
  TPU v6e  cloud.google.com/tpu/docs/v6e: ICI "3200 Gbps" = 400 GB/s (= all-reduce bandwidth per Pod 102.4 TB/s
           / 256 chips; one revision of the page says 3584 Gbps, we take the lower); "per-host NIC 4 x 200 Gbps",
           8 chips per host -> 100 Gbps per chip; HBM 32 GB.
  H100/H200 NVIDIA H100 and H200 datasheets: NVLink "900 GB/s" per GPU, both directions together -> 450 GB/s.
  A100     NVIDIA A100 datasheet: NVLink "600 GB/s" -> 300 GB/s.
  GPU DCN  cloud.google.com/compute/docs/gpus/gpu-network-bandwidth, per VM of 8 GPUs: A3 High up to 1,000 Gbps,
           A3 Mega 1,600 Gbps (8 x 200 Gbps GPUDirect-TCPXO NICs), A3 Ultra 3,200 Gbps (8 ConnectX-7 NICs for
           GPU traffic), A2 100 Gbps; divided evenly over the 8 GPUs (assumed: all GPUs send at once).

What is *not* modelled: link contention between mesh axes that share ICI links, torus wrap-around, latency, and
the efficiency of real collectives (often 60-90% of these peaks). The times that use these figures are lower bounds.
"""

from __future__ import annotations

import dataclasses

from maxshard.config import ConfigError

__all__ = ["Interconnect", "INTERCONNECTS", "interconnect"]

_GB = 1e9  # bytes
_GBIT = 1e9 / 8  # bytes per second in one Gbps
_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Interconnect:
    ici_bw: float  # bytes/s per device, one direction, inside a slice (or GPU node)
    dcn_bw: float  # bytes/s per device, one direction, across slices (or nodes)
    hbm: float  # bytes of device memory
    source: str  # where the figures come from (shown in the printout)


# Keyed by the family part of the XPK device type ("v5p" of "v5p-1024") or the whole GPU type name.
INTERCONNECTS: dict[str, Interconnect] = {
    "v4": Interconnect(1.1e15 / 4096, 50 * _GBIT, 32 * _GIB, "Cloud TPU v4 docs (ICI derived, DCN assumed)"),
    "v5litepod": Interconnect(1600 * _GBIT, 2 * 100 * _GBIT / 8, 16 * _GB, "Cloud TPU v5e/v6e docs"),
    "v5p": Interconnect(4800 * _GBIT, 50 * _GBIT, 95 * _GIB, "Cloud TPU v5p docs"),
    "v6e": Interconnect(3200 * _GBIT, 4 * 200 * _GBIT / 8, 32 * _GB, "Cloud TPU v6e docs"),
    "h100-80gb-8": Interconnect(450 * _GB, 1000 * _GBIT / 8, 80 * _GB, "NVIDIA H100 datasheet; GCE A3 High"),
    "h100-mega-80gb-8": Interconnect(450 * _GB, 1600 * _GBIT / 8, 80 * _GB, "NVIDIA H100 datasheet; GCE A3 Mega"),
    "h200-141gb-8": Interconnect(450 * _GB, 3200 * _GBIT / 8, 141 * _GB, "NVIDIA H200 datasheet; GCE A3 Ultra"),
    "a100-40gb-8": Interconnect(300 * _GB, 100 * _GBIT / 8, 40 * _GB, "NVIDIA A100 datasheet; GCE A2"),
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
