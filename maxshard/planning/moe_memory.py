"""The MoE terms of the activation plan (planning/memory.py's docstring, `MoE layer`): the expert rows a device
computes per token, what they hold beyond the dense MLP the layer formula counts, and what `minimal` keeps of them.

The working set of the MoE layer being differentiated (`working_bytes`) is that count on XLA:CPU. On XLA:TPU the MoE
layer's backward is a phase of its own (`Fitted.moe_rows`): the buffers live at a whole MoE step's peak are the MoE
backward's (the recomputed gate and up projections, the SwiGLU backward's fusions, the dispatched rows and their
gradient, two gathered expert kernels), no attention buffer, so the plan counts a number of (embed, expert width)
values per routed row, and the unit holds the larger of that and its layer's working set without the dense MLP's
share (with it, where the layer keeps its dense MLP beside the experts: `moe_beside_mlp`). The one-hot masks are
fused into the dispatch and combine einsums, never stored. Each path has its row:
dropping, dropless with the experts unsplit (ragged_dot), and dropless with the experts split over an expert axis
(the rows of the exchange's worst-case buffer). The rows were read off whole train steps, not one MoE layer alone
(benchmarks/moe_layer_tpu.py, `sum` of the output as its loss): a constant output gradient that XLA folds is not what
a step holds. Fitted on Mixtral 8x7B and Moonlight-16B programs; held out on a DeepSeek-style shape
(tests/test_tpu_aot.py) and 125m with 8 experts (benchmarks/README.md, "Mixtral 8x7B on v6e-256" and "DeepSeek-style
on XLA:TPU").
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from maxshard.config import Config
from maxshard.model import trainable
from maxshard.model.layers.moe import group_size
from maxshard.observe.report import Report
from maxshard.parallel import axis_names as ax
from maxshard.planning.axes import rule_axes
from maxshard.planning.fitted import fitted
from maxshard.planning.widths import Widths
from maxshard.spec import blocks

__all__ = ["rows", "token_bytes", "working_bytes", "matmul_bytes", "stack_bytes"]



def _expert_shards(cfg: Config, sizes: Mapping[str, int]) -> int:
    """Devices the experts are split over: those the dropless exchange runs between (layers/moe_grouped.py)."""
    p = 1
    for axis in rule_axes(cfg, ax.EXP, sizes):
        p *= sizes[axis]
    return p


def rows(cfg: Config, sizes: Mapping[str, int]) -> float:
    """Expert rows per token one device computes in an MoE layer (memory.py's docstring)."""
    k = cfg.num_experts_per_tok
    if cfg.capacity_factor > 0:
        return k * cfg.capacity_factor
    if cfg.model.moe_dropless_impl == "dense":
        return cfg.num_experts
    p = _expert_shards(cfg, sizes)
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


def working_bytes(cfg: Config, w: Widths, sizes: Mapping[str, int], itemsize: int, compiler_name: str,
                  dense_working: tuple[float, float, float], layer_working: float) -> float:
    """Per token, what the MoE layer being differentiated adds to the working set of its unit: `token_bytes`, or
    where the compiler's count was measured (`Fitted.moe_rows`: dropping with the experts unsplit, dropless with
    them unsplit and split over an expert axis, whose rows are the exchange's buffer, `rows`) the
    MoE backward as a phase of its own (module docstring): the unit holds the larger of its layer's working set
    without the dense MLP's share (`dense_working`: the policy's row of `Fitted.working`, whose fraction of `dense`
    and mlp widths hold 6F and F of the dense MLP, which the MoE layer has in its place) and the measured rows, so
    the term is max(rows - `layer_working`, - that share), never below 0 where the layer keeps its dense MLP
    beside the experts (`moe_beside_mlp`); `layer_working`: one layer's working set per token
    (`Widths.working_bytes`)."""
    if not cfg.model.is_moe:
        return 0.0
    measured = fitted(compiler_name).moe_rows
    split = _expert_shards(cfg, sizes) > 1
    path = "dropping" if cfg.capacity_factor > 0 else "exchange" if split else "local"
    dense_path = cfg.capacity_factor <= 0 and cfg.model.moe_dropless_impl == "dense"
    if measured is None or path not in measured or dense_path or (split and path == "dropping"):
        return token_bytes(cfg, w, sizes, itemsize)  # dropping was measured with the experts unsplit only
    e, f = measured[path]
    dense_share = (dense_working[0] * 6 + dense_working[2]) * w.mlp * itemsize
    moe = rows(cfg, sizes) * (e * w.embed + f * w.expert) * itemsize
    kept = 0.0 if cfg.model.moe_beside_mlp else -dense_share  # Gemma 4's MoE layers keep the dense MLP beside
    return max(moe - layer_working, kept)


def matmul_bytes(cfg: Config, w: Widths, sizes: Mapping[str, int], itemsize: int) -> float:
    """What `minimal` keeps of an MoE layer per token: the matmul outputs of its rows (dispatch, gate, up,
    expert output)."""
    if not cfg.model.is_moe:
        return 0.0
    return rows(cfg, sizes) * (2 * w.embed + 2 * w.expert) * itemsize


def _in_moe_layer(cfg: Config, name: str) -> bool:
    """Whether the parameter `name` ("params/decoder/[pipeline/]<stack>/[layer_i/]...") belongs to an MoE layer of
    a decoder stack (spec/blocks.py); the prediction modules' layers are not in a stack."""
    parts = name.split("/")
    if parts[:2] != ["params", "decoder"]:
        return False
    for stack in blocks.stacks(cfg.model):
        if stack.name in parts[2:4]:
            rest = parts[parts.index(stack.name, 2) + 1:]
            layer = blocks.unit_layer_index(rest[0]) if rest else None
            kinds = stack.unit if layer is None else (stack.unit[layer],)
            return blocks.moe_layers(kinds) == len(kinds)
    return False


def stack_bytes(cfg: Config, report: Report, itemsize: int) -> float:
    """Per device, the MoE layers' float32 weight gradient (what trains of them) and their weights cast to the
    compute dtype (`itemsize` bytes an element): the stacked values beside which XLA:TPU's heap leaves gaps
    (`Fitted.moe_stack_gaps`); 0 for a dense model."""
    if not cfg.model.is_moe:
        return 0.0
    total = 0.0
    for p in report.params:
        if _in_moe_layer(cfg, p.name):
            gradient = p.bytes_per_device if trainable.is_trainable(cfg.model, p.name) else 0
            total += gradient + p.bytes_per_device * itemsize / np.dtype(p.dtype).itemsize
    return total
