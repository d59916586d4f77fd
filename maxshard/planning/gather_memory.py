"""What the fsdp gathers hold in memory: a stacked unit's weights gathered whole for the layer being computed, and
the output head gathered for the loss (whole over the token axes, with its gradient, where the loss pieces group
it: parallel/token_groups.py). The bytes the gathers move are planning/traffic.py's; these are the bytes they
leave live, which planning/memory.py adds to the activations.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from maxshard.config import Config
from maxshard.model import trainable
from maxshard.observe.report import Report
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import ParamLayout
from maxshard.planning import traffic
from maxshard.planning.axes import rule_axes
from maxshard.planning.fitted import compiler, fitted
from maxshard.planning.traffic import Geometry
from maxshard.spec import blocks

__all__ = ["gathered_unit_bytes", "gathered_head_bytes", "grouped_head_bytes"]

_UNIT_AXES = (*traffic.STACKED, ax.CIRCULAR_REPEATS, ax.LAYERS_PER_STAGE)  # a weight's axes that count its units


def _cast_bytes(p: ParamLayout, geo: Geometry) -> float:
    """A parameter's bytes per device in the compute dtype."""
    return p.bytes_per_device * geo.compute_itemsize / np.dtype(p.dtype).itemsize


def gathered_unit_bytes(cfg: Config, report: Report, sizes: Mapping[str, int], geo: Geometry,
                        largest_layer: bool = False) -> float:
    """Bytes of one stacked unit's weights after the fsdp all-gather, in the compute dtype: what the layer being
    computed holds whole (planning/memory.py); an MoE unit's expert weights twice (their gradient is whole too
    until it is reduce-scattered). With `largest_layer`, those of the unit's largest layer alone (a unit of several
    layers, spec/blocks.py, names them layer_0 ..), each weight once."""
    by_layer: dict[str, float] = {}
    units = max(geo.layers * cfg.model.num_units // max(cfg.num_layers, 1), 1)  # units one device runs
    for p in report.params:
        dims = traffic.dim_axes(p, sizes)
        if not any(logical in traffic.STACKED for logical, _ in dims):
            continue
        owned = {a for logical, axes in dims if logical in (ax.EXP, *traffic.STACKED) for a in axes}
        sharded = {a for _, axes in dims for a in axes}
        batch = traffic.token_axes(cfg, sizes, outer=False)
        gather = tuple(a for a in sizes if a in sharded and a in batch and a not in owned)
        if not gather:
            continue
        whole = _cast_bytes(p, geo) * traffic.shards(gather, sizes)
        if largest_layer:  # per stack and layer of its unit (params/decoder/<stack>[/layer_i]): its units divide it
            parts = p.name.split("/")
            end = next((i + 1 for i, part in enumerate(parts) if blocks.unit_layer_index(part) is not None), 3)
            layer = "/".join(parts[:end])
            units_here = math.prod(n for (logical, _), n in zip(dims, p.local_shape) if logical in _UNIT_AXES)
            by_layer[layer] = by_layer.get(layer, 0.0) + whole / max(units_here, 1)
            continue
        experts = any(logical == ax.EXP for logical, _ in dims)
        by_layer[""] = by_layer.get("", 0.0) + whole / units * (2 if experts else 1)
    return max(by_layer.values()) if largest_layer and by_layer else sum(by_layer.values())


def gathered_head_bytes(cfg: Config, report: Report, sizes: Mapping[str, int], geo: Geometry) -> float:
    """Bytes of the tied embedding table gathered whole over its fsdp shards, in the compute dtype, where it is the
    output head (`logits_via_embedding`); 0 for an untied head or a table no batch axis shards."""
    if not cfg.logits_via_embedding:
        return 0.0
    total = 0.0
    for p in report.params:
        if not p.name.endswith("token_embed/embedding"):
            continue
        dims = traffic.dim_axes(p, sizes)
        batch = traffic.token_axes(cfg, sizes, outer=True)
        gather = tuple(a for a in sizes if a in batch and any(a in axes for _, axes in dims))
        if gather:
            total += _cast_bytes(p, geo) * traffic.shards(gather, sizes)
    return total


def grouped_head_bytes(cfg: Config, report: Report, sizes: Mapping[str, int], geo: Geometry) -> tuple[float, float]:
    """(weights, gradient): what the output head holds when the loss pieces group it (training/loss.py
    `grouped_token_logps`). Its weights whole over the token axes in their own dtype, during the loss (for a tied
    table, in place of `gathered_head_bytes`'s copies), or in the compute dtype where they are frozen and the
    compiler casts before it gathers (`Fitted.frozen_head_cast`), once; and their
    gradient, whole until its one reduction, less the gradient's shard (counted with the gradients; a frozen head
    has none); both during the loss alone (its backward reduces the gradient before the layers' backward starts,
    training/loss.py). Under a table pipeline schedule the last stage groups each pipeline microbatch's tokens over
    the batch and length shards within it (training/pipelined.py). (0, 0) where the head is not grouped
    (step.Trainer._head): one piece, tokens on one device, fewer rows than batch shards."""
    batch = rule_axes(cfg, ax.EMBED_AND_LOGITS_BATCH, sizes, ax.LOGITS)
    length = rule_axes(cfg, ax.LENGTH, sizes, ax.LOGITS)
    pipe = cfg.model.pipeline
    rows = cfg.global_batch_size // max(cfg.gradient_accumulation_steps, 1)  # of one microbatch
    if pipe is not None and pipe.schedule != "circular":  # the stage axis is manual in the runner: no group
        stage = rule_axes(cfg, ax.ACT_STAGE, sizes)
        batch, rows = tuple(a for a in batch if a not in stage), rows // pipe.microbatches
    if (cfg.loss_chunks <= 1 or not (batch or length) or rows % traffic.shards(batch, sizes)
            or (cfg.max_target_length // cfg.loss_chunks) % traffic.shards(length, sizes)):
        return 0.0, 0.0
    tokens = set(batch) | set(length)
    head = "token_embed/embedding" if cfg.logits_via_embedding else "/logits/"
    weights = gradient = 0.0
    f = fitted(compiler(cfg))
    for p in report.params:
        if head in f"/{p.name}/":
            shards = traffic.shards(tuple(a for _, axes in traffic.dim_axes(p, sizes) for a in axes if a in tokens), sizes)
            if trainable.is_trainable(cfg.model, p.name):
                weights += p.bytes_per_device * shards
                gradient += p.bytes_per_device * (shards - 1)
            else:  # a frozen table (LoRA's base): no gradient, gathered cast where the compiler casts first
                copy = _cast_bytes(p, geo) if f.frozen_head_cast else p.bytes_per_device
                weights += copy * shards
    return weights, gradient
