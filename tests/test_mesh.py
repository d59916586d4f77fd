"""The physical mesh: -1 fill, validation messages, and where each device lands for single- and multi-slice layouts.

Device placement is checked by device id on the 8 simulated CPU devices; on CPU, `num_slices` groups devices in id
order (slice s = ids s*k .. s*k + k - 1), so a DCN-sharded axis must step across those groups and an ICI-sharded
axis must stay inside one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from maxshard import config
from maxshard.config import MESH_AXES, Config
from maxshard.errors import ConfigError
from maxshard.parallel import mesh

BASE = str(Path(__file__).resolve().parent.parent / "configs" / "base.yml")


def cfg_for(*overrides: str, num_devices: int = 8) -> Config:
    return config.load([BASE, *overrides], num_devices=num_devices)


def shown(sizes: dict[str, int]) -> dict[str, int]:
    """Only the axes that split something."""
    return {axis: size for axis, size in sizes.items() if size > 1}


def device_ids(m: jax.sharding.Mesh) -> np.ndarray:
    """Device ids in the mesh's shape with the size-1 axes squeezed out (axes in MESH_AXES order)."""
    ids = np.vectorize(lambda d: d.id)(m.devices)
    return ids.reshape([s for s in ids.shape if s > 1])


# --------------------------------------------------------------------------------------------- shapes


def test_default_fills_fsdp_with_every_device() -> None:
    cfg = cfg_for()
    assert shown(mesh.axis_sizes(cfg)) == {"fsdp": 8}
    shape = mesh.resolve_shape(cfg)
    assert shape.ici[MESH_AXES.index("fsdp")] == 8 and shape.dcn == (1,) * len(MESH_AXES)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["ici_tensor_parallelism=2"], {"fsdp": 4, "tensor": 2}),
        (["ici_data_parallelism=2", "ici_sequence_parallelism=2"], {"data": 2, "fsdp": 2, "sequence": 2}),
        (["ici_fsdp_parallelism=1", "ici_tensor_parallelism=-1"], {"tensor": 8}),
        (["num_slices=2"], {"data": 2, "fsdp": 4}),  # dcn_data_parallelism=-1 fills the slices
        (["num_slices=2", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2"], {"fsdp": 8}),
        (["num_slices=4", "ici_tensor_parallelism=2"], {"data": 4, "tensor": 2}),
    ],
)
def test_fill_resolves_sizes(overrides: list[str], expected: dict[str, int]) -> None:
    sizes = mesh.axis_sizes(cfg_for(*overrides))
    assert list(sizes) == list(MESH_AXES)
    assert shown(sizes) == expected


def test_axis_sizes_plans_for_devices_that_do_not_exist() -> None:
    cfg = cfg_for("ici_tensor_parallelism=4", "num_slices=2", num_devices=512)
    assert shown(mesh.axis_sizes(cfg)) == {"data": 2, "fsdp": 64, "tensor": 4}
    assert shown(mesh.axis_sizes(cfg, num_devices=16, num_slices=1)) == {"fsdp": 4, "tensor": 4}


