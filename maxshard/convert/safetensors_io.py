"""The safetensors format, read and written one tensor at a time with plain file reads and writes.

A file is: 8 bytes (little-endian u64) header length N, N bytes of JSON
`{name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the tensors'
raw little-endian bytes, offsets counted from the end of the header. A sharded checkpoint adds
`model.safetensors.index.json` with a `weight_map` {name: file}.

Why not `safetensors.safe_open` here: it memory-maps the whole file, and every page read through the map stays
resident in the process until the file is closed, so reading a model through one handle grows resident memory to
the size of the model (measured: 234 MB peak for a 192 MB file of 16 MB tensors), and reopening it per tensor still
costs twice the tensor (the copy plus the mapped pages, 58 MB). `readinto` a fresh numpy buffer costs exactly the
tensor. The `safetensors` package stays a test dependency that cross-checks these files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import sys
from collections.abc import Callable, Iterable
from typing import Any

import ml_dtypes
import numpy as np

from maxshard.config import ConfigError

__all__ = ["TensorInfo", "TensorSpec", "read_header", "index", "read", "parse_size", "write_checkpoint", "DTYPES"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}

if sys.byteorder != "little":  # bfloat16 has no byte-swapped numpy dtype; every supported host is little-endian
    raise ImportError("maxshard.convert reads safetensors on little-endian hosts only")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: file, absolute byte offset, dtype and shape."""

    file: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: name, shape, dtype (its bytes come later, from a callback)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def read_header(path: str) -> dict[str, TensorInfo]:
    """{name: TensorInfo} of one .safetensors file; reads only its header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ConfigError(f"{path} is not a safetensors file (bad header: {e})") from None
    start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise ConfigError(f"{path}: tensor {name} has dtype {entry['dtype']}, which maxshard does not read")
        begin, end = entry["data_offsets"]
        info = TensorInfo(path, start + begin, DTYPES[entry["dtype"]], tuple(entry["shape"]))
        if info.nbytes != end - begin:
            raise ConfigError(f"{path}: tensor {name} has {end - begin} bytes for shape {info.shape}")
        tensors[name] = info
    return tensors


def index(directory: str) -> dict[str, TensorInfo]:
    """Every tensor of a Hugging Face checkpoint directory: `model.safetensors`, or the files its index names."""
    index_path = os.path.join(directory, INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(directory, SINGLE)):
        weight_map, files = None, [SINGLE]
    else:
        raise ConfigError(f"{directory} has neither {SINGLE} nor {INDEX} (only safetensors checkpoints are read)")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        tensors.update(read_header(os.path.join(directory, name)))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ConfigError(f"{INDEX} lists {missing[0]}, which none of its files holds")
    return tensors


def read(info: TensorInfo, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows [start, stop) of the tensor (all by default) as a fresh numpy array; memory: exactly their bytes.
    Rows are contiguous in the file (row-major), so a block of rows is one read."""
    shape = info.shape or (1,)  # a scalar reads as one row
    stop = shape[0] if stop is None else stop
    row_bytes = info.nbytes // shape[0] if shape[0] else 0
    out = np.empty((stop - start, *shape[1:]), info.dtype)
    with open(info.file, "rb") as f:
        f.seek(info.offset + start * row_bytes)
        got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != out.nbytes:
        raise ConfigError(f"{info.file} is truncated: tensor rows need {out.nbytes} bytes, got {got}")
    return out if info.shape else out.reshape(())


def _write_tensor(f: Any, spec: TensorSpec, blocks: Iterable[np.ndarray]) -> None:
    """Appends one tensor's bytes from its row blocks, checking that they add up to the planned shape."""
    rows = 0
    for block in blocks:
        block = np.ascontiguousarray(block, dtype=spec.dtype)
        if block.shape[1:] != spec.shape[1:]:
            raise ValueError(f"{spec.name}: a block of shape {block.shape} does not fit {spec.shape}")
        f.write(memoryview(block.reshape(-1).view(np.uint8)))
        rows += block.shape[0] if block.ndim else 1
    if rows != (spec.shape[0] if spec.shape else 1):
        raise ValueError(f"{spec.name}: produced {rows} rows, planned {spec.shape}")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' (decimal, as Hugging Face counts), '500MiB', '1000' (bytes) -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ConfigError(f"--max-shard-size={text!r} is not a size like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _plan_shards(specs: list[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors grouped into files of at most `max_bytes` (a larger tensor gets a file of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: Iterable[TensorSpec]) -> bytes:
    """The JSON header, padded with spaces to a multiple of 8 bytes as the reference writer does."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        entries[spec.name] = {"dtype": _CODES[spec.dtype], "shape": list(spec.shape),
                              "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def write_checkpoint(directory: str, specs: list[TensorSpec], produce: Callable[[TensorSpec], Iterable[np.ndarray]],
                     max_shard_bytes: int) -> list[str]:
    """Writes the tensors as `model.safetensors`, or as numbered shards plus the index when they exceed
    `max_shard_bytes`. `produce(spec)` yields the tensor as consecutive blocks of rows (or whole), so memory stays
    at one block."""
    shards = _plan_shards(specs, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    for name, shard in zip(names, shards):
        header = _header(shard)
        with open(os.path.join(directory, name), "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for spec in shard:
                _write_tensor(f, spec, produce(spec))
    if len(shards) > 1:
        weight_map = {spec.name: name for name, shard in zip(names, shards) for spec in shard}
        total = sum(spec.nbytes for spec in specs)
        with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.write("\n")
    return names
