"""Hugging Face safetensors checkpoints through the `safetensors` package: a directory read a block of rows at a
time, written one shard at a time.

A checkpoint is `model.safetensors`, or numbered shards plus `model.safetensors.index.json` whose `weight_map` says
which file holds each tensor. The package reads and writes the files; this module only adds what lies around them:
the directory (single file or index), the grouping of tensors into shards under `--max-shard-size`, and the index.

Reading: `safe_open(file, framework="numpy")`, one handle per file for the whole conversion, `get_slice(name)[a:b]`
for a block of rows. The package memory-maps the file and copies the block into a fresh array, so the process holds
one block of anonymous memory; the mapped pages it touched stay resident as file-backed page cache (RssFile) until
the handle closes, which the kernel drops under pressure and never needs swap for (benchmarks/convert_memory.py
measures the two apart).
Writing: `safetensors.numpy.save_file` of one shard's tensors, assembled in memory: the peak is one shard,
i.e. at most `--max-shard-size` or the largest tensor when that is larger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from maxshard.convert import mxfp4
from maxshard.errors import ConfigError

__all__ = ["TensorInfo", "TensorSpec", "Source", "parse_size", "write_checkpoint", "DTYPES", "INDEX", "SINGLE"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
METADATA = {"format": "pt"}  # what transformers writes, and checks for, in every file's header
# safetensors' dtype names (get_slice().get_dtype()) -> numpy, for the dtypes a converted checkpoint holds:
# the orbax arrays are created with the right dtype before any data is read.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of the source: its file, name, dtype and shape (from the header; no data read)."""

    file: str
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    mxfp4: tuple[TensorInfo, TensorInfo] | None = None  # (blocks, scales) of an MXFP4 tensor read dequantized


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: name, shape, dtype (its bytes come later, from a callback)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _files(directory: str) -> tuple[list[str], dict[str, str] | None]:
    """(safetensors file names, the index's weight_map or None for a single file)."""
    index_path = os.path.join(directory, INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values())), weight_map
    if os.path.isfile(os.path.join(directory, SINGLE)):
        return [SINGLE], None
    raise ConfigError(f"{directory} has neither {SINGLE} nor {INDEX} (only safetensors checkpoints are read)")


class Source:
    """Every tensor of a Hugging Face checkpoint directory (`tensors`: {name: TensorInfo}), and their rows.

    A context manager: the files stay open (one `safe_open` handle each) until it exits."""

    def __init__(self, directory: str) -> None:
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            files, weight_map = _files(directory)
            for name in files:
                self._open(os.path.join(directory, name))
        except BaseException:
            self.close()
            raise
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.tensors))
            if missing:
                self.close()
                raise ConfigError(f"{INDEX} lists {missing[0]}, which none of its files holds")
        if any(name.endswith(mxfp4.SUFFIXES) for name in self.tensors):
            try:
                self.tensors = mxfp4.pair(self.tensors, self._float_dtype())
            except ConfigError:
                self.close()
                raise

    def _float_dtype(self) -> np.dtype:
        """The dtype most of the source's float tensors have: what its MXFP4 tensors are dequantized to."""
        floats = [t.dtype for t in self.tensors.values() if t.dtype != np.uint8]
        return max(set(floats), key=floats.count) if floats else np.dtype(np.float32)

    def _open(self, path: str) -> None:
        try:
            handle = self._stack.enter_context(safe_open(path, framework="numpy"))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path} is not a readable safetensors file: {str(e).splitlines()[0][:160]}") from None
        self._handles[path] = handle
        for name in handle.keys():
            piece = handle.get_slice(name)
            code = piece.get_dtype()
            if code == "U8" and name.endswith(mxfp4.SUFFIXES):  # MXFP4 halves, paired in __init__
                self.tensors[name] = TensorInfo(path, name, np.dtype(np.uint8), tuple(piece.get_shape()))
                continue
            if code not in DTYPES:
                raise ConfigError(f"{path}: tensor {name} has dtype {code}, which maxshard does not convert")
            self.tensors[name] = TensorInfo(path, name, DTYPES[code], tuple(piece.get_shape()))

    def read(self, info: TensorInfo, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) of a tensor (all by default) as a numpy array of their own (an MXFP4 tensor's rows,
        its experts, dequantized)."""
        if info.mxfp4 is not None:
            blocks, scales = info.mxfp4
            return mxfp4.dequantize(self.read(blocks, start, stop), self.read(scales, start, stop), info.dtype)
        handle = self._handles[info.file]
        if not info.shape:
            return handle.get_tensor(info.name)
        return handle.get_slice(info.name)[start : info.shape[0] if stop is None else stop]

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _assemble(spec: TensorSpec, blocks: Iterable[np.ndarray]) -> np.ndarray:
    """One tensor from its consecutive blocks of rows (or one whole block), checked against the planned shape."""
    out = np.empty(spec.shape, spec.dtype)
    if not spec.shape:
        (only,) = list(blocks)
        out[...] = only
        return out
    rows = 0
    for block in blocks:
        if block.shape[1:] != spec.shape[1:] or rows + block.shape[0] > spec.shape[0]:
            raise ValueError(f"{spec.name}: a block of shape {block.shape} at row {rows} does not fit {spec.shape}")
        out[rows : rows + block.shape[0]] = block
        rows += block.shape[0]
    if rows != spec.shape[0]:
        raise ValueError(f"{spec.name}: produced {rows} rows, planned {spec.shape}")
    return out


def write_checkpoint(directory: str, specs: list[TensorSpec], produce: Callable[[TensorSpec], Iterable[np.ndarray]],
                     max_shard_bytes: int) -> list[str]:
    """Writes the tensors as `model.safetensors`, or as numbered shards plus the index when they exceed
    `max_shard_bytes`, each file with `safetensors.numpy.save_file`. `produce(spec)` yields the tensor as
    consecutive blocks of rows (or whole); one shard's tensors are in memory at a time."""
    shards = _plan_shards(specs, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    for name, shard in zip(names, shards):
        tensors = {spec.name: _assemble(spec, produce(spec)) for spec in shard}
        save_file(tensors, os.path.join(directory, name), metadata=METADATA)
        del tensors
    if len(shards) > 1:
        weight_map = {spec.name: name for name, shard in zip(names, shards) for spec in shard}
        total = sum(spec.nbytes for spec in specs)
        with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.write("\n")
    return names
