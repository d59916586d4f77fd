"""The MoE terms of the activation plan (planning/memory.py's docstring, `MoE layer`): the expert rows a device
computes per token, what they hold beyond the dense MLP the layer formula counts, and what `minimal` keeps of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from maxshard.config import Config
from maxshard.model.layers.moe import group_size
from maxshard.parallel import axis_names as ax
from maxshard.planning.axes import rule_axes

if TYPE_CHECKING:
    from maxshard.planning.memory import Widths

__all__ = ["rows", "token_bytes", "matmul_bytes"]


def rows(cfg: Config, sizes: Mapping[str, int]) -> float:
    """Expert rows per token one device computes in an MoE layer (memory.py's docstring)."""
    k = cfg.num_experts_per_tok
    if cfg.capacity_factor > 0:
        return k * cfg.capacity_factor
    if cfg.model.moe_dropless_impl == "dense":
        return cfg.num_experts
    p = 1
    for axis in rule_axes(cfg, ax.EXP, sizes):  # the expert shards of the exchange (layers/moe_grouped.py)
        p *= sizes[axis]
    if p == 1:
        return k
    worst = p * min(k, cfg.num_experts // p)
    factor = cfg.model.moe_ragged_buffer_factor
    return min(worst, k * factor) if cfg.model.moe_exchange == "ragged" and factor > 0 else worst


def token_bytes(cfg: Config, w: Widths, sizes: Mapping[str, int], itemsize: int) -> float:
    """Per token and MoE layer, beyond the dense MLP the layer formula counts (an expert's hidden width is
    `w.expert`: moe_mlp_dim, or the dense MLP's)."""
    if not cfg.model.is_moe:
        return 0.0
    n = rows(cfg, sizes)
    if cfg.capacity_factor <= 0 and cfg.model.moe_dropless_impl != "dense":
        return n * (6 * w.embed + 7 * w.expert) * itemsize  # sorted, sent, received, returned rows; SwiGLU
    acts = n * (2 * w.embed + 3 * w.expert) * itemsize
    masks = 0.0
    if cfg.capacity_factor > 0:
        g = group_size(cfg.max_target_length, cfg.moe_group_size)
        masks = 2 * g * cfg.num_experts_per_tok * cfg.capacity_factor * 4
    return acts + masks


def matmul_bytes(cfg: Config, w: Widths, sizes: Mapping[str, int], itemsize: int) -> float:
    """What `minimal` keeps of an MoE layer per token: the matmul outputs of its rows (dispatch, gate, up,
    expert output)."""
    if not cfg.model.is_moe:
        return 0.0
    return rows(cfg, sizes) * (2 * w.embed + 2 * w.expert) * itemsize
