"""One registry of the chips maxshard knows: one row per chip, every figure with its source, in one place.

MFU (`perf.py` divides by the peak), quantization (which 8-bit peak a run gets, whether a GPU has fp8 tensor
cores), the planner (`planning/hardware.py`: HBM, ICI and DCN bandwidth, host memory) and the launcher
(`launch/topologies.py`: how XPK names a slice, chips per host, the device kind JAX reports there) all read a
chip's facts here, so no number of a chip is written twice. A chip is known by two kinds of name:

    device kind   what `jax.Device.device_kind` says ("TPU v5 lite", "NVIDIA H100 80GB HBM3"), matched by the row's
                  `kinds` pattern (case-insensitive search); rows are tried in order, so a variant (PCIe, NVL)
                  comes before its general name. A JAX device is one chip on TPU v4 and later (megacore) and one
                  GPU on NVIDIA. A kind no row matches has no figures: no MFU is reported, never a guess.
    XPK name      a `Node` of the chip: a TPU family prefix ("v5p" of "v5p-256") or a whole GPU node type
                  ("h100-80gb-8"). DCN bandwidth and host memory belong to the machine, not the chip: one H100
                  80GB runs in A3 High and A3 Mega nodes with different NICs.

Units: FLOP/s (an int8 multiply-add counts 2, as a FLOP does), bytes, bytes/s. The figures, per field:

    peak_*   peak dense FLOP/s of one device in bf16, int8 and fp8; None where the chip has no such matrix unit or
             no vendor table gives a rate (fp8 on TPU v4/v5e/v5p/v6e: a run counts those matmuls at bf16)
    hbm      bytes of device memory a program may allocate (allocatable, not the marketing figure): what XLA:TPU
             reports as "available HBM" when a program does not fit, and on GPUs what JAX's allocator can take
             with XLA_PYTHON_CLIENT_MEM_FRACTION=1 (JAX takes 75% of it unless that variable says otherwise)
    ici_bw   bytes/s one device can push into a collective over the fast interconnect inside a slice (TPU ICI,
             NVLink inside a GPU node), one direction
    dcn_bw   (of a Node) bytes/s one device gets across slices (the host's data-center NICs shared by its chips),
             one direction
    host     (of a Node) bytes of host memory (the VM's RAM) per device, for what an offload remat policy moves
             there; None where no source was found (that host memory is not checked)

Sources are vendor pages; "assumed" marks a figure no vendor page states for this use. Shared by several rows:
  TPU HBM  XLA:TPU's own figure (ahead of time; the release is in benchmarks/README.md): compiling a program too
           large for one chip says "exceeds available HBM (X)": v4 30.75 GiB (of 32), v5e 15.75 GiB (of 16),
           v5p 95.74 GiB, v6e 31.25 GiB (of 32). The vendor pages print 16 GB / 32 GB / 95 GiB for the same chips.
  GPU HBM  measured on an H100 80GB (nvidia-smi: 81559 MiB): JAX's allocator limit was 59.4 GiB at its default 75%,
           so 79.2 GiB allocatable, 458 MiB under the card's total. H200 (143771 MiB) and A100 40GB (40960 MiB)
           derived with the same reserve; H100 96GB assumed as 96 GiB less that reserve.
  GPU DCN  cloud.google.com/compute/docs/gpus/gpu-network-bandwidth, per VM of 8 GPUs: A3 High up to 1,000 Gbps,
           A3 Mega 1,600 Gbps (8 x 200 Gbps GPUDirect-TCPXO NICs), A3 Ultra 3,200 Gbps (8 ConnectX-7 NICs for
           GPU traffic), A2 100 Gbps; divided evenly over the 8 GPUs (assumed: all GPUs send at once).
  GPU peaks  NVIDIA's datasheets print Tensor Core rates with sparsity; dense, used here, is half.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

__all__ = ["PRECISIONS", "Slices", "Node", "Chip", "CHIPS", "by_kind", "peak_flops", "by_device_type", "nodes"]

PRECISIONS = ("bf16", "int8", "fp8")
_GB = 1e9  # bytes
_GBIT = 1e9 / 8  # bytes per second in one Gbps
_GIB = 2**30
_MIB = 2**20
_GPU_RESERVE_MIB = 458  # the CUDA context's share of an H100 80GB that JAX's allocator cannot have (measured)
_TPU_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)  # v5e and v6e slices, in chips (Cloud TPU's machine types)


def _gpu(total_mib: int) -> float:
    """Allocatable bytes of a GPU whose total nvidia-smi prints as `total_mib` MiB."""
    return (total_mib - _GPU_RESERVE_MIB) * _MIB


@dataclasses.dataclass(frozen=True)
class Slices:
    """How XPK's name of a TPU slice counts ('v5p-N': N TensorCores), and when a slice needs more than one host."""

    cores_per_unit: int  # TensorCores per unit of N in the name (2: N counts cores; 1: N counts chips)
    one_host_up_to: int  # slices of at most this many chips fit on one host
    libtpu_name: str  # the family in libtpu's topology names ("v6e:16x16"), for ahead-of-time compiles
    torus_rank: int  # dimensions of the slice's torus in those names (v5e/v6e 2, v5p/v4 3)
    sizes: tuple[int, ...] = ()  # accepted N ((): any multiple of 8)


