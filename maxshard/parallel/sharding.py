"""Logical axis names -> PartitionSpecs, validated; shardings of whole pytrees; a layout report.

Resolution follows Flax's rule semantics (`nn.logical_to_mesh_axes`, called in `mesh_axes` only): rules are tried in
table order and a rule applies only if none of its mesh axes is already used by the same array, so a repeated name is
a fallback, and the axes a name gets depend on the other names of its array. Every module that asks which mesh axes a
logical name gets (the layers, the pipeline check, the planner) asks `mesh_axes` with the whole array, so they all
see the layout the program compiles. On top of Flax this module refuses what Flax does silently: a logical name with
no rule at all (Flax would replicate it) and a dimension whose size does not divide by its shard count (XLA would pad
it). Both fail before compiling, with a message that names the parameter, the dimension and the mesh axes.

Functions take `mesh_sizes` ({axis: size}) rather than a Mesh where they can, so tools can plan layouts for
hardware that is not attached.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxshard.errors import ConfigError

__all__ = [
    "FlaxRules",
    "MeshAxes",
    "flax_rules",
    "mesh_axes",
    "axes_of",
    "partition_spec",
    "active_mesh_sizes",
    "active_mesh_axes",
    "logical_to_spec",
    "tree_specs",
    "tree_shardings",
    "constrain",
    "ParamLayout",
    "layout",
    "path_name",
]

FlaxRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]
MeshAxes = tuple[str, ...]  # the mesh axes of one array dimension, in rule order; () is replicated


class HasRules(Protocol):
    """What `flax_rules` reads of a run config (a Protocol, so the layers below never import the config)."""

    logical_axis_rules: tuple[tuple[str, tuple[str, ...]], ...]


def flax_rules(cfg: HasRules) -> FlaxRules:
    """The config's rules in the form Flax takes: an empty mesh-axis list means replicated (None)."""
    return tuple((name, axes if axes else None) for name, axes in cfg.logical_axis_rules)


def as_axes(entry: str | tuple[str, ...] | None) -> MeshAxes:
    """A PartitionSpec entry or a rule's mesh axes as a tuple: None -> (), "x" -> ("x",)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def mesh_axes(
    logical_axes: Sequence[str | None], rules: FlaxRules, mesh_sizes: Mapping[str, int] | None = None
) -> tuple[MeshAxes, ...]:
    """The mesh axes of each dimension of one array whose dimensions are named `logical_axes`.

    The one place that resolves rules, with Flax's own function, so every caller gets the layout the program
    compiles: a rule applies only while all its mesh axes are free in this array, so ask with the array's whole
    set of names, never one name alone. With `mesh_sizes`, axes of size 1 (or not in the mesh) are left out of
    the answer; they still count as taken while resolving, as they do in Flax. A name without a rule gets ()
    (`logical_to_spec` refuses it); a name twice in the array is a ValueError (Flax's).
    """
    dims = tuple(as_axes(entry) for entry in nn.logical_to_mesh_axes(tuple(logical_axes), rules))
    if mesh_sizes is None:
        return dims
    return tuple(tuple(a for a in d if mesh_sizes.get(a, 1) > 1) for d in dims)


def axes_of(
    logical: str, array: Sequence[str | None], rules: FlaxRules, mesh_sizes: Mapping[str, int] | None = None
) -> MeshAxes:
    """The mesh axes of the dimension named `logical` in an array named `array` (`mesh_axes`: the neighbours
    matter). `logical` must be one of `array`'s names (ValueError otherwise)."""
    return mesh_axes(array, rules, mesh_sizes)[list(array).index(logical)]


def partition_spec(dims: Sequence[MeshAxes]) -> PartitionSpec:
    """The PartitionSpec of `mesh_axes`'s answer (the one Flax would build: () and None, ("x",) and "x" are equal)."""
    return PartitionSpec(*(d if d else None for d in dims))


def active_mesh_sizes() -> dict[str, int]:
    """{axis: size} of the mesh in context (`jax.set_mesh`); {} outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty else dict(mesh.shape)


def active_mesh_axes(logical_axes: Sequence[str | None]) -> tuple[MeshAxes, ...]:
    """`mesh_axes` under the rules and the mesh in context, axes of size 1 left out: how a layer's constraint with
    these names splits its array. () for every dimension outside rules or a mesh (a plain call, init)."""
    rules, sizes = nn.get_logical_axis_rules(), active_mesh_sizes()
    if not rules or not sizes:
        return ((),) * len(logical_axes)
    return mesh_axes(logical_axes, rules, sizes)


def _shard_count(entry: str | tuple[str, ...] | None, mesh_sizes: Mapping[str, int]) -> int:
    return math.prod(mesh_sizes[a] for a in as_axes(entry))


def _entry_text(entry: str | tuple[str, ...], mesh_sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{a}={mesh_sizes[a]}" for a in as_axes(entry))


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: FlaxRules,
    mesh_sizes: Mapping[str, int] | None = None,
    shape: Sequence[int] | None = None,
    name: str = "array",
) -> PartitionSpec:
    """PartitionSpec for one array (`mesh_axes`); raises ConfigError for unknown names, reused mesh axes,
    non-dividing dims."""
    known = {rule_name for rule_name, _ in rules}
    for axis_name in logical_axes:
        if isinstance(axis_name, str) and axis_name not in known:
            raise ConfigError(f"{name}: logical axis {axis_name!r} has no rule in logical_axis_rules")
    try:
        dims = mesh_axes(logical_axes, rules)
    except ValueError as e:  # a logical name used twice in one array
        raise ConfigError(f"{name}: {e}") from None
    spec = partition_spec(dims)
    used = [a for axes in dims for a in axes]
    if len(used) != len(set(used)):
        raise ConfigError(f"{name}: a mesh axis is used twice in {spec}")
    if mesh_sizes is not None and shape is not None:
        for dim, (size, axes, logical) in enumerate(zip(shape, dims, logical_axes)):
            count = _shard_count(axes, mesh_sizes)
            if size % count:
                raise ConfigError(
                    f"{name}: dimension {dim} ({logical}) of size {size} is not divisible by "
                    f"{count} ({_entry_text(axes, mesh_sizes)})"
                )
    return spec


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def path_name(path: tuple) -> str:
    """'params/decoder/layers/mlp/wi/kernel' from a pytree key path."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return "/".join(parts)


def tree_specs(abstract: Any, rules: FlaxRules, mesh_sizes: Mapping[str, int]) -> Any:
    """PartitionSpec for every leaf of a tree boxed with `nn.Partitioned` (unboxed leaves are replicated).

    The result has the structure of the *unboxed* tree, ready for `jax.jit(out_shardings=...)`.
    """

    def spec(path: tuple, leaf: Any) -> PartitionSpec:
        if _is_box(leaf):
            return logical_to_spec(leaf.names, rules, mesh_sizes, leaf.value.shape, path_name(path))
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec, abstract, is_leaf=_is_box)


