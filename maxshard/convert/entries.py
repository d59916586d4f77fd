"""One tensor's entry in the conversion table (`Entry`) and how it moves between the two layouts: its Hugging Face
name and shape, the axis its rows run along, and the arrays on the way in (`to_maxshard`) and out (`to_hf`,
`join_parts`). The table itself, which tensor is which parameter, is convert/names.py's.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from maxshard.model.layers import rope

__all__ = ["Entry", "hf_name", "hf_shape", "row_axis", "hf_rows_per_row", "whole_rows", "to_maxshard", "to_hf",
           "join_parts"]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor: Hugging Face name ("{i}": layer index), maxshard path (below decoder/layers for per-layer
    tensors), layout ("same" or "linear"), and for "linear" how many leading maxshard dims are inputs."""

    hf: str
    path: tuple[str, ...]
    # "same", "linear", "flat" (a 1-D tensor of maxshard's shape), "interleaved" or "halves" (with `part`), "conv" (a
    # depthwise conv1d weight [channels, 1, width], read as the linear weight [channels, width]), "expert_linear"
    # (stacked torch Linear weights [experts, out, in] -> [experts, in, out]; with `part` the index-th of `width`
    # equal blocks of the out rows: Gemma 4's gate_up_proj)
    layout: str
    num_in: int = 1
    per_expert: bool = False  # one Hugging Face tensor per expert ("{e}"), stacked along maxshard's experts dim
    # A slice (start, stop, width) of each group's `width` Hugging Face rows: two maxshard kernels from one tensor
    # (MLA's kv_b_proj holds each head's key rows, then its value rows; the groups are as many as the part's rows
    # make of maxshard's output: one per head there, one per key head for Qwen3-Next's in_proj_qkvz, one in all
    # for Qwen3.5's in_proj_qkv). "interleaved": every width-th column of the last dim from `start` (GPT-OSS's
    # gate_up_proj: gate (0, 1, 2), up (1, 2, 2)); "halves": the index-th of `width` equal blocks of the last dim
    # (Llama 4's gate_up_proj: the gate columns, then the up columns); "expert_linear": the index-th of `width` equal
    # blocks of each expert's rows (Gemma 4's gate_up_proj [experts, 2 mlp, embed]).
    part: tuple[int, int, int] | None = None
    # The last `rope_tail` features of maxshard's last dim are a RoPE part that Hugging Face stores in interleaved
    # pairs (DeepSeek): they are reordered into the half layout (layers/rope.py `deinterleaved`) on the way in.
    rope_tail: int = 0
    whole: bool = False  # moved as one array, not in row blocks (a part whose groups are not maxshard's rows)


def hf_name(entry: Entry, index: tuple[int, ...] | int | None = None) -> str:
    """The tensor's name at `index`: () or None for a global tensor, (layer,) or (layer, expert)."""
    if index is None or index == ():
        return entry.hf
    index = (index,) if isinstance(index, int) else index
    return entry.hf.format(i=index[0], e=index[1] if len(index) > 1 else None)


