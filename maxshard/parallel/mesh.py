"""ici/dcn parallelism knobs -> a hybrid multi-slice `jax.sharding.Mesh`.

Each mesh axis has a size inside a slice (`ici_<axis>_parallelism`, fast interconnect) and a size across slices
(`dcn_<axis>_parallelism`, data-center network); the mesh axis is their product. Devices are laid out slice-major:
along every axis, index = dcn_index * ici_size + ici_index, so an axis with dcn > 1 crosses slices and an axis with
dcn == 1 stays inside one. Example, 8 devices, `num_slices=2 dcn_data_parallelism=2 ici_fsdp_parallelism=4`:

    mesh (data=2, fsdp=4):   data 0 -> slice 0: devices 0 1 2 3
                             data 1 -> slice 1: devices 4 5 6 7

Shapes are resolved from the config alone (`axis_sizes`), so tools can plan for hardware they do not have.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from maxshard.config import MESH_AXES, Config, knob_name
from maxshard.errors import ConfigError

__all__ = ["MeshShape", "resolve_shape", "axis_sizes", "build", "device_slices", "describe"]


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Resolved sizes (no -1 left) of every mesh axis inside a slice (`ici`) and across slices (`dcn`)."""

    ici: tuple[int, ...]
    dcn: tuple[int, ...]

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: i * d for axis, i, d in zip(MESH_AXES, self.ici, self.dcn)}


def _fill(cfg: Config, family: str, total: int, unit: str) -> tuple[int, ...]:
    """Replaces the one -1 of a knob family with what is left of `total`; checks the product."""
    values = [cfg.parallelism(family, axis) for axis in MESH_AXES]
    fills = [knob_name(family, a) for a, v in zip(MESH_AXES, values) if v == -1]
    set_knobs = ", ".join(f"{knob_name(family, a)}={v}" for a, v in zip(MESH_AXES, values) if v not in (1, -1))
    set_knobs = f" ({set_knobs})" if set_knobs else ""
    if len(fills) > 1:
        raise ConfigError(f"only one {family} knob may be -1, got {', '.join(fills)}")
    known = math.prod(v for v in values if v != -1)
    if fills:
        if total % known:
            raise ConfigError(f"{family} parallelism product {known}{set_knobs} does not divide {total} {unit}")
        values = [total // known if v == -1 else v for v in values]
    elif known != total:
        raise ConfigError(f"{family} parallelism product {known}{set_knobs} does not equal {total} {unit}")
    return tuple(values)


def resolve_shape(cfg: Config, num_devices: int | None = None, num_slices: int | None = None) -> MeshShape:
    """Fills the -1 knobs for `num_devices` over `num_slices` (default: the config's own)."""
    num_devices = cfg.num_devices if num_devices is None else num_devices
    num_slices = cfg.num_slices if num_slices is None else num_slices
    if num_devices <= 0:
        raise ConfigError("the device count is unknown: finalize the config first")
    if num_devices % num_slices:
        raise ConfigError(f"num_slices={num_slices} does not divide {num_devices} devices")
    ici = _fill(cfg, "ici", num_devices // num_slices, "devices per slice")
    dcn = _fill(cfg, "dcn", num_slices, "slices (num_slices)")
    return MeshShape(ici=ici, dcn=dcn)


def axis_sizes(cfg: Config, num_devices: int | None = None, num_slices: int | None = None) -> dict[str, int]:
    """{mesh axis: size} without touching devices: what tools and validation need."""
    return resolve_shape(cfg, num_devices, num_slices).sizes


def _slice_key(devices: list[jax.Device], num_slices: int) -> Any:
    """How to tell a device's slice: `slice_index` when it separates slices, else the process, else the position.

    Multi-process CPU runs report `slice_index == 0` everywhere, so one distinct value means "not informative".
    """
    slice_ids = {getattr(d, "slice_index", None) for d in devices} - {None}
    if len(slice_ids) > 1:
        return lambda d: d.slice_index
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1:
        if len(processes) % num_slices:
            raise ConfigError(f"num_slices={num_slices} does not divide {len(processes)} processes")
        per_slice = len(processes) // num_slices
        return lambda d: processes.index(d.process_index) // per_slice
    position = {d.id: i for i, d in enumerate(devices)}
    return lambda d: position[d.id] // (len(devices) // num_slices)


def device_slices(devices: Sequence[jax.Device], num_slices: int) -> list[list[jax.Device]]:
    """Groups devices into slices: by `slice_index` on multi-slice hardware, else by process, else evenly by id."""
    devices = sorted(devices, key=lambda d: (getattr(d, "slice_index", 0) or 0, d.process_index, d.id))
    key = _slice_key(devices, num_slices)
    groups: dict[int, list[jax.Device]] = {}
    for d in devices:
        groups.setdefault(key(d), []).append(d)
    if len(groups) != num_slices:
        raise ConfigError(f"num_slices={num_slices} but the devices form {len(groups)} slices")
    return [groups[k] for k in sorted(groups)]


def _slice_array(devices: list[jax.Device], ici: tuple[int, ...]) -> np.ndarray:
    """One slice's devices in the ici shape; topology-aware on TPU/GPU, a plain reshape on CPU."""
    if devices[0].platform == "cpu":
        return np.array(devices, dtype=object).reshape(ici)
    return mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)


def arrange(slices: list[list[jax.Device]], shape: MeshShape) -> np.ndarray:
    """Slice-major device array: slice s sits at dcn coordinates unravel(s, dcn); axes interleave (dcn, ici)."""
    per_slice = np.stack([_slice_array(s, shape.ici) for s in slices])  # [slices, *ici]
    n = len(MESH_AXES)
    blocks = per_slice.reshape(shape.dcn + shape.ici)  # [*dcn, *ici]
    order = [ax for i in range(n) for ax in (i, n + i)]  # dcn_0, ici_0, dcn_1, ici_1, ...
    return blocks.transpose(order).reshape(tuple(shape.sizes.values()))


def build(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The training mesh, with Auto axis types: under Explicit axes (`jax.make_mesh`'s default) Linen's
    `nn.with_logical_constraint` fails, so logical constraints would not apply."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_shape(cfg, len(devices))
    array = arrange(device_slices(devices, cfg.num_slices), shape)
    return Mesh(array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe(sizes: dict[str, int] | Mesh) -> str:
    """'fsdp=4 tensor=2' (axes of size 1 left out), for logs and errors."""
    if isinstance(sizes, Mesh):
        sizes = dict(sizes.shape)
    shown = [f"{axis}={size}" for axis, size in sizes.items() if size > 1]
    return " ".join(shown) or "single device"
