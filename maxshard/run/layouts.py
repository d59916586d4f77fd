"""The candidate layouts of the layout search (`run/search.py`): what the search may change, enumerated.

A layout is the ici/dcn mesh knobs, `remat_policy` and, with pipeline stages, `num_pipeline_microbatches`; the
model, the global batch and every other key stay as the user set them, and so do keys given on the command line.

    ici (devices of one slice or node): every factorization over data, stage, fsdp, sequence, context, tensor,
         tensor_sequence (tensor parallelism that also splits the residual stream: less memory, more traffic), and
         expert for MoE models; the axes that split heads or length or layers (`SMALL_AXES`) at most
         `SMALL_AXIS_LIMIT` ways, and never two of an `EXCLUSIVE` pair together (sequence, context and
         tensor_sequence all split the length, tensor and tensor_sequence the heads)
    dcn (across slices or nodes): over data, fsdp and stage only, whose traffic crosses the network once per step
         (data) or once per layer (fsdp), or as one activation per microbatch (stage); never per-layer
         activation traffic such as tensor's
    num_pipeline_microbatches, with S > 1 stages: S, 2S and 4S (it must be a multiple of S)
    remat_policy: the policy each round of the search gives (`run/search.py`)
Not searched: fsdp_transpose (a variant of fsdp), autoregressive (a decoding axis),
gradient_accumulation_steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence

from maxshard.config import MESH_AXES, Config, knob_name
from maxshard.launch.topologies import Target

__all__ = ["Layout", "meshes", "overrides"]

ICI_AXES = ("data", "stage", "fsdp", "sequence", "context", "tensor", "tensor_sequence")  # + expert for MoE models
DCN_AXES = ("data", "stage", "fsdp")
SMALL_AXES = ("stage", "sequence", "context", "tensor", "tensor_sequence", "expert")
# Axes that split the same dimension two ways: a layout uses one of each pair (unless the user pinned both).
# tensor_sequence with sequence or context: XLA gathers 12x the bytes of sequence x tensor (benchmarks/README.md).
EXCLUSIVE = (("sequence", "context"), ("tensor", "tensor_sequence"), ("sequence", "tensor_sequence"),
             ("context", "tensor_sequence"))
SMALL_AXIS_LIMIT = 8  # past 8 ways, these axes' per-layer traffic outgrows what they save in memory
MICROBATCH_MULTIPLES = (1, 2, 4)

@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate: axis sizes inside (`ici`) and across (`dcn`) slices, in `MESH_AXES` order, and the rest."""

    ici: tuple[int, ...]
    dcn: tuple[int, ...]
    remat_policy: str
    microbatches: int = 0  # pipeline microbatches; 0 without stages

    @property
    def sizes(self) -> dict[str, int]:
        return {a: i * d for a, i, d in zip(MESH_AXES, self.ici, self.dcn)}

    @property
    def name(self) -> str:
        """'fsdp4-tensor2-full', 'dcn_data2-fsdp8-save_qkv_proj', 'stage2-fsdp4-full-mb4': a sweep point's name."""
        parts = [f"dcn_{a}{n}" for a, n in zip(MESH_AXES, self.dcn) if n > 1]
        parts += [f"{a}{n}" for a, n in zip(MESH_AXES, self.ici) if n > 1]
        parts.append(self.remat_policy)
        if self.microbatches:
            parts.append(f"mb{self.microbatches}")
        return "-".join(parts)

    @property
    def label(self) -> str:
        """'fsdp=4 tensor=2 remat=full': for tables."""
        mesh_text = " ".join(f"{a}={n}" for a, n in self.sizes.items() if n > 1) or "single device"
        pipe = f" microbatches={self.microbatches}" if self.microbatches else ""
        return f"{mesh_text} remat={self.remat_policy}{pipe}"