ICI_EQUAL = "does not equal 8 devices per slice"
SHAPE_ERRORS = [
    (["ici_fsdp_parallelism=3"], f"ici parallelism product 3 (ici_fsdp_parallelism=3) {ICI_EQUAL}"),
    (["ici_tensor_parallelism=3"], "ici parallelism product 3 (ici_tensor_parallelism=3) does not divide 8 devices"),
    (["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
     f"ici parallelism product 4 (ici_fsdp_parallelism=2, ici_tensor_parallelism=2) {ICI_EQUAL}"),
    (["ici_data_parallelism=-1"], "only one ici knob may be -1, got ici_data_parallelism, ici_fsdp_parallelism"),
    (["dcn_fsdp_parallelism=-1"], "only one dcn knob may be -1, got dcn_data_parallelism, dcn_fsdp_parallelism"),
    (["num_slices=3"], "num_slices=3 does not divide 8 devices"),
    (["num_slices=2", "dcn_data_parallelism=1"], "dcn parallelism product 1 does not equal 2 slices (num_slices)"),
    (["num_slices=2", "dcn_data_parallelism=4"],
     "dcn parallelism product 4 (dcn_data_parallelism=4) does not equal 2 slices"),
]


@pytest.mark.parametrize(("overrides", "message"), SHAPE_ERRORS)
def test_shape_errors_name_the_knobs(overrides: list[str], message: str) -> None:
    cfg = cfg_for(*overrides)
    with pytest.raises(ConfigError) as info:
        mesh.axis_sizes(cfg)
    assert str(info.value).startswith(message)


def test_unfinalized_config_has_no_device_count() -> None:
    with pytest.raises(ConfigError, match="finalize the config first"):
        mesh.axis_sizes(config.parse([BASE]))


# --------------------------------------------------------------------------------------------- device placement


def test_single_slice_fsdp4_tensor2_is_row_major() -> None:
    m = mesh.build(cfg_for("ici_tensor_parallelism=2"))
    assert m.axis_names == MESH_AXES
    assert dict(m.shape)["fsdp"] == 4 and dict(m.shape)["tensor"] == 2
    np.testing.assert_array_equal(device_ids(m), np.arange(8).reshape(4, 2))  # tensor pairs are neighbours


def test_two_slices_data_across_slices_fsdp_inside() -> None:
    m = mesh.build(cfg_for("num_slices=2", "dcn_data_parallelism=2", "ici_fsdp_parallelism=4"))
    assert mesh.describe(m) == "data=2 fsdp=4"
    np.testing.assert_array_equal(device_ids(m), [[0, 1, 2, 3], [4, 5, 6, 7]])  # data 0 = slice 0, data 1 = slice 1


def test_two_slices_fsdp_across_slices() -> None:
    overrides = ["num_slices=2", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2",
                 "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]
    m = mesh.build(cfg_for(*overrides))
    assert mesh.describe(m) == "fsdp=4 tensor=2"
    ids = device_ids(m)  # [fsdp, tensor]; fsdp index = dcn * 2 + ici
    np.testing.assert_array_equal(ids, [[0, 1], [2, 3], [4, 5], [6, 7]])
    assert set(ids[:2].ravel()) == {0, 1, 2, 3}  # the first half of fsdp is slice 0
    for row in ids:  # a tensor group never crosses a slice
        assert len({d // 4 for d in row}) == 1


def test_four_slices() -> None:
    m = mesh.build(cfg_for("num_slices=4"))
    assert mesh.describe(m) == "data=4 fsdp=2"
    np.testing.assert_array_equal(device_ids(m), [[0, 1], [2, 3], [4, 5], [6, 7]])


def test_four_slices_split_over_two_dcn_axes() -> None:
    overrides = ["num_slices=4", "dcn_data_parallelism=2", "dcn_fsdp_parallelism=2", "ici_fsdp_parallelism=2"]
    m = mesh.build(cfg_for(*overrides))
    ids = device_ids(m)  # [data=2, fsdp=4]; slice s at dcn (s // 2, s % 2); fsdp index = dcn_fsdp * 2 + ici
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3], [4, 5, 6, 7]])
    for data_row in ids:
        assert [d // 2 for d in data_row] == [data_row[0] // 2] * 2 + [data_row[0] // 2 + 1] * 2


def test_mesh_axis_types_are_auto() -> None:
    m = mesh.build(cfg_for("ici_tensor_parallelism=2"))
    assert tuple(m.axis_types) == (AxisType.Auto,) * len(MESH_AXES)


def test_build_on_a_subset_of_devices() -> None:
    cfg = cfg_for("ici_tensor_parallelism=2", num_devices=4)
    m = mesh.build(cfg, jax.devices()[4:])
    np.testing.assert_array_equal(device_ids(m), [[4, 5], [6, 7]])


# --------------------------------------------------------------------------------------------- slices from devices


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int = 0
    slice_index: int | None = None
    platform: str = "cpu"


def test_device_slices_by_slice_index() -> None:
    devices = [FakeDevice(i, slice_index=i % 2) for i in range(8)]  # slices interleaved by id
    slices = mesh.device_slices(devices, 2)
    assert [[d.id for d in s] for s in slices] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_device_slices_by_process() -> None:
    devices = [FakeDevice(i, process_index=i // 2) for i in reversed(range(8))]  # 4 processes, 2 per slice
    slices = mesh.device_slices(devices, 2)
    assert [[d.id for d in s] for s in slices] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match="num_slices=3 does not divide 4 processes"):
        mesh.device_slices(devices, 3)


def test_device_slices_count_must_match() -> None:
    devices = [FakeDevice(i, slice_index=i % 4) for i in range(8)]
    with pytest.raises(ConfigError, match="num_slices=2 but the devices form 4 slices"):
        mesh.device_slices(devices, 2)


def test_arrange_puts_dcn_outside_ici_along_each_axis() -> None:
    devices = [FakeDevice(i, slice_index=i // 4) for i in range(8)]
    shape = mesh.resolve_shape(cfg_for("num_slices=2", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2"))
    array = mesh.arrange(mesh.device_slices(devices, 2), shape)
    ids = np.vectorize(lambda d: d.id)(array).reshape(-1)
    np.testing.assert_array_equal(ids, np.arange(8))  # fsdp=8: slice 0 first, then slice 1


# --------------------------------------------------------------------------------------------- describe


def test_describe() -> None:
    assert mesh.describe({"data": 1, "fsdp": 4, "tensor": 2}) == "fsdp=4 tensor=2"
    assert mesh.describe({axis: 1 for axis in MESH_AXES}) == "single device"
    assert mesh.describe(mesh.build(cfg_for("ici_data_parallelism=2", "ici_fsdp_parallelism=4"))) == "data=2 fsdp=4"
