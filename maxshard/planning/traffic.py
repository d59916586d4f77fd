"""The collectives one train step needs, per mesh axis, from the layout alone (no devices, no compile).

Bytes are *full-buffer bytes per device* (see `collectives.py`: the gathered result of an all-gather, the operand
of a reduce-scatter, all-reduce, all-to-all or permute), summed over one step. Notation: k =
`gradient_accumulation_steps`; "tokens" = the [batch, length] positions one device holds between layers
(global batch / batch shards x length / sequence shards); E = emb_dim; a layer count is per pipeline stage.

Weights (per parameter, from its PartitionSpec). A parameter dimension sharded over a mesh axis that also splits
the batch (fsdp, fsdp_transpose, sequence, expert for non-expert weights: the *gather axes*) must be whole where
it meets the activations:
  all-gather      stacked layer weights twice per microbatch (forward, and again in the backward pass: the
                  SPMD partitioner inserts gathers after autodiff, so the saved residual is the shard, whatever
                  the remat policy), other matmul weights (the output head) once; in the compute dtype (the cast
                  to `dtype` is elementwise, so it runs on the shard before the gather). Bytes = shard x gather.
  reduce-scatter  their gradients over the same axes, once per microbatch, in the compute dtype: the partial sums
                  come out of the matmul in `dtype` and are reduced before the cast back to the weight dtype (seen
                  in an XLA:TPU ahead-of-time compile: a bfloat16 reduction of float32 weights' gradients).
  all-reduce      gradients over batch axes the parameter is *not* sharded on (data parallelism; the replicated
                  norm scales, reduced in float32), once per microbatch, shard bytes.
  The token embedding is a lookup, not a matmul: XLA keeps the table sharded and moves the looked-up rows with an
  all-to-all ([tokens, E], forward in the compute dtype, backward in the table's dtype); its gradient needs no
  reduction over the gather axes. With the table sharded over the vocabulary too, the partitioner of jax before 0.12
  scatters the rows' gradients into the whole vocabulary and all-reduces that over the vocabulary axes, [vocab, E /
  gather shards] (below); from 0.12 on it moves no rows back: each device scatters its own tokens' gradients into a
  buffer of vocab x E / vocabulary shards elements, all-reduces it over the gather axes and permutes one table shard
  into place (`_SCATTERS_INTO_VOCAB_SHARDS`).
  A pipeline (stage > 1) runs each stage's weights once per iteration of its schedule (spec/pipeline_schedule.py;
  M*R + S - 1 iterations for the circular one): stacked gathers and their gradient reduce-scatters x iterations / R
  (XLA keeps the per-repeat gather inside the schedule loop, so a compile gathers and reduces a little more).
Activations:
  tensor (axes of activation_heads / activation_mlp)  with the residual stream's length split over them
                  (tensor_sequence, layers/decoder.py): the measured counts of `_SP_REDUCES` and `_SP_GATHERS`.
                  Otherwise (tensor) Megatron: all-reduce [tokens, E] after the attention output
                  and MLP output projections (2 per layer forward), 2 per layer backward (input gradients of the
                  q/k/v and wi projections, summed before the reduction as XLA's AllReduceReassociate does on
                  TPU/GPU), and the recomputed forward's again under remat (2 for full, 1 when out_proj is saved);
                  plus the embedding lookup (forward, in the table's dtype: the cast follows the lookup) and
                  the output head's input gradient (backward), both [tokens, E], when the vocabulary is sharded;
                  and when the table is sharded over vocabulary *and* gather axes, XLA all-reduces its gradient,
                  [vocab, E / gather shards], over the vocabulary axes (seen on XLA:CPU and XLA:TPU alike).
  sequence        outside attention the length is sharded over `sequence`, inside it the heads are
                  (layers/attention_ops.py): all-to-all of q, k, v to head-sharded and of the output back, 2Q + 2K
                  per token (Q, K: heads, kv heads x head_dim over the tensor axes), once forward, once backward
                  (their transposes) and once more in a remat recompute (any policy but none/minimal). The small
                  all-gathers of the RoPE angles and segment ids over `sequence` are left out.
  context         ring attention (layers/ring_attention.py): per layer, C - 1 collective-permutes of the local
                  K and V chunks (+ int32 segment ids) forward, again in a remat recompute, again in the backward
                  ring, which also passes the float32 dK and dV C times (they travel home). At C = 2 XLA folds
                  the two shifts of the first step's dK, dV (a permute applied twice is the identity) and hoists
                  the segment-id permute out of the layer loop, so it moves less; the plan counts the general
                  ring. The balanced
                  chunk order is applied at model entry and exit with a gather along the length, which XLA
                  lowers to an all-gather of [batch, length, embed] over context (2 per step, seen on XLA:CPU).
  stage           collective-permute of [microbatch, length, E] per pipeline iteration, forward and backward:
                  2 x iterations x k. (XLA:CPU lowers the backward roll as two permutes, and moves small
                  position and segment-id slices too, so its compile moves more.)
  expert          MoE all-to-alls, only when the config has experts (tests/test_plan.py holds them to XLA:CPU's
                  compiled step). Dropping: dispatch and combine, each the
                  [experts, groups, capacity, E] buffer, ~[tokens x top-k x capacity_factor, E]; 2 per MoE layer
                  forward, 3 backward (the gradients to the experts and to the tokens, and the experts' output
                  moved to the token layout for the router's gradient through the combine weights); a policy that
                  recomputes the layer (full, save_*) moves dispatch and combine again and the backward reuses
                  the second: 6. Dropless (grouped, `layers/moe_grouped.py`): the fixed exchange buffer
                  [expert shards x tokens x min(top-k, experts per shard), E] there and back, 2 forward, 2 backward,
                  +2 under any policy but none (dots_saveable keeps no all-to-all result); plus the int32 row
                  counts [experts], once per forward and recompute. The ragged exchange (`moe_exchange: ragged`,
                  TPU and GPU) moves only the rows routed, [tokens x top-k, E] when balanced, as often. The
                  all-experts reference (dense) has none.
Small reductions (loss sums, the cross-entropy max and sum over a sharded vocabulary, gradient norms) are left out.
How each count compares with compiled steps: benchmarks/README.md, "The collectives plan against compiled steps".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

import jax
import numpy as np

from maxshard.config import Config
from maxshard.model import trainable
from maxshard.spec import blocks, pipeline_schedule, remat
from maxshard.model.layers.moe import capacity, group_size
from maxshard.model.layers.moe_grouped import exchange_slots
from maxshard.observe.report import Report
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import ParamLayout
from maxshard.planning.axes import rule_axes

__all__ = ["Collective", "Geometry", "geometry", "planned_collectives", "shards", "dim_axes", "token_axes", "STACKED"]

STACKED = (ax.LAYERS, ax.UNSTAGED_LAYERS)  # the leading axis of a scanned stack (spec/blocks.py)
# How XLA partitions the lookup's gradient when the table is sharded over the vocabulary *and* gather axes changed
# with jax 0.12 (what Python 3.12 installs; docs/toolchains.md): see "The token embedding" in the module docstring.
_SCATTERS_INTO_VOCAB_SHARDS = jax.__version_info__ >= (0, 12)


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute
    axes: tuple[str, ...]  # the mesh axes of the device group (sizes > 1 only)
    bytes: float  # full-buffer bytes per device, summed over the step
    what: str  # why it happens, for the printout


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What one device holds between layers, and the schedule sizes the counts need."""

    tokens: int  # [batch, length] positions per device in the decoder, summed over accumulation microbatches
    outer_tokens: int  # the same for the embedding and the output head (batch may also split over `stage`)
    layers: int  # stacked units one device runs (num_layers, or per stage)
    accumulation: int  # k
    stages: int  # S
    microbatches: int  # M (1 without a pipeline)
    repeats: int  # R (1 without a pipeline)
    compute_itemsize: int
    moe_layers: int  # MoE layers one device runs
    iterations: int  # the pipeline schedule's iterations (1 without a pipeline)
    bubble_fraction: float  # the schedule's (0.0 without a pipeline)
    kept_inputs: int  # microbatch stage inputs the backward keeps per stage, the schedule's (0 without a pipeline)
    buffer_microbatches: int  # microbatches in the schedule's circulation buffer (0 without a pipeline)


