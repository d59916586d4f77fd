"""The circular pipeline's shape, worked out once from the config and the mesh's axis sizes.

Stages S are the size of the `stage` mesh axis; layers per stage L, repeats R and microbatches M come from their
keys, with -1 derived: R = units / (S x L), M = S. The result is a `PipelineShape` (in `spec/model_config.py`) that the
loader puts into the `ModelConfig`, so the layers receive a resolved schedule and never read mesh knobs, the global
batch or the logical rules. Every pipeline mistake is one `ConfigError` here, before anything is traced (what the
schedule asks of the sizes, its `check`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from maxshard.config import Config, layer_sharing_ranges
from maxshard.errors import ConfigError
from maxshard.objectives import kinds as objective_kinds
from maxshard.spec import pipeline_schedule
from maxshard.spec.model_config import PipelineShape, num_units
from maxshard.parallel import axis_names as ax
from maxshard.parallel.mesh import describe
from maxshard.parallel.sharding import axes_of, flax_rules

__all__ = ["pipeline_shape", "resolve"]


def _units_text(cfg: Config, units: int) -> str:
    """The pipeline's units in words: layers, or blocks of the layers that repeat (the mixers' period, that of
    layer_types or attention_pattern, and the MoE interval), with the dense first layers that run before them."""
    if units == cfg.num_layers:
        return f"num_layers={units}"
    moe = cfg.num_experts > 1
    mixers = "layer_types' period" if cfg.layer_types else "attention_pattern's length"
    periods = {mixers: cfg.pattern_length, "moe_layer_interval": cfg.moe_layer_interval if moe else 1}
    named = ", ".join(f"{name} {size}" for name, size in periods.items() if size > 1)
    dense = (f" after first_k_dense_replace={cfg.first_k_dense_replace} dense layers (they run before the pipeline)"
             if moe and cfg.first_k_dense_replace else "")
    block = math.lcm(*periods.values())
    return f"{units} blocks of {block} layers ({named}){dense}"


def _repeats(cfg: Config, units: int, stages: int) -> int:
    per_stage, what = cfg.num_layers_per_pipeline_stage, _units_text(cfg, units)
    if cfg.num_pipeline_repeats == -1:
        if units % (stages * per_stage):
            raise ConfigError(f"{what} is not divisible by pipeline stages x num_layers_per_pipeline_stage = "
                              f"{stages} x {per_stage}")
        return units // (stages * per_stage)
    if units != stages * per_stage * cfg.num_pipeline_repeats:
        raise ConfigError(f"{what} must equal pipeline stages x num_layers_per_pipeline_stage x "
                          f"num_pipeline_repeats = {stages} x {per_stage} x {cfg.num_pipeline_repeats}")
    return cfg.num_pipeline_repeats


def pipeline_shape(cfg: Config, stages: int) -> PipelineShape:
    """The sizes for `stages` stages with -1 knobs derived; validates the knobs (not the batch)."""
    if cfg.num_layers_per_pipeline_stage < 1:
        raise ConfigError(f"num_layers_per_pipeline_stage must be >= 1, got {cfg.num_layers_per_pipeline_stage}")
    for key in ("num_pipeline_repeats", "num_pipeline_microbatches"):
        if getattr(cfg, key) == 0 or getattr(cfg, key) < -1:
            raise ConfigError(f"{key} must be >= 1 or -1 (derived), got {getattr(cfg, key)}")
    units = num_units(cfg.num_layers, cfg.num_experts, cfg.moe_layer_interval, cfg.first_k_dense_replace,
                      cfg.pattern_length)
    repeats = _repeats(cfg, units, stages)
    microbatches = stages if cfg.num_pipeline_microbatches == -1 else cfg.num_pipeline_microbatches
    shape = PipelineShape(stages, cfg.num_layers_per_pipeline_stage, repeats, microbatches, cfg.pipeline_schedule)
    pipeline_schedule.of(shape).check()
    return shape


def _batch_shards(cfg: Config, mesh_sizes: Mapping[str, int]) -> tuple[int, str]:
    """(number of shards of a pipeline microbatch's batch dimension, their description): its dimension in the
    circulating stage inputs, ax.PIPELINE_STATE (layers/pipeline.py)."""
    axes = {a: mesh_sizes.get(a, 1) for a in axes_of(ax.BATCH, ax.PIPELINE_STATE, flax_rules(cfg))}
    return math.prod(axes.values()), describe(axes)


def _check_batch(cfg: Config, shape: PipelineShape, mesh_sizes: Mapping[str, int]) -> None:
    """The batch of one model call must split into M microbatches that divide over the batch mesh axes."""
    batch, m = cfg.global_batch_size // cfg.gradient_accumulation_steps, shape.microbatches
    if batch % m:
        raise ConfigError(f"the batch of {batch} sequences per model call (global batch / "
                          f"gradient_accumulation_steps) is not divisible by num_pipeline_microbatches={m}")
    shards, shown = _batch_shards(cfg, mesh_sizes)
    if (batch // m) % shards:
        raise ConfigError(f"a pipeline microbatch of {batch // m} sequences ({batch} / num_pipeline_microbatches="
                          f"{m}) is not divisible by the {shards} batch shards ({shown})")


def _left_over_layers(cfg: Config) -> int:
    """How many layers the main stack's unit leaves over (spec/blocks.py's last stack): the runner computes
    them per microbatch on the last stage, where the circular pipeline runs them on the whole batch."""
    body = cfg.num_layers - (cfg.first_k_dense_replace if cfg.num_experts > 1 else 0)
    return body % math.lcm(cfg.pattern_length, cfg.moe_layer_interval if cfg.num_experts > 1 else 1)


def _after_the_pipeline(cfg: Config) -> str:
    """The MoE layers the runner's last part computes per microbatch, where the circular pipeline runs them on the
    whole batch, in words ("" for none): a layer the main stack's unit leaves over, the prediction modules'."""
    if cfg.num_experts <= 1:
        return ""
    if _left_over_layers(cfg) >= cfg.moe_layer_interval:
        return ("an MoE layer after the pipeline (the attention pattern leaves one over: num_layers - "
                "first_k_dense_replace is not a multiple of lcm(attention_pattern length, moe_layer_interval))")
    trains = objective_kinds.trains_mtp(cfg.objective, cfg.mtp_depth, cfg.mtp_loss_weight)
    return f"mtp_depth={cfg.mtp_depth} on an MoE model" if trains else ""


def _check_runner(cfg: Config) -> None:
    """What the table schedules' runner (model/layers/pipeline_runner.py) does not run, refused in one line: the
    Switch balance loss of the MoE layers its last part runs per microbatch (training/pipelined.py), a product of
    two whole-batch means whose backward needs every microbatch's routing before the first backward."""
    name, after = cfg.pipeline_schedule, _after_the_pipeline(cfg)
    if name != "circular" and after and cfg.load_balance_loss_weight:
        raise ConfigError(f"load_balance_loss_weight={cfg.load_balance_loss_weight} with {after} runs with "
                          f"pipeline_schedule=circular only (the table schedules run those layers per microbatch, "
                          f"and their balance loss needs the whole batch's routing before any backward): set "
                          f"load_balance_loss_weight=0 (aux-loss-free balancing: moe_router_bias) or use "
                          f"pipeline_schedule=circular, got {name}")


def resolve(cfg: Config, mesh_sizes: Mapping[str, int]) -> PipelineShape | None:
    """The run's pipeline (None when the `stage` axis has size 1), checked against its batch when it has one."""
    stages = mesh_sizes.get("stage", 1)
    if stages == 1:
        return None
    if not cfg.scan_layers:
        raise ConfigError("pipeline parallelism needs scan_layers=true (each stage scans its layers)")
    tied = layer_sharing_ranges.across_stages(cfg)
    if tied:
        raise ConfigError(f"pipeline parallelism with {tied}: the stages would need keys, values or per-layer inputs "
                          "from the embedding or another stage; run it without stages (ici_stage_parallelism=1)")
    shape = pipeline_shape(cfg, stages)
    _check_runner(cfg)
    if cfg.global_batch_size:
        _check_batch(cfg, shape, mesh_sizes)
    return shape