@dataclasses.dataclass(frozen=True)
class Node:
    """A machine type of a chip as XPK's --device-type names it, with what differs between machines of one chip."""

    names: tuple[str, ...]  # first one is XPK's spelling, the others are accepted aliases
    chips_per_host: int  # chips of one host in a multi-host slice (GPU: the node's GPUs)
    dcn_bw: float  # bytes/s per device, one direction, across slices (or nodes)
    host: float | None  # bytes of host memory per device (None: unknown, not checked)
    source: str  # where the planner's figures come from (the plan prints it)
    slices: Slices | None = None  # TPU: how a slice of it is named (None: a GPU node, named whole)
    xpk: bool = True  # an XPK --device-type (False: a node type the planner knows, launched by other means)


@dataclasses.dataclass(frozen=True)
class Chip:
    """One chip: its names, its peaks per precision, its memory and interconnect, and where they come from."""

    name: str
    accelerator: Literal["tpu", "gpu", "cpu"]
    kinds: str  # regex searched in the lower-cased device kind
    device_kinds: tuple[str, ...]  # device kinds JAX reports for it; the first is the one on its nodes
    peak_bf16: float | None
    peak_int8: float | None
    peak_fp8: float | None
    hbm: float | None  # allocatable bytes (None: no node of it is planned for)
    ici_bw: float | None  # bytes/s per device, one direction, inside a slice (or GPU node)
    nodes: tuple[Node, ...]
    source: str  # the public pages the row's figures come from

    def peak(self, precision: str) -> float | None:
        """Peak dense FLOP/s in `precision` ('bf16', 'int8' or 'fp8'); KeyError for another name."""
        if precision not in PRECISIONS:
            raise KeyError(precision)
        return getattr(self, f"peak_{precision}")


def _tpu_node(name: str, dcn_bw: float, host: float | None, source: str, slices: Slices, *aliases: str) -> Node:
    """A TPU family's node: multi-host slices use hosts of 4 chips on every generation here."""
    return Node((name, *aliases), 4, dcn_bw, host, source, slices)


def _gpu_node(name: str, dcn_bw: float, source: str, host: float | None = None, xpk: bool = True) -> Node:
    """A GPU node type of 8 GPUs, one JAX process."""
    return Node((name,), 8, dcn_bw, host, source, xpk=xpk)


# TPU v4. cloud.google.com/tpu/docs/v4: "Peak compute per chip 275 teraflops (bf16 or int8)". ICI: the page gives
# no per-chip figure; its "all-reduce bandwidth per Pod 1.1 PB/s" over 4096 chips = 268 GB/s per chip (derived).
# DCN: assumed 50 Gbps per chip, as v5p (no published v4 figure). Host memory: no source found.
V4 = Chip(
    "TPU v4", "tpu", r"^tpu v4$", ("TPU v4",), 275e12, 275e12, None, 30.75 * _GIB, 1.1e15 / 4096,
    (_tpu_node("v4", 50 * _GBIT, None, "Cloud TPU v4 docs (ICI derived, DCN assumed)", Slices(2, 4, "v4", 3)),),
    "cloud.google.com/tpu/docs/v4; XLA:TPU's available HBM",
)

# TPU v5p (JAX says "TPU v5"). cloud.google.com/tpu/docs/v5p: "Peak compute per chip (bf16): 459 TFLOPs";
# "Interchip Interconnect BW 4800 Gbps" = 600 GB/s (the newer page: "bidirectional ICI bandwidth per chip
# 1200 GBps", i.e. 600 each way); "DCN bandwidth per chip 50 Gbps"; "RAM (GB) (4-chip VM) 448".
# Int8: cloud.google.com/blog (TPU v5p announcement, Dec 2023): "918 TOPs" per chip.
V5P = Chip(
    "TPU v5p", "tpu", r"^tpu v5p?$", ("TPU v5", "TPU v5p"), 459e12, 918e12, None, 95.74 * _GIB, 4800 * _GBIT,
    (_tpu_node("v5p", 50 * _GBIT, 448 * _GB / 4, "Cloud TPU v5p docs", Slices(2, 4, "v5p", 3)),),
    "cloud.google.com/tpu/docs/v5p; TPU v5p announcement (int8); XLA:TPU's available HBM",
)