def shards(axes: Iterable[str], sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[a] for a in axes)


def token_axes(cfg: Config, sizes: Mapping[str, int], outer: bool) -> set[str]:
    """Mesh axes that split the [batch, length] positions: of the decoder's activations, or (`outer`) of the
    embedding and the output head (ax.EMBEDDED, whose batch may also split over `stage`)."""
    batch, array = (ax.EMBED_AND_LOGITS_BATCH, ax.EMBEDDED) if outer else (ax.BATCH, ax.QUERY)
    return set(rule_axes(cfg, batch, sizes, array)) | set(rule_axes(cfg, ax.LENGTH, sizes, array))


def geometry(cfg: Config, sizes: Mapping[str, int], compute_itemsize: int) -> Geometry:
    """Token and layer counts per device for `cfg` on a mesh of `sizes`."""
    length = cfg.max_target_length // shards(rule_axes(cfg, ax.LENGTH, sizes), sizes)
    batch = cfg.global_batch_size // shards(rule_axes(cfg, ax.BATCH, sizes), sizes)
    outer = cfg.global_batch_size // shards(rule_axes(cfg, ax.EMBED_AND_LOGITS_BATCH, sizes), sizes)
    outer_length = cfg.max_target_length // shards(rule_axes(cfg, ax.LENGTH, sizes, ax.EMBEDDED), sizes)
    pipe = cfg.model.pipeline
    schedule = pipeline_schedule.of(pipe) if pipe is not None else None
    stages = pipe.stages if pipe is not None else 1
    microbatches, repeats = (pipe.microbatches, pipe.repeats) if pipe is not None else (1, 1)
    # The main stack is split over the stages; the other stacks (dense first layers, the layers a pattern leaves
    # over) and the multi-token prediction modules' layers run outside the pipeline, on every stage.
    stacks = blocks.stacks(cfg.model)
    main = blocks.main_stack(cfg.model)
    extra = sum(s.num_layers for s in stacks if s.name != blocks.MAIN_STACK) + cfg.model.mtp_depth
    extra_moe = cfg.model.mtp_depth if main.unit[-1].routed else 0
    return Geometry(
        tokens=batch * length,
        outer_tokens=outer * outer_length,
        layers=extra + main.num_layers // stages,
        accumulation=cfg.gradient_accumulation_steps,
        stages=stages,
        microbatches=microbatches,
        repeats=repeats,
        compute_itemsize=compute_itemsize,
        moe_layers=cfg.model.num_moe_layers // stages + extra_moe,
        iterations=schedule.iterations if schedule else 1,
        bubble_fraction=schedule.bubble_fraction if schedule else 0.0,
        kept_inputs=schedule.kept_inputs if schedule else 0,
        buffer_microbatches=schedule.buffer_microbatches if schedule else 0,
    )