def hf_shape(entry: Entry, maxshard_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of a (per-layer) maxshard parameter shape (of the whole tensor a `part` is cut from)."""
    if entry.layout == "same":
        return maxshard_shape
    if entry.layout == "flat":
        return (math.prod(maxshard_shape),)
    if entry.layout in ("interleaved", "halves"):
        return (*maxshard_shape[:-1], maxshard_shape[-1] * entry.part[2])
    if entry.layout == "expert_linear":
        experts, inputs, outputs = maxshard_shape
        return (experts, outputs * (entry.part[2] if entry.part else 1), inputs)
    inputs, outputs = maxshard_shape[: entry.num_in], maxshard_shape[entry.num_in :]
    rows = _groups(entry, outputs) * entry.part[2] if entry.part else math.prod(outputs)
    return (rows, 1, math.prod(inputs)) if entry.layout == "conv" else (rows, math.prod(inputs))


def _groups(entry: Entry, outputs: tuple[int, ...]) -> int:
    """How many groups of `part[2]` Hugging Face rows the tensor holds: maxshard's output size over the part's."""
    start, stop, _ = entry.part
    return math.prod(outputs) // (stop - start)


def row_axis(entry: Entry) -> int:
    """The maxshard dim along which Hugging Face's rows run: its first output dim (dim 0 for "same").

    A block of maxshard rows along it is a contiguous block of Hugging Face rows (q_proj: whole heads; o_proj:
    embed rows; lm_head: vocab rows), so both directions can stream a tensor in row blocks."""
    return entry.num_in if entry.layout in ("linear", "conv") else 0


def hf_rows_per_row(entry: Entry, maxshard_shape: tuple[int, ...]) -> int:
    """Hugging Face rows per maxshard row along `row_axis` (head_dim for q/k/v, a part's whole width, 1
    otherwise)."""
    if entry.layout == "flat":
        return math.prod(maxshard_shape[1:])
    if entry.layout != "linear":
        return 1
    inner = maxshard_shape[row_axis(entry) + 1 :]
    return math.prod(inner[:-1]) * entry.part[2] if entry.part else math.prod(inner)


def whole_rows(entry: Entry, maxshard_shape: tuple[int, ...]) -> bool:
    """Whether the tensor must be moved whole rather than in row blocks: a RoPE part reordered along the very
    axis the rows run along (kv_a_proj_with_mqa's last rows), or an `Entry.whole` one."""
    return entry.whole or (bool(entry.rope_tail) and row_axis(entry) == len(maxshard_shape) - 1)


def _rope_order(entry: Entry, width: int, inverse: bool = False) -> np.ndarray:
    """Indices over the last dim that move its RoPE tail between the interleaved and the half layout."""
    tail = rope.deinterleaved(entry.rope_tail)
    tail = np.argsort(tail) if inverse else tail
    return np.concatenate([np.arange(width - entry.rope_tail), width - entry.rope_tail + tail])


def to_maxshard(entry: Entry, array: np.ndarray, maxshard_shape: tuple[int, ...]) -> np.ndarray:
    """Hugging Face tensor (or a block of its rows) -> maxshard layout (or that block of rows along `row_axis`),
    as a view where no reordering is needed."""
    if entry.layout in ("same", "flat"):
        return array.reshape(maxshard_shape)
    if entry.layout == "interleaved":
        start, _, width = entry.part
        return array[..., start::width].reshape(maxshard_shape)
    if entry.layout == "halves":
        index, _, count = entry.part
        size = array.shape[-1] // count
        return array[..., index * size:(index + 1) * size].reshape(maxshard_shape)
    if entry.layout == "expert_linear":  # [experts, out, in], or a block of its experts
        if entry.part:
            index, _, count = entry.part
            size = array.shape[1] // count
            array = array[:, index * size:(index + 1) * size]
        return array.transpose(0, 2, 1).reshape(maxshard_shape)
    if entry.layout == "conv":  # [channels, 1, width] -> the [channels, width] of a linear weight
        array = array[:, 0, :]
    if entry.part:
        start, stop, width = entry.part
        inputs = maxshard_shape[: entry.num_in]
        return array.T.reshape(*inputs, -1, width)[..., start:stop].reshape(maxshard_shape)
    out = array.T.reshape(maxshard_shape)
    return out[..., _rope_order(entry, out.shape[-1])] if entry.rope_tail else out


def to_hf(entry: Entry, array: np.ndarray) -> np.ndarray:
    """maxshard (per-layer) parameter -> Hugging Face layout; the exact inverse of `to_maxshard`. A `part` is
    written with its siblings (`join_parts`)."""
    if entry.layout == "same":
        return array
    if entry.layout == "flat":
        return array.reshape(-1)
    if entry.layout == "expert_linear":
        return array.transpose(0, 2, 1)
    if entry.rope_tail:
        array = array[..., _rope_order(entry, array.shape[-1], inverse=True)]
    inputs = math.prod(array.shape[: entry.num_in])
    out = array.reshape(inputs, -1).T
    return out[:, None, :] if entry.layout == "conv" else out


def join_parts(entry: Entry, parts: list[np.ndarray], entries: list[Entry] | None = None) -> np.ndarray:
    """The Hugging Face rows of a tensor cut into `part`s (in part order), from those parts' maxshard blocks
    (`entries`: each part's own row, for parts of different widths; `entry`'s for all by default)."""
    if entry.layout == "interleaved":  # column j of part p is column j * width + p
        stacked = np.stack(parts, axis=-1)
        return stacked.reshape(*stacked.shape[:-2], -1)
    if entry.layout == "halves":  # the parts' columns one after the other
        return np.concatenate(parts, axis=-1)
    if entry.layout == "expert_linear":  # each expert's parts' rows one after the other
        return np.concatenate([p.transpose(0, 2, 1) for p in parts], axis=1)
    entries = entries or [entry] * len(parts)
    grouped = [p.reshape(*p.shape[: e.num_in], _groups(e, p.shape[e.num_in :]), -1) for p, e in zip(parts, entries)]
    whole = np.concatenate(grouped, axis=-1)
    out = whole.reshape(math.prod(whole.shape[: entry.num_in]), -1).T
    return out[:, None, :] if entry.layout == "conv" else out