# TPU v5e (v5litepod; JAX says "TPU v5 lite"). cloud.google.com/tpu/docs/v5e: "Peak compute per chip (bf16):
# 197 TFLOPs", "(Int8) 393 TOPs". cloud.google.com/tpu/docs/v6e (v5e column): ICI "1600 Gbps" = 200 GB/s (also
# all-reduce bandwidth per Pod 51.2 TB/s / 256 chips); "per-host NIC 2 x 100 Gbps", 8 chips per host -> 25 Gbps
# per chip; "DRAM per host 512 GiB", 8 chips.
V5E = Chip(
    "TPU v5e", "tpu", r"^tpu v5 ?(lite|e)$", ("TPU v5 lite", "TPU v5e"), 197e12, 393e12, None, 15.75 * _GIB,
    1600 * _GBIT,
    (_tpu_node("v5litepod", 2 * 100 * _GBIT / 8, 512 * _GIB / 8, "Cloud TPU v5e/v6e docs",
               Slices(1, 8, "v5e", 2, _TPU_SIZES), "v5e"),),
    "cloud.google.com/tpu/docs/v5e; cloud.google.com/tpu/docs/v6e (v5e column); XLA:TPU's available HBM",
)

# TPU v6e (JAX says "TPU v6 lite"). cloud.google.com/tpu/docs/v6e: "Peak compute per chip (bf16): 918 TFLOPs",
# "(Int8) 1836 TOPs"; ICI "3200 Gbps" = 400 GB/s (= all-reduce bandwidth per Pod 102.4 TB/s / 256 chips; one
# revision of the page says 3584 Gbps, we take the lower); "per-host NIC 4 x 200 Gbps", 8 chips per host ->
# 100 Gbps per chip; "RAM per VM" 720 GB for the 4-chip VMs of multi-host slices (1440 GB for the 8-chip one; its
# "DRAM per host 1536 GiB" is the machine's).
V6E = Chip(
    "TPU v6e", "tpu", r"^tpu v6 ?(lite|e)$", ("TPU v6 lite", "TPU v6e"), 918e12, 1836e12, None, 31.25 * _GIB,
    3200 * _GBIT,
    (_tpu_node("v6e", 4 * 200 * _GBIT / 8, 720 * _GB / 4, "Cloud TPU v6e docs", Slices(1, 8, "v6e", 2, _TPU_SIZES)),),
    "cloud.google.com/tpu/docs/v6e; XLA:TPU's available HBM",
)

# H100 PCIe and NVL: NVIDIA H100 datasheet, BF16 Tensor Core 1,513 (PCIe) and 1,671 (NVL) TFLOPS, INT8 and FP8
# 3,026 and 3,341, all with sparsity. No node of them is planned for: no HBM or NVLink figure kept.
H100_PCIE = Chip("H100 PCIe", "gpu", r"h100.*pcie", ("NVIDIA H100 PCIe",), 756e12, 1513e12, 1513e12, None, None, (),
                 "NVIDIA H100 datasheet")
H100_NVL = Chip("H100 NVL", "gpu", r"h100(?!.*pcie).*nvl", ("NVIDIA H100 NVL",), 835e12, 1670e12, 1670e12, None,
                None, (), "NVIDIA H100 datasheet")

# H100 80GB (SXM). NVIDIA H100 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, i.e. 989 dense; INT8 3,958
# TOPS and FP8 3,958 TFLOPS with sparsity; NVLink "900 GB/s" per GPU, both directions together -> 450 GB/s.
# A3 High hosts: 1,872 GB for 8 GPUs (cloud.google.com/compute/docs/accelerator-optimized-machines).
H100 = Chip(
    "H100 80GB", "gpu", r"h100(?!.*(pcie|nvl|96gb))", ("NVIDIA H100 80GB HBM3",), 989e12, 1979e12, 1979e12,
    _gpu(81559), 450 * _GB,
    (_gpu_node("h100-80gb-8", 1000 * _GBIT / 8, "NVIDIA H100 datasheet; GCE A3 High", host=1872 * _GB / 8),
     _gpu_node("h100-mega-80gb-8", 1600 * _GBIT / 8, "NVIDIA H100 datasheet; GCE A3 Mega")),
    "NVIDIA H100 datasheet; GCE GPU network bandwidth and accelerator-optimized machines pages; measured HBM",
)