def tree_shardings(abstract: Any, mesh: Mesh, rules: FlaxRules) -> Any:
    """NamedSharding for every leaf of a boxed abstract tree (see `tree_specs`)."""
    specs = tree_specs(abstract, rules, dict(mesh.shape))
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`nn.with_logical_constraint` that refuses logical names the active rules do not know.

    Flax would silently leave such a dimension unconstrained; here a typo in a layer is an error.
    """
    rules = nn.get_logical_axis_rules()
    if rules:
        known = {name for name, _ in rules}
        unknown = [a for a in logical_axes if isinstance(a, str) and a not in known]
        if unknown:
            raise ConfigError(f"activation logical axis {unknown[0]!r} has no rule in logical_axis_rules")
    return nn.with_logical_constraint(x, tuple(logical_axes))


# --------------------------------------------------------------------------------------------- layout report


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """How one array is laid out over the mesh."""

    name: str
    logical_axes: tuple[str | None, ...]
    spec: PartitionSpec
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    bytes_per_device: int
    replication: int  # how many devices hold each element

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "logical_axes": list(self.logical_axes),
            "spec": [list(e) if isinstance(e, tuple) else e for e in self.spec],
            "global_shape": list(self.global_shape),
            "local_shape": list(self.local_shape),
            "dtype": self.dtype,
            "bytes_per_device": self.bytes_per_device,
            "replication": self.replication,
        }


def array_layout(
    name: str,
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    dtype: Any,
    rules: FlaxRules,
    mesh_sizes: Mapping[str, int],
) -> ParamLayout:
    """Layout of one array of `shape` named by `logical_axes`."""
    spec = logical_to_spec(logical_axes, rules, mesh_sizes, shape, name)
    counts = [_shard_count(e, mesh_sizes) for e in spec] + [1] * (len(shape) - len(spec))
    local = tuple(size // count for size, count in zip(shape, counts))
    itemsize = np.dtype(dtype).itemsize
    return ParamLayout(
        name=name,
        logical_axes=tuple(logical_axes),
        spec=spec,
        global_shape=tuple(shape),
        local_shape=local,
        dtype=np.dtype(dtype).name,
        bytes_per_device=math.prod(local) * itemsize,
        replication=math.prod(mesh_sizes.values()) // math.prod(counts),
    )


def layout(abstract: Any, rules: FlaxRules, mesh_sizes: Mapping[str, int]) -> list[ParamLayout]:
    """One ParamLayout per leaf of a boxed abstract tree (from `jax.eval_shape` of a Linen init)."""
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract, is_leaf=_is_box)[0]:
        names = leaf.names if _is_box(leaf) else (None,) * len(leaf.shape)
        value = leaf.value if _is_box(leaf) else leaf
        rows.append(array_layout(path_name(path), names, value.shape, value.dtype, rules, mesh_sizes))
    return rows
