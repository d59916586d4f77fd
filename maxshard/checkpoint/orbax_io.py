"""Converted parameters as an orbax checkpoint step directory, written and read one slice at a time.

Orbax saves a whole pytree of in-memory arrays at once, which for a converted model means holding all of it. So
the step directory is written in two passes:

1. orbax (`PyTreeCheckpointHandler`, no OCDBT) writes `state/` for a tree {"step", "params"} whose leaves are
   one-element placeholders of the right rank and dtype: this gives the tree metadata and the commit marker that
   orbax's own restore expects, with orbax choosing where each array lives.
2. every parameter array is then recreated at its full shape in that same place (tensorstore, zarr, zstd as orbax
   uses) with chunks of one layer and at most `CHUNK_BYTES`, and filled one chunk-aligned block of rows at a time.

Orbax restores arrays from what the zarr metadata says (shape, dtype, chunks), so `load_parameters_path` and any
sharding read it like a checkpoint of their own. Reading goes through the same tensorstore specs (OCDBT or not,
whatever wrote the checkpoint), one layer's slice at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from maxshard.checkpoint.format import STATE

__all__ = ["CHUNK_BYTES", "Leaf", "write_skeleton", "rows_per_chunk", "chunk_shape", "create_array", "write_rows",
           "Reader"]

CHUNK_BYTES = 4 * 2**20  # per zarr chunk = one block of rows read, rearranged and written at a time
# One context for every array opened here, as orbax builds it: no data cache, a B-tree node cache for OCDBT.
_CONTEXT = ocp.type_handlers.get_ts_context(use_ocdbt=True)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter array: its path under params, full shape, dtype, how many leading layer dims it has, and the
    dim (counted after those) that is written in blocks of rows."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    layer_dims: int = 0
    row_axis: int = 0

    @property
    def name(self) -> str:
        """Orbax's name for the array: the tree keys joined with dots."""
        return ".".join(("params", *self.path))


def _nest(leaves: list[Leaf]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for leaf in leaves:
        node = tree
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        node[leaf.path[-1]] = np.zeros((1,) * len(leaf.shape), leaf.dtype)
    return tree


def write_skeleton(state_dir: epath.Path, leaves: list[Leaf]) -> None:
    """Pass 1: orbax writes the TrainState-shaped tree {"step", "params"} with placeholders (no optimizer state:
    `load_parameters_path` restores only params)."""
    tree = {"step": np.zeros((), np.int32), "params": _nest(leaves)}
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(state_dir, args=ocp.args.PyTreeSave(tree))


def _spec(state_dir: epath.Path, name: str, use_ocdbt: bool, use_zarr3: bool) -> dict[str, Any]:
    info = ocp.type_handlers.ParamInfo(name=name, parent_dir=epath.Path(state_dir), use_zarr3=use_zarr3,
                                       ts_context=_CONTEXT)
    return ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)


def rows_per_chunk(leaf: Leaf) -> int:
    """Rows along the row axis that fit in CHUNK_BYTES (at least one)."""
    layer_shape = leaf.shape[leaf.layer_dims :]
    row_bytes = math.prod(layer_shape) // max(layer_shape[leaf.row_axis], 1) * leaf.dtype.itemsize
    return max(1, min(layer_shape[leaf.row_axis], CHUNK_BYTES // max(row_bytes, 1)))


def chunk_shape(leaf: Leaf) -> tuple[int, ...]:
    """One layer per chunk, and as many rows along the row axis as fit in CHUNK_BYTES: a block of rows that
    `write_rows` writes is whole chunks, so tensorstore never reads back or buffers more than that block."""
    shape = list(leaf.shape)
    shape[: leaf.layer_dims] = [1] * leaf.layer_dims
    shape[leaf.layer_dims + leaf.row_axis] = rows_per_chunk(leaf)
    return tuple(shape)


def create_array(state_dir: epath.Path, leaf: Leaf) -> ts.TensorStore:
    """Pass 2: replaces the placeholder with the full-size array (same place, same codec as orbax's)."""
    if not (epath.Path(state_dir) / leaf.name).exists():
        raise RuntimeError(f"orbax did not write {leaf.name} where expected in {state_dir}")
    spec = _spec(state_dir, leaf.name, use_ocdbt=False, use_zarr3=False)
    spec["dtype"] = leaf.dtype.name
    spec["metadata"] = {"shape": list(leaf.shape), "chunks": list(chunk_shape(leaf)),
                        "compressor": {"id": "zstd", "level": 1}}
    return ts.open(spec, create=True, delete_existing=True, context=_CONTEXT).result()


def write_rows(store: ts.TensorStore, leaf: Leaf, index: tuple[int, ...], start: int, block: np.ndarray) -> None:
    """Writes `block` (one layer's rows [start, start + n) along the row axis) at layer `index`."""
    n = block.shape[leaf.row_axis]
    window = index + (slice(None),) * leaf.row_axis + (slice(start, start + n),)
    store[window].write(block).result()


class Reader:
    """Reads slices of the parameter arrays of a checkpoint's `state/`, whichever orbax format wrote it."""

    def __init__(self, step_dir: str) -> None:
        local = "://" not in str(step_dir)  # orbax's OCDBT reader takes absolute paths only (a trainer's checkpoint)
        self.state_dir = epath.Path(os.path.abspath(step_dir) if local else step_dir) / STATE
        metadata_file = self.state_dir / "_METADATA"
        meta = json.loads(metadata_file.read_text()) if metadata_file.exists() else {}
        self.use_zarr3 = bool(meta.get("use_zarr3", False))
        self.use_ocdbt = (self.state_dir / "manifest.ocdbt").exists()
        tree = ocp.PyTreeCheckpointHandler().metadata(self.state_dir).tree
        self.arrays = dict(_flatten(tree.get("params", {}), ()))
        self._open: dict[tuple[str, ...], ts.TensorStore] = {}

    def read(self, path: tuple[str, ...], index: tuple[int, ...] = ()) -> np.ndarray:
        """params/<path>[index] as numpy: one layer's slice of a stacked array, or the whole array."""
        if path not in self._open:
            spec = _spec(self.state_dir, ".".join(("params", *path)), self.use_ocdbt, self.use_zarr3)
            self._open[path] = ts.open(spec, open=True, read=True, context=_CONTEXT).result()
        return self._open[path][index].read().result()


def _flatten(tree: Any, prefix: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, array metadata) of every leaf of a nested dict of orbax metadata."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, (*prefix, str(key)))
    else:
        yield prefix, tree