# --------------------------------------------------------------------------------------------- weights


def dim_axes(p: ParamLayout, sizes: Mapping[str, int]) -> list[tuple[str | None, tuple[str, ...]]]:
    """(logical name, mesh axes of size > 1) per dimension of a parameter."""
    out = []
    for i, logical in enumerate(p.logical_axes):
        entry = p.spec[i] if i < len(p.spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append((logical, tuple(a for a in axes if sizes.get(a, 1) > 1)))
    return out


def _weight_collectives(cfg: Config, p: ParamLayout, sizes: Mapping[str, int], geo: Geometry) -> list[Collective]:
    """Gathers and gradient reductions of one parameter (see the module docstring)."""
    dims = dim_axes(p, sizes)
    stacked = any(logical in STACKED for logical, _ in dims)
    owned = {a for logical, axes in dims if logical in (ax.EXP, *STACKED) for a in axes}
    sharded = {a for _, axes in dims for a in axes}
    batch = token_axes(cfg, sizes, outer=not stacked)
    gather = tuple(a for a in sizes if a in sharded and a in batch and a not in owned)
    reduce_only = tuple(a for a in sizes if a in batch and a not in sharded)
    lookup = p.name.endswith("token_embed/embedding") and not cfg.logits_via_embedding
    k, shard = geo.accumulation, p.bytes_per_device * _grad_itemsize(p, lookup, geo) / np.dtype(p.dtype).itemsize
    trains = trainable.is_trainable(cfg.model, p.name)  # a frozen weight (LoRA's base) has no gradient to reduce
    out = []
    vocab = tuple(a for logical, axes in dims if logical == ax.VOCAB for a in axes)
    if gather and lookup and vocab and _SCATTERS_INTO_VOCAB_SHARDS:
        out.append(Collective("all-to-all", gather, geo.outer_tokens * cfg.emb_dim * geo.compute_itemsize,
                              "embedding rows, forward"))
        if trains:
            out.append(Collective("all-reduce", gather, k * p.bytes_per_device * shards(gather, sizes),
                                  "embedding gradient over the gather axes"))
            out.append(Collective("collective-permute", tuple(a for a in sizes if a in gather or a in vocab),
                                  k * p.bytes_per_device, "embedding gradient into its shard"))
    elif gather and lookup:
        rows = geo.outer_tokens * cfg.emb_dim * (geo.compute_itemsize + np.dtype(p.dtype).itemsize)
        out.append(Collective("all-to-all", gather, rows, "embedding rows, forward and backward"))
        if vocab and trains:  # XLA scatters into the whole vocabulary, then all-reduces it over the vocabulary axes
            whole = p.bytes_per_device * shards(vocab, sizes)
            out.append(Collective("all-reduce", vocab, k * whole, "embedding gradient over the vocabulary"))
    elif gather:
        passes = 2 * k * geo.iterations / geo.repeats if stacked else k
        gathered = p.bytes_per_device * shards(gather, sizes) * geo.compute_itemsize / np.dtype(p.dtype).itemsize
        out.append(Collective("all-gather", gather, passes * gathered, "weights" if stacked else "head weights"))
        scatters = passes / 2 if stacked else k  # the gradient of each forward gather
        if trains:
            out.append(Collective("reduce-scatter", gather, scatters * shard * shards(gather, sizes),
                                  "weight gradients"))
    if reduce_only and trains:
        out.append(Collective("all-reduce", reduce_only, k * shard, "weight gradients"))
    return out


def _grad_itemsize(p: ParamLayout, lookup: bool, geo: Geometry) -> int:
    """Bytes per gradient element where it is reduced: at the matmul's output, in the compute dtype; norm scales
    (applied in float32) and the embedding table (a float32 lookup, cast afterwards) in their own dtype."""
    if lookup or ax.NORM in p.logical_axes:
        return np.dtype(p.dtype).itemsize
    return geo.compute_itemsize


# --------------------------------------------------------------------------------------------- activations


def _recompute_count(policy: str) -> int:
    """Tensor-parallel all-reduces (of 2 per layer: the attention output's and the MLP's) that a remat policy
    recomputes in the backward pass: those of the parts it re-runs (maxshard/spec/remat.py)."""
    p = remat.policy(policy)
    return ("out" in p.recomputes) + ("mlp" in p.recomputes)


# Under sequence-parallel residuals (layers/decoder.py), per layer and [tokens, E] of the compute dtype, as XLA:TPU
# compiles a tiny model (XLA:CPU the same for `none`; benchmarks/README.md, "The collectives plan against compiled
# steps"): the reductions of the row-parallel outputs and column-parallel input gradients (a
# recompute adds the attention output's, never the MLP's, whose output the backward does not need), and the gathers
# of the residual stream before each projection, forward and backward, again in a recompute. Plus 2 for the head.
# In remat.py's terms: 4 reduces, 5 when the output projection is recomputed (save_qkv_proj, full); 6 gathers, 9 when
# the whole layer is (full). An offload policy counts as the policy it is `like`.
_SP_REDUCES, _SP_REDUCES_RECOMPUTED_OUT = 4, 5
_SP_GATHERS, _SP_GATHERS_RECOMPUTED_LAYER = 6, 9
_SP_HEAD_GATHERS = 2


def _sp_counts(policy: str) -> tuple[int, int]:
    """(all-reduces, all-gathers) per layer under sequence-parallel residuals (the measured counts above)."""
    p = remat.policy(policy)
    reduces = _SP_REDUCES_RECOMPUTED_OUT if "out" in p.recomputes else _SP_REDUCES
    gathers = _SP_GATHERS_RECOMPUTED_LAYER if set(p.recomputes) == set(remat.PARTS) else _SP_GATHERS
    return reduces, gathers


def _tensor(cfg: Config, report: Report, sizes: Mapping[str, int], geo: Geometry) -> list[Collective]:
    model_axes = set(rule_axes(cfg, ax.ACT_HEADS, sizes)) | set(rule_axes(cfg, ax.ACT_MLP, sizes))
    axes = tuple(a for a in sizes if a in model_axes)
    if not axes:
        return []
    act = geo.tokens * cfg.emb_dim * geo.compute_itemsize
    if model_axes <= set(rule_axes(cfg, ax.NORM_LENGTH, sizes)):  # the residual's length is split over them
        reduces, gathers = _sp_counts(cfg.remat_policy)
        out = [Collective("all-reduce", axes, reduces * geo.layers * act, f"layer activations ({reduces} per layer)"),
               Collective("all-gather", axes, (gathers * geo.layers + _SP_HEAD_GATHERS) * act,
                          f"residual stream before projections ({gathers} per layer) and the head")]
    else:
        per_layer = 4 + _recompute_count(cfg.remat_policy)
        out = [Collective("all-reduce", axes, per_layer * geo.layers * act,
                          f"layer activations ({per_layer} per layer)")]
    vocab = {a for p in report.params for logical, dim in dim_axes(p, sizes) if logical == ax.VOCAB for a in dim}
    vocab_axes = tuple(a for a in sizes if a in vocab)
    if vocab_axes:
        table = next(p for p in report.params if p.name.endswith("token_embed/embedding"))
        rows = geo.outer_tokens * cfg.emb_dim * (np.dtype(table.dtype).itemsize + geo.compute_itemsize)
        out.append(Collective("all-reduce", vocab_axes, rows, "embedding output, head input gradient"))
    return out


def _sequence(cfg: Config, sizes: Mapping[str, int], geo: Geometry) -> list[Collective]:
    context = set(rule_axes(cfg, ax.ATTN_LENGTH, sizes))
    axes = tuple(a for a in rule_axes(cfg, ax.LENGTH, sizes) if a not in context)
    if not axes:
        return []
    q_local = cfg.num_heads // shards(rule_axes(cfg, ax.ACT_HEADS, sizes), sizes) * cfg.head_dim
    kv_local = cfg.num_kv_heads // shards(rule_axes(cfg, ax.ACT_KV_HEADS, sizes), sizes) * cfg.head_dim
    per_pass = geo.tokens * (2 * q_local + 2 * kv_local) * geo.compute_itemsize
    passes = 2 + (not remat.policy(cfg.remat_policy).keeps_matmul_outputs)
    return [Collective("all-to-all", axes, passes * geo.layers * per_pass, "attention: length <-> heads")]


def _context(cfg: Config, sizes: Mapping[str, int], geo: Geometry) -> list[Collective]:
    axes = rule_axes(cfg, ax.ATTN_LENGTH, sizes)
    if not axes:
        return []
    ring = shards(axes, sizes)
    sequence = shards(rule_axes(cfg, ax.LENGTH, sizes), sizes) // ring
    kv_local = cfg.num_kv_heads // shards(rule_axes(cfg, ax.ACT_KV_HEADS, sizes), sizes) * cfg.head_dim
    chunk = geo.tokens * kv_local * geo.compute_itemsize  # one of K, V on one device
    step = 2 * chunk + geo.tokens * sequence * 4  # K, V and the int32 segment ids
    passes = 2 + (not remat.policy(cfg.remat_policy).keeps_matmul_outputs)
    grads = ring * 2 * geo.tokens * kv_local * 4  # float32 dK, dV, C shifts
    total = geo.layers * (passes * (ring - 1) * step + grads)
    embed = geo.tokens * sequence * ring * cfg.emb_dim * geo.compute_itemsize  # [batch, whole length, embed]
    return [Collective("collective-permute", axes, total, "ring attention: K/V chunks and their gradients"),
            Collective("all-gather", axes, 2 * embed, "balanced layout at model entry and exit")]


def _stage(cfg: Config, sizes: Mapping[str, int], geo: Geometry) -> list[Collective]:
    if geo.stages == 1:
        return []
    microbatch = geo.tokens // (geo.accumulation * geo.microbatches) * cfg.emb_dim * geo.compute_itemsize
    count = 2 * geo.iterations * geo.accumulation
    axes = rule_axes(cfg, ax.ACT_STAGE, sizes)
    return [Collective("collective-permute", axes, count * microbatch, f"stage shift ({count} per step)")]


def _expert(cfg: Config, sizes: Mapping[str, int], geo: Geometry) -> list[Collective]:
    if not cfg.model.is_moe or geo.moe_layers == 0:
        return []
    axes = rule_axes(cfg, ax.ACT_EXP if cfg.capacity_factor > 0 else ax.EXP, sizes)  # the exchange's, as compiled
    ways = shards(axes, sizes)
    if ways == 1:
        return []
    k, experts, row = cfg.num_experts_per_tok, cfg.num_experts, cfg.emb_dim * geo.compute_itemsize
    if cfg.capacity_factor > 0:
        g = group_size(cfg.max_target_length, cfg.moe_group_size)
        rows = geo.tokens // g * experts * capacity(g, k, experts, cfg.capacity_factor)  # [experts, groups, C]
        count = 5 if remat.policy(cfg.remat_policy).keeps_matmul_outputs else 6
        return [Collective("all-to-all", axes, count * geo.moe_layers * rows * row,
                           f"MoE dispatch and combine ({count} per layer)")]
    if cfg.moe_dropless_impl == "dense":
        return []
    rows = ways * exchange_slots(geo.tokens, k, experts // ways)  # summed over microbatches: linear in tokens
    if cfg.model.moe_exchange == "ragged":
        rows = geo.tokens * k  # what a balanced routing moves; the receive buffer's padding stays put
    forwards = 1 if remat.policy(cfg.remat_policy).keeps == "everything" else 2  # the forward, and its recompute
    moves = 2 * forwards + 2  # there and back per forward, and the transposes of one pair backward
    counts = forwards * geo.moe_layers * geo.accumulation * geo.microbatches * experts * 4  # int32 [experts]
    return [Collective("all-to-all", axes, moves * geo.moe_layers * rows * row + counts,
                       f"MoE dropless exchange ({moves} per layer) and row counts")]


def planned_collectives(cfg: Config, report: Report, sizes: Mapping[str, int], geo: Geometry) -> list[Collective]:
    """Every collective of one train step (see the module docstring for the model)."""
    out = [c for p in report.params for c in _weight_collectives(cfg, p, sizes, geo)]
    out += _tensor(cfg, report, sizes, geo) + _sequence(cfg, sizes, geo) + _context(cfg, sizes, geo)
    return out + _stage(cfg, sizes, geo) + _expert(cfg, sizes, geo)
