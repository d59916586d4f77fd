"""The device registry (`maxshard/devices.py`): every row complete, every name naming one row, and the consumers
(MFU and quantization's peak, the planner's figures, the launcher's targets) reading the registry's numbers."""

from __future__ import annotations

import re

import pytest

from maxshard import config, devices
from maxshard.launch import topologies
from maxshard.model import quantization
from maxshard import perf
from maxshard.planning import hardware
from maxshard.run import loading

NODES = devices.nodes()


@pytest.mark.parametrize("chip", devices.CHIPS, ids=lambda c: c.name)
def test_every_row_is_complete(chip: devices.Chip) -> None:
    """Names and a source on every row; an accelerator has bf16 and int8 peaks (8-bit at least the bf16 one); a
    chip the planner can target (one with nodes) has HBM and ICI; every node its DCN, hosts and source; TPU nodes
    say how their slices are named, GPU nodes are named whole. The CPU row is the one with no figures at all."""
    assert chip.name and chip.source and chip.device_kinds and chip.kinds
    if chip.accelerator == "cpu":
        assert [chip.peak(p) for p in devices.PRECISIONS] == [None] * 3 and chip.nodes == ()
        return
    assert chip.peak_bf16 and chip.peak_int8 and chip.peak_int8 >= chip.peak_bf16
    assert chip.peak_fp8 is None or chip.peak_fp8 >= chip.peak_bf16
    if chip.nodes:
        assert chip.hbm and chip.ici_bw
    for node in chip.nodes:
        assert node.names and node.dcn_bw > 0 and node.chips_per_host > 0 and node.source
        assert (node.slices is not None) == (chip.accelerator == "tpu")
        assert node.host is None or node.host > chip.hbm  # host memory per chip exceeds its HBM on every VM here


def test_every_name_resolves_to_one_row() -> None:
    """Each device kind of a row matches that row's pattern and no other row's; each XPK name, aliases included,
    names one node; no name is listed twice."""
    for chip in devices.CHIPS:
        for kind in chip.device_kinds:
            assert [c.name for c in devices.CHIPS if re.search(c.kinds, kind.lower())] == [chip.name]
            assert devices.by_kind(kind) is chip
    kinds = [kind.lower() for chip in devices.CHIPS for kind in chip.device_kinds]
    names = [name for _, node in NODES for name in node.names]
    assert len(kinds) == len(set(kinds)) and len(names) == len(set(names))
    for chip, node in NODES:
        assert all(devices.by_device_type(name) == (chip, node) for name in node.names)


def test_an_unknown_device_has_no_figures() -> None:
    assert devices.by_kind("TPU v3") is None and devices.peak_flops("TPU v7x") is None
    assert devices.peak_flops("cpu") is None and devices.by_device_type("v7x") is None
    with pytest.raises(KeyError):
        devices.peak_flops("TPU v4", "fp16")


@pytest.mark.parametrize("device_type", ["v5litepod-16", "v5p-256", "v6e-256", "h100-80gb-8", "h200-141gb-8"])
def test_the_planner_and_the_launcher_read_the_registry(device_type: str) -> None:
    """The target the launcher parses carries its chip's device kind, and the planner's figures for it are the
    chip's HBM and ICI and the node's DCN and host memory."""
    chip, node = devices.by_device_type(device_type) or devices.by_device_type(device_type.rsplit("-", 1)[0])
    target = topologies.parse(device_type)
    assert devices.by_kind(target.device_kind) is chip
    assert target.chips_per_host == node.chips_per_host or target.hosts_per_slice == 1
    link = hardware.interconnect(device_type)
    assert (link.hbm, link.ici_bw, link.dcn_bw, link.host) == (chip.hbm, chip.ici_bw, node.dcn_bw, node.host)


def test_the_figures_the_tools_print() -> None:
    """A few numbers pinned as the planner and MFU have always used them: allocatable HBM (v6e 31.25 GiB of 32;
    an H100 80GB less the measured 458 MiB reserve), ICI and DCN per chip, the peaks."""
    assert hardware.interconnect("v6e-8").hbm == 31.25 * 2**30
    assert hardware.interconnect("h100-mega-80gb-8").hbm == (81559 - 458) * 2**20
    assert hardware.interconnect("v5e-16").dcn_bw == 25e9 / 8 and hardware.interconnect("v5p-8").ici_bw == 600e9
    assert devices.peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and devices.peak_flops("TPU v5 lite", "int8") == 393e12


@pytest.mark.parametrize("kind", ["TPU v5 lite", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "cpu"])
def test_mfu_measures_against_the_registry_peak(kind: str) -> None:
    """The peak a run's MFU and plan divide by (`quantization.peak_flops`) is the row's bf16 peak, and an int8 run's
    is the mix of the row's int8 and bf16 peaks; no peak (CPU) stays none."""
    chip = devices.by_kind(kind)
    for mode, low in (("none", None), ("int8", chip.peak_int8)):
        cfg = loading.complete(config.finalize(config.parse(["configs/base.yml", f"quantization={mode}"]), 8, kind))
        share = quantization.quantized_share(cfg.model)
        assert quantization.peak_flops(cfg) == perf.mixed_peak(chip.peak_bf16, low, share)
