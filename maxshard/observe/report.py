"""The layout report: how every parameter, optimizer moment and the input batch lie on the mesh.

Built from `jax.eval_shape` alone, so it works for a mesh of any size without its devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from maxshard.config import Config
from maxshard.model import trainable
from maxshard.parallel import axis_names
from maxshard.parallel.mesh import describe
from maxshard.parallel.sharding import FlaxRules, ParamLayout, array_layout, flax_rules, layout
from maxshard.training.step import abstract_state
from maxshard.units import format_bytes

__all__ = ["Report", "build_report", "format_report"]


@dataclasses.dataclass(frozen=True)
class Report:
    mesh: dict[str, int]
    params: list[ParamLayout]
    batch: ParamLayout
    param_bytes_per_device: int
    optimizer_bytes_per_device: int
    gradient_bytes_per_device: int
    replicated_fraction: float  # share of parameter bytes held whole by every device
    reference_bytes_per_device: int = 0  # DPO's frozen reference parameters in the state (0: none kept)

    def as_json(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh,
            "params": [p.as_json() for p in self.params],
            "batch": self.batch.as_json(),
            "totals": {
                "param_bytes_per_device": self.param_bytes_per_device,
                "optimizer_bytes_per_device": self.optimizer_bytes_per_device,
                "gradient_bytes_per_device": self.gradient_bytes_per_device,
                "replicated_fraction": self.replicated_fraction,
                "reference_bytes_per_device": self.reference_bytes_per_device,
            },
        }


def _replicated_fraction(rows: list[ParamLayout], num_devices: int) -> float:
    total = sum(math.prod(r.global_shape) * np.dtype(r.dtype).itemsize for r in rows)
    replicated = sum(
        math.prod(r.global_shape) * np.dtype(r.dtype).itemsize for r in rows if r.replication == num_devices > 1
    )
    return replicated / total if total else 0.0


def build_report(
    cfg: Config, mesh_sizes: Mapping[str, int], rules: FlaxRules | None = None, state: Any = None
) -> Report:
    """Layout of the train state and the input batch of `cfg` on a mesh of `mesh_sizes`.

    `state` is the boxed abstract train state when the caller already holds one (a Trainer does); else traced here.
    """
    rules = flax_rules(cfg) if rules is None else rules
    state = abstract_state(cfg) if state is None else state
    params = layout({"params": state.params}, rules, mesh_sizes)  # names and errors read "params/...", as in train
    optimizer = layout(state.opt_state, rules, mesh_sizes)
    reference = layout({"reference": state.reference}, rules, mesh_sizes) if state.reference is not None else []
    batch_shape = (cfg.global_batch_size, cfg.max_target_length)
    batch = array_layout("input batch", axis_names.INPUT_AXES, batch_shape, np.int32, rules, mesh_sizes)
    param_bytes = sum(p.bytes_per_device for p in params)
    trained_bytes = sum(p.bytes_per_device for p in params if trainable.is_trainable(cfg.model, p.name))
    return Report(
        mesh=dict(mesh_sizes),
        params=params,
        batch=batch,
        param_bytes_per_device=param_bytes,
        optimizer_bytes_per_device=sum(p.bytes_per_device for p in optimizer),
        gradient_bytes_per_device=trained_bytes,  # gradients exist for what trains only (trainable.py)
        replicated_fraction=_replicated_fraction(params, math.prod(mesh_sizes.values())),
        reference_bytes_per_device=sum(p.bytes_per_device for p in reference),
    )


def _spec_text(spec: Any, mesh_sizes: Mapping[str, int]) -> str:
    """'(fsdp, tensor)': per dimension the mesh axes that really split it (size > 1), '-' when none does.

    The full spec (axes of size 1 included) is in the JSON report; the table stays readable.
    """
    parts = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        parts.append("*".join(a for a in axes if mesh_sizes.get(a, 1) > 1) or "-")
    return "(" + ", ".join(parts) + ")"


def _row(p: ParamLayout, mesh_sizes: Mapping[str, int]) -> list[str]:
    return [
        p.name,
        "(" + ", ".join(a or "-" for a in p.logical_axes) + ")",
        _spec_text(p.spec, mesh_sizes),
        "x".join(map(str, p.global_shape)),
        "x".join(map(str, p.local_shape)),
        f"{p.bytes_per_device:,}",
        str(p.replication),
    ]


def format_report(report: Report) -> str:
    """A fixed-width table, one row per array, then the totals."""
    header = ["name", "logical axes", "spec", "global", "per device", "bytes/device", "replicas"]
    rows = [header] + [_row(p, report.mesh) for p in report.params] + [_row(report.batch, report.mesh)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"mesh: {describe(report.mesh)} ({math.prod(report.mesh.values())} devices; axes of size 1 left out of specs)"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    total = report.param_bytes_per_device + report.optimizer_bytes_per_device + report.gradient_bytes_per_device
    lines.append(
        f"per device: params {format_bytes(report.param_bytes_per_device)}, "
        f"optimizer {format_bytes(report.optimizer_bytes_per_device)}, "
        f"gradients {format_bytes(report.gradient_bytes_per_device)}, total {format_bytes(total)}; "
        f"replicated share of parameter bytes {report.replicated_fraction:.1%}"
    )
    return "\n".join(lines)