# H100 96GB: the H100 80GB's compute and NVLink with 96 GB; nodes of it run outside GCE (8 x 200 Gbps NICs assumed).
H100_96GB = dataclasses.replace(
    H100, name="H100 96GB", kinds=r"h100(?!.*(pcie|nvl)).*96gb", device_kinds=("NVIDIA H100 96GB HBM3",),
    hbm=_gpu(96 * 1024),
    nodes=(_gpu_node("h100-96gb-8", 1600 * _GBIT / 8, "NVIDIA H100 datasheet; 8 x 200 Gbps NICs assumed", xpk=False),),
    source="NVIDIA H100 datasheet; HBM assumed (96 GiB less the H100 80GB's reserve), DCN assumed",
)

# H200. NVIDIA H200 datasheet: H200 SXM BF16 1,979 TFLOPS with sparsity (H200 NVL 1,671); INT8 and FP8 3,958
# (NVL 3,341), with sparsity; NVLink 900 GB/s as the H100's. H200 NVL: no node of it is planned for.
H200_NVL = Chip("H200 NVL", "gpu", r"h200.*nvl", ("NVIDIA H200 NVL",), 835e12, 1670e12, 1670e12, None, None, (),
                "NVIDIA H200 datasheet")
H200 = Chip(
    "H200", "gpu", r"h200(?!.*nvl)", ("NVIDIA H200",), 989e12, 1979e12, 1979e12, _gpu(143771), 450 * _GB,
    (_gpu_node("h200-141gb-8", 3200 * _GBIT / 8, "NVIDIA H200 datasheet; GCE A3 Ultra"),),
    "NVIDIA H200 datasheet; GCE GPU network bandwidth page; HBM derived from the H100's reserve",
)

# A100 (SXM and PCIe alike). NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), INT8 624 TOPS
# (1,248 with sparsity), no fp8 tensor cores (fp8 matmuls need compute capability 8.9); NVLink "600 GB/s" ->
# 300 GB/s. The 80 GB card has the same peaks; no node of it is planned for.
A100 = Chip(
    "A100 40GB", "gpu", r"a100(?!.*80gb)", ("NVIDIA A100-SXM4-40GB",), 312e12, 624e12, None, _gpu(40960), 300 * _GB,
    (_gpu_node("a100-40gb-8", 100 * _GBIT / 8, "NVIDIA A100 datasheet; GCE A2"),),
    "NVIDIA A100 datasheet; GCE GPU network bandwidth page; HBM derived from the H100's reserve",
)
A100_80GB = dataclasses.replace(A100, name="A100 80GB", kinds=r"a100.*80gb", device_kinds=("NVIDIA A100-SXM4-80GB",),
                                hbm=None, ici_bw=None, nodes=(), source="NVIDIA A100 datasheet")

# JAX's CPU device: no peak (MFU is not reported), no HBM (the plan's capacity there is host memory, planning/fit.py).
CPU = Chip("cpu", "cpu", r"^cpu$", ("cpu",), None, None, None, None, None, (),
           "none: a CPU's FLOP/s are not a datasheet figure, so no MFU is reported on it")

# Tried in this order by `by_kind` (the TPU and H100 patterns exclude each other; A100 last, as a kind naming two
# chips is not a real one). The nodes list in this order in messages.
CHIPS: tuple[Chip, ...] = (V4, V5P, V5E, V6E, H100_PCIE, H100_NVL, H100, H100_96GB, H200_NVL, H200, A100_80GB, A100,
                           CPU)


def by_kind(device_kind: str) -> Chip | None:
    """The row of a `jax.Device.device_kind` (first pattern that matches), or None for a chip the registry lacks:
    figures are never guessed from a neighbour."""
    kind = device_kind.strip().lower()
    return next((chip for chip in CHIPS if re.search(chip.kinds, kind)), None)


def peak_flops(device_kind: str, precision: str = "bf16") -> float | None:
    """Peak dense FLOP/s of one device of this kind in `precision` ('bf16', 'int8' or 'fp8'), or None when the kind
    is unknown or has no peak in that precision: MFU and the planner then report none rather than a guess."""
    if precision not in PRECISIONS:
        raise KeyError(precision)
    chip = by_kind(device_kind)
    return None if chip is None else chip.peak(precision)


def nodes() -> tuple[tuple[Chip, Node], ...]:
    """Every node type with its chip, in registry order: the planner's and the launcher's tables are built from it."""
    return tuple((chip, node) for chip in CHIPS for node in chip.nodes)


def by_device_type(name: str) -> tuple[Chip, Node] | None:
    """The node (and chip) an XPK name names exactly: a GPU node type or a TPU family prefix or alias ('v5e')."""
    name = name.strip().lower()
    return next(((chip, node) for chip, node in nodes() if name in node.names), None)