def _factorizations(total: int, axes: Sequence[str], limits: dict[str, int]) -> Iterator[dict[str, int]]:
    """Every {axis: size} over `axes` whose sizes multiply to `total`, each size at most its limit."""
    if not axes:
        if total == 1:
            yield {}
        return
    first, rest = axes[0], axes[1:]
    for size in range(1, min(total, limits.get(first, total)) + 1):
        if total % size == 0:
            for tail in _factorizations(total // size, rest, limits):
                yield {first: size, **tail}


def _family(user: Config, family: str, total: int, searched: Sequence[str], pinned: set[str]) -> list[tuple[int, ...]]:
    """The axis sizes of one knob family the search tries: pinned knobs keep their size (-1 ones fill), knobs
    neither searched nor pinned are 1."""
    values = {a: user.parallelism(family, a) for a in MESH_AXES}
    is_pinned = {a: knob_name(family, a) in pinned for a in MESH_AXES}
    fixed = {a: v for a, v in values.items() if is_pinned[a] and v > 0}
    free = [a for a in MESH_AXES if (a in searched and not is_pinned[a]) or (is_pinned[a] and values[a] == -1)]
    if total % math.prod(fixed.values()):
        return []
    limits = {a: SMALL_AXIS_LIMIT for a in SMALL_AXES if not is_pinned[a]}
    out = []
    for sizes in _factorizations(total // math.prod(fixed.values()), free, limits):
        if any(sizes.get(a, 1) > 1 and sizes.get(b, 1) > 1 and not (is_pinned[a] or is_pinned[b])
               for a, b in EXCLUSIVE):
            continue
        out.append(tuple(fixed.get(a) or sizes.get(a, 1) for a in MESH_AXES))
    return out


def _microbatch_choices(user: Config, stages: int, pinned: set[str]) -> list[int]:
    if stages == 1:
        return [0]
    if "num_pipeline_microbatches" in pinned:
        return [stages if user.num_pipeline_microbatches == -1 else user.num_pipeline_microbatches]
    return [stages * m for m in MICROBATCH_MULTIPLES]


def meshes(user: Config, target: Target, pinned: set[str], policy: str) -> list[Layout]:
    """Every mesh of the module docstring, with each of its microbatch counts, under one remat `policy`, for `user`
    (finalized for `target`, its mesh not resolved)."""
    searched = ICI_AXES + (("expert",) if user.num_experts > 1 else ())
    ici = _family(user, "ici", target.chips_per_slice, searched, pinned)
    dcn = _family(user, "dcn", target.num_slices, DCN_AXES, pinned)
    out = []
    for i, d in itertools.product(ici, dcn):
        stages = i[MESH_AXES.index("stage")] * d[MESH_AXES.index("stage")]
        out += [Layout(i, d, policy, m) for m in _microbatch_choices(user, stages, pinned)]
    return out


def overrides(layout: Layout, user: Config, pinned: set[str]) -> tuple[str, ...]:
    """The `key=value`s that turn the user's config into `layout`: only keys whose value changes.

    A knob the user left at -1 stays out when it is its family's only -1: it fills to the layout's size, since
    every other knob of the family is then that size already."""
    out = []
    for family, sizes in (("ici", layout.ici), ("dcn", layout.dcn)):
        values = [user.parallelism(family, a) for a in MESH_AXES]
        one_fill = values.count(-1) == 1
        for axis, value, size in zip(MESH_AXES, values, sizes):
            knob = knob_name(family, axis)
            if knob not in pinned and value != size and not (value == -1 and one_fill):
                out.append(f"{knob}={size}")
    if "remat_policy" not in pinned and layout.remat_policy != user.remat_policy:
        out.append(f"remat_policy={layout.remat_policy}")
    if layout.microbatches and "num_pipeline_microbatches" not in pinned:
        stages = layout.sizes["stage"]
        current = stages if user.num_pipeline_microbatches == -1 else user.num_pipeline_microbatches
        if layout.microbatches != current:
            out.append(f"num_pipeline_microbatches={layout.microbatches}")
    return tuple(out)
