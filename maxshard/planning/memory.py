"""Activation memory of one train step per device: what the compiled step holds besides parameters and optimizer
state, counted from the layer shapes under the `remat_policy`, and checked against XLA.

Everything is per device. Per token (one [batch, length] position a device holds), with per-device widths
E = emb_dim, Q = heads x head_dim, K = kv_heads x head_dim, F = mlp_dim (heads, kv heads and mlp divided by their
tensor shards), H = query heads per device, A = H x L attention scores per query (L: the keys one query sees),
s = the compute dtype's itemsize:

    dense  = (7E + 3Q + K + 6F) x s   what one layer keeps for its backward without remat: the norms' outputs
                                      and scales, the residual, rotated q, the grouped q, v, the attention output,
                                      SwiGLU's gate, up, their product and silu's own residuals (the residuals
                                      `jax.ad_checkpoint.saved_residuals` lists, as XLA deduplicates them);
                                      + E x s under tensor parallelism (a partial sum before its reduction);
                                      with the residual stream's length split r ways beyond the activation
                                      length's (tensor_sequence: layers/decoder.py), 5 of the 7E are E / r
                                      and 2 stay whole (attention's and the MLP's inputs, gathered back)
    attention, dot_product: 8 A bytes (float32 exponentials and probabilities); a fused kernel (ring, or a row
                                      of spec/attention_kinds.py fused on the device kind's platform) keeps its
                                      output and float32 log-sum-exp instead: Q x s + 4 H

    what a policy saves per layer and token (maxshard/spec/remat.py names what each keeps):
        none               dense + attention; on XLA:TPU with a fused kernel what it keeps instead
                           (`Fitted.kept_without_remat`, widths.py `kept_bytes`): the norms' inputs as six float32
                           and two compute-dtype E-wide values, 5 Q-wide, 4 K-wide, 6F, and the float32
                           log-sum-exp
        minimal            matmul outputs: (2E / r + 2Q + 2K + 2F) x s + float32 scores 4 A (fused: log-sum-exp 4 H)
        save_qkv_out_proj  layer input + q, k, v + output projection: (E / r + E + Q + 2K) x s
        save_qkv_proj      (E / r + Q + 2K) x s
        save_out_proj      (E / r + E) x s
        full               E / r x s (the layer input, a piece of the residual stream)
        offload_*          nothing on the device; in host memory what the policy it is `like` saves (the layer
                           input included), counted apart (`host`): not part of the device peak. Only where the
                           compiler moves it (`OFFLOADING`): XLA:CPU keeps it on the device, as the `like` policy
        + options          what the model's layer options (qk_norm, shared experts, LoRA: every ModelConfig field
                           the formula does not take, model/residuals.py) add, traced rather than written down: the
                           token-proportional residuals of one stacked unit under the policy, at one device's heads,
                           kv heads and mlp (blockwise attention for a fused kernel), less the same unit's with the
                           options at their defaults (0 then, and nothing traced). XLA:CPU keeps what is traced;
                           XLA:TPU keeps more under none, as its tiles store values (benchmarks/README.md, "Layer
                           options in the activation plan"). What the options add without remat less what
                           the policy saves of them is what the unit's backward re-runs: it joins the working set,
                           per layer of the unit (a layer kind such as gated DeltaNet is an option, traced against
                           the attention layer it replaces: its scores leave the working set, its own values join)

    the backward of one layer (its working set, while the layer is recomputed and differentiated) is measured, not
    derived: XLA fuses and frees its pieces in an order no formula follows. XLA_CPU_WORKING holds, per policy, the
    fraction of `dense`, the bytes per attention score and the mlp widths it takes on XLA:CPU, fitted
    on the widths and lengths of tests/test_plan_memory.py, + 3E x s under tensor parallelism (the column-parallel
    projections' input gradients before they are reduced); the fused kernels' backward is counted from
    layers/blockwise_attention.py instead (block q, output, dq, stacked dk/dv in float32 and the log-sum-exp:
    Q(5s + 8) + K(4s + 8) + 12 H per token, plus one float32 score block per sequence a device holds (splash on
    XLA:TPU: what its calls write as block-sized float32 outputs per sequence and kv head instead, read off the
    installed kernel, planning/splash_outputs.py: 0 for a kernel that keeps them in scratch); the ring over
    C context shards adds (C - 1)(4Q + K(2s + 8)): its unrolled steps each hold a K/V chunk, dq, dK and dV).

    unit        a stacked unit of n layers (spec/blocks.py: an MoE interval, an attention pattern; Gemma 3's is 6)
                is rematerialised as one, so its backward re-runs the whole unit's forward: working = one layer's
                + (n - 1) x what a layer keeps without remat less what the policy saves (x `Fitted.unit_kept`,
                the share of it XLA:TPU allocates). Under none nothing re-runs, and XLA:CPU holds n layers' working
                sets (tests/test_plan_memory.py)

    local layers (sliding window, spec/blocks.py) hold what their kernel holds, and no kernel's memory follows the
                window: dot_product masks the whole [q, kv] scores (A as for a global layer), a fused kernel keeps
                one block and a log-sum-exp per query whatever keys it visits (a window skips blocks: FLOPs,
                model/flops.py, not memory). What a window bounds is generation's KV cache, a local layer needing
                only `sliding_window` slots: GRPO's sampling cache is traced from the model's own cache
                (planning/rollout_memory.py), so the plan holds what layers/kv_cache.py keeps

    activations = layers x tokens x saved + tokens x working (of a unit) + head + gathered + the MoE, pipeline and
                  accumulation terms below; on XLA:TPU (`FITTED`) max(head, tokens x working + block) instead of
                  their sum, + `cast` (the weights in the compute dtype), and q, k, v as the tiled layout stores
                  them (`Widths.stored`)

    head        the logits [tokens, vocab / tensor] in float32 and their gradient, of one of `loss_chunks` pieces;
                with tied embeddings on XLA:TPU also the table whole in the compute dtype twice (`Fitted.head_weights`);
                over pieces of split tokens, the head (or the tied table) whole instead, and its gradient whole
                until its one reduction (`gather_memory.grouped_head_bytes`)
    gathered    one stacked unit's weights after the fsdp all-gather, in the compute dtype (what the layer being
                computed holds whole); an MoE unit's expert weights twice (their gradient is also whole until it
                is reduce-scattered); `Fitted.gathered_units` units of them; on XLA:TPU instead two copies of the
                unit's largest layer (its weights and their whole gradient, `Fitted.gathered_layers`, `gathered_bytes`)
    MoE layer   (kept per layer by none; by minimal only its matmul outputs, r (2E + 2F) x s)
                with token dropping, per token: the dispatch and combine masks, 2 g k c float32 (g tokens per
                group, c = capacity_factor), and the expert activations k c (2E + 3F) x s in place of the dense
                MLP's (beside it with `moe_beside_mlp`); dropless (grouped matmuls), the rows each device
                computes, r = k, or p x min(k, experts per device) with expert parallelism over p devices (the
                fixed exchange buffer; the ragged one's is min(that, k x moe_ragged_buffer_factor)), each held as
                sorted, sent, received and returned copies and through the tiled SwiGLU: r (6E + 7F) x s
                (measured on the fixed exchange)
                XLA:TPU differentiates the MoE layer as a phase of its own: the unit holds the larger of its
                measured rows and the layer's working set less the dense MLP's share (planning/moe_memory.py
                `working_bytes`, `Fitted.moe_rows`)
    gaps        XLA:TPU's heap fragments with the MoE layers' stacked values: `Fitted.moe_stack_gaps` x the MoE
                layers' float32 gradient and compute-dtype weights per device (`moe_memory.stack_bytes`), a term
                that grows with the MoE depth as the compiled peaks do (a dense stack's gaps stay flat)
    prediction  each multi-token prediction module (`mtp_depth`): its layer as one more saved layer, its head's
                logits and their gradient as the main head's; on XLA:CPU every module after the first also
                a layer working set where the policy recomputes the layer (`Fitted.mtp_working_sets`), and
                the first module a policy's share of one (`Fitted.mtp_first_working`)
    frozen      with LoRA (the base weights frozen, no weight gradients) the layer's working set is
                `Fitted.frozen_working` of it (no weight gradients to form); a frozen head grouped over
                the token shards is gathered in the compute dtype where the compiler casts first
                (`Fitted.frozen_head_cast`, `gather_memory.grouped_head_bytes`)
    accumulation  with k > 1 microbatches, one microbatch's activations at a time (tokens / k in whole
                sequences: a microbatch smaller than the batch shards still holds one per device) and one more
                float32 gradient buffer (the running sum)
    pipeline    the schedule's kept stage inputs (circular: one per iteration, M x R + S - 1), each one microbatch's
                [microbatch tokens, E] and what the policy saves of the stage's layers but their first layer's
                input, which is the kept stage input (none saves matmul outputs there: see layers/pipeline.py);
                the working set is one stage's layers' on one microbatch; plus the
                schedule's circulation buffer, `buffer_microbatches` microbatches (circular: all M, [tokens, E]).
                The circular pipeline's loss is planned with the stages' float32 gradients and cast weights beside
                it: since the loss groups its head, XLA:TPU's heap holds them at the loss-phase peak (planning the
                loss without them under-planned; benchmarks/README.md, "Held-out shapes")

What the plan leaves out (a few % of XLA:CPU's temporaries in the grid of tests/test_plan_memory.py): the
embedding's gradient buffers, loss reductions and XLA's fusion scratch; and what layer options add to one layer's
working set, which is no fixed share of what they add to `dense`, so no formula on the traced residuals holds it
(benchmarks/README.md, "Layer options in the activation plan").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from maxshard.config import Config
from maxshard.model import residuals, trainable
from maxshard.spec import blocks, remat
from maxshard.parallel import axis_names as ax
from maxshard.planning import moe_memory
from maxshard.planning.axes import rule_axes
from maxshard.planning.fitted import compiler, effective_policy, fitted, policies
from maxshard.planning.traffic import Geometry, geometry
from maxshard.planning.widths import Widths, split, widths

__all__ = ["ActivationTerms", "gathered_bytes", "activation_terms", "compiler", "policies",
           "effective_policy", "logits_bytes", "auto_loss_chunks"]

# `loss_chunks: 0` (auto) splits the loss until one piece's float32 logits per device fit this (training/loss.py).
LOSS_PIECE_BYTES = 256 * 2**20

# ActivationTerms fields `total` leaves out (host: as_json keeps it)
_NOT_TERMS = ("host", "head_apart", "head_table", "head_grouped", "moe_stack")


@dataclasses.dataclass(frozen=True)
class ActivationTerms:
    """The planned activation memory per device, by term (bytes); `total` is what the plan adds to the state."""

    saved: float  # residuals every layer keeps for the backward pass
    working: float  # one layer's (or pipeline iteration's) backward
    head: float  # logits and their gradient
    gathered: float  # one unit's weights after the fsdp all-gather
    moe: float  # dispatch masks and expert activations beyond the dense MLP's (XLA:TPU: may be < 0, moe_memory.py)
    pipeline: float  # per-iteration stage inputs and the circulation buffer
    accumulation: float  # the running gradient sum
    block: float  # the fused attention kernels' block-sized float32 buffers (Widths.block_bytes)
    cast: float = 0.0  # the sharded weights cast to the compute dtype, where the compiler keeps them (Fitted)
    gaps: float = 0.0  # the heap's gaps beside the MoE layers' stacked values (`Fitted.moe_stack_gaps`)
    host: float = 0.0  # what an offload policy moves to host memory: not device memory, not in `total`
    head_apart: bool = False  # Fitted.head_apart: `head` and `working + block` are not live together
    head_table: float = 0.0  # the tied embedding table gathered whole (`gather_memory.gathered_head_bytes`): `head` has
    # `Fitted.head_weights` of it; kept for `estimate.activations_under`, not a term of its own
    head_grouped: tuple[float, float] = (0.0, 0.0)  # `gather_memory.grouped_head_bytes`, kept likewise
    moe_stack: float = 0.0  # `moe_memory.stack_bytes`, kept likewise (`gaps` has `Fitted.moe_stack_gaps` of it)

    @property
    def total(self) -> int:
        """Device bytes: every term but `host`; with `head_apart`, the larger of `head` and `working + block`."""
        device = sum(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_TERMS)
        if self.head_apart:
            device -= min(self.head, self.working + self.block)
        return int(device)

    def as_json(self) -> dict[str, int]:
        """The byte terms."""
        return {k: int(v) for k, v in dataclasses.asdict(self).items() if k not in _NOT_TERMS[1:]}


def _local_length(cfg: Config, sizes: Mapping[str, int], array: tuple[str | None, ...] = ax.QUERY) -> int:
    """The positions of a sequence one device holds in `array` (default: the decoder's activations): the length
    split over the mesh axes its rules give it there."""
    return split(cfg.max_target_length, rule_axes(cfg, ax.LENGTH, sizes, array), sizes)


def logits_bytes(cfg: Config, sizes: Mapping[str, int], geo: Geometry | None = None) -> int:
    """The float32 logits of one microbatch on a device, [tokens, vocab / vocab shards] x 4 bytes, whole."""
    geo = geo or geometry(cfg, sizes, 4)
    local_length = _local_length(cfg, sizes, ax.LOGITS)
    vocab = split(cfg.vocab_size, rule_axes(cfg, ax.ACT_VOCAB, sizes), sizes)
    return _microbatch_tokens(geo.outer_tokens, local_length, geo.accumulation) * vocab * 4


def auto_loss_chunks(cfg: Config, sizes: Mapping[str, int]) -> int:
    """The fewest pieces (a power of two) that bring one piece's logits within LOSS_PIECE_BYTES per device.

    A piece count divides the device's share of the length, so every strided piece still spans all the length
    shards (maxshard/training/loss.py); where the length allows no further split the count stops there."""
    whole, local_length = logits_bytes(cfg, sizes), _local_length(cfg, sizes, ax.LOGITS)
    chunks = 1
    while whole / chunks > LOSS_PIECE_BYTES and local_length % (2 * chunks) == 0:
        chunks *= 2
    return chunks


def _microbatch_tokens(tokens: int, length: int, accumulation: int) -> int:
    """Tokens of one accumulation microbatch on a device: whole sequences, so a microbatch smaller than the batch
    shards still holds one sequence per device (XLA pads the uneven split)."""
    sequences = max(tokens // length, 1)
    return -(-sequences // accumulation) * length


def gathered_bytes(cfg: Config, unit_bytes: float, layer_bytes: float = 0.0) -> float:
    """What the fsdp gathers hold at the peak: `unit_bytes` (`gather_memory.gathered_unit_bytes`) x the units the
    compiler keeps gathered (`Fitted.gathered_units`), or `layer_bytes` (the unit's largest layer) x
    `Fitted.gathered_layers` where the compiler has that."""
    f = fitted(compiler(cfg))
    return layer_bytes * f.gathered_layers if f.gathered_layers else unit_bytes * f.gathered_units


def activation_terms(cfg: Config, sizes: Mapping[str, int], geo: Geometry, gathered: float,
                     gradients: float, params: float = 0.0, head_weights: float = 0.0,
                     grouped_head: tuple[float, float] = (0.0, 0.0), moe_stack: float = 0.0) -> ActivationTerms:
    """The terms of the module docstring. `gathered`: what the fsdp gathers hold (`gathered_bytes`); `gradients`:
    the gradient bytes per device (for accumulation); `params`: the parameter bytes per device (for the
    compute-dtype copy a compiler may keep, `Fitted.weight_cast`); `moe_stack`: the MoE layers' gradient and cast
    weights per device (`moe_memory.stack_bytes`)."""
    w, size, target = widths(cfg, sizes), geo.compute_itemsize, compiler(cfg)
    policy = effective_policy(cfg.remat_policy, target)
    local_length = _local_length(cfg, sizes)
    tokens = _microbatch_tokens(geo.tokens, local_length, geo.accumulation)
    # every multi-token prediction module has its own head (layers/mtp.py): its logits and their gradient as the main one's
    heads = 1 + cfg.model.mtp_depth
    head = (heads * 2 * logits_bytes(cfg, sizes, geo) / max(cfg.loss_chunks, 1) + sum(grouped_head)
            + head_weights * fitted(target).head_weights)
    moe_per_layer = moe_memory.token_bytes(cfg, w, sizes, size)
    moe_share = geo.moe_layers / max(geo.layers, 1)  # MoE layers per unit run (a unit may hold several layers)
    per_layer = len(blocks.main_stack(cfg.model).unit)  # layers in one stacked unit
    accumulation = gradients if geo.accumulation > 1 else 0.0
    common = dict(head=head, gathered=gathered, accumulation=accumulation, cast=_cast_bytes(cfg, params, size),
                  head_apart=fitted(target).head_apart, head_table=head_weights, head_grouped=grouped_head,
                  gaps=moe_stack * fitted(target).moe_stack_gaps, moe_stack=moe_stack)
    if geo.stages > 1 or geo.microbatches > 1:
        terms = _pipeline_terms(cfg, w, geo, tokens, per_layer, moe_per_layer * moe_share, common)
        return terms
    frozen = _frozen_share(cfg)
    moe_dots = moe_memory.matmul_bytes(cfg, w, sizes, size)
    moe_saved = {"everything": moe_per_layer, "dots": moe_dots}.get(policy.keeps, 0.0)
    layer_working = w.working_bytes(policy, size, target)
    # the prediction modules: a layer working set each after the first where the compiler holds one (`Fitted`): the
    # recomputed layer of one beside the next one's backward, so not under none, which recomputes nothing; and the
    # first module's share where the policy has one (`Fitted.mtp_first_working`)
    modules = 0.0
    if cfg.model.mtp_depth and policy.keeps != "everything":
        f = fitted(target)
        modules = (cfg.model.mtp_depth - 1) * f.mtp_working_sets + f.mtp_first_working.get(policy.name, 0.0)
    options = _option_bytes(cfg, w, policy)
    terms = ActivationTerms(
        saved=geo.layers * tokens * (w.saved_bytes(policy, size) + options),
        working=tokens * max(w.unit_working_bytes(policy, size, target, per_layer) + modules * layer_working
                             + per_layer * _recomputed_option_bytes(cfg, w, policy, options), 0.0) * frozen,
        moe=geo.moe_layers * tokens * moe_saved + tokens * moe_memory.working_bytes(
            cfg, w, sizes, size, target, fitted(target).working[remat.on_device(policy).name], layer_working),
        pipeline=0.0,
        block=w.block_bytes(max(tokens // local_length, 1)),
        host=geo.layers * tokens * w.host_bytes(policy, size),
        **common,
    )
    return terms


def _stage_working(cfg: Config, w: Widths, policy: remat.Policy, itemsize: int, stage_layers: int) -> float:
    """One pipeline stage's backward working set per token. With several layers a stage (`layers_per_stage` > 1)
    its layers are one scan inside the iteration's checkpoint, not checkpointed again (layers/pipeline.py): the
    scan's backward holds every layer's residuals whole, what the policy saved included (a second copy, beside the
    saved ones), and the working set of the layer being differentiated: XLA:CPU's compiled step grows by what a
    layer keeps without remat per stage layer (benchmarks/README.md, "Held-out shapes", "Several layers a stage").
    One layer a stage: its working set alone."""
    layer = w.working_bytes(policy, itemsize, compiler(cfg))
    if cfg.model.pipeline.layers_per_stage == 1:
        return stage_layers * layer
    everything = remat.policy("none")
    return layer + stage_layers * (w.saved_bytes(everything, itemsize) + _option_bytes(cfg, w, everything))


def _option_bytes(cfg: Config, w: Widths, policy: remat.Policy) -> float:
    """What the model's layer options add to what a layer keeps under `policy`, per token (module docstring)."""
    kv_heads = math.gcd(w.heads, w.kv // cfg.head_dim)  # a whole group of query heads per kv head, as traced
    local = dataclasses.replace(cfg.model, num_heads=w.heads, num_kv_heads=kv_heads, mlp_dim=w.mlp,
                                moe_mlp_dim=w.expert if cfg.model.moe_mlp_dim else 0,
                                attention="blockwise" if w.fused else "dot_product",
                                remat_policy=remat.on_device(policy).name)
    return residuals.option_bytes(local)


def _recomputed_option_bytes(cfg: Config, w: Widths, policy: remat.Policy, saved: float) -> float:
    """What the layer options add, per token and layer, to what the unit's backward re-runs and holds under
    `policy`: their residuals without remat less what the policy saves of them (`saved`, `_option_bytes` under
    `policy`; both traced). A layer
    kind the formula does not count (gated DeltaNet's chunked delta rule, a test's toy) is such an option: traced
    against the standard layer it replaces, so what it re-runs is counted from its own trace and the attention
    scores it does not compute leave the working set (the term is negative then), with no constant of the kind's."""
    if policy.keeps == "everything":
        return 0.0
    return _option_bytes(cfg, w, remat.policy("none")) - saved


def _frozen_share(cfg: Config) -> float:
    """The share of a layer's backward working set the compiler holds for the run's layers: `Fitted.frozen_working`
    where their base weights are frozen (LoRA: model/trainable.py), else all of it."""
    return 1.0 if trainable.trains_everything(cfg.model) else fitted(compiler(cfg)).frozen_working


def _cast_bytes(cfg: Config, params: float, itemsize: int) -> float:
    """The compute-dtype copy of the sharded weights, where the compiler keeps one (`Fitted.weight_cast`) and the
    dtypes differ."""
    weight_itemsize = np.dtype(cfg.model.weight_dtype).itemsize
    if not fitted(compiler(cfg)).weight_cast or weight_itemsize == itemsize:
        return 0.0
    return params * itemsize / weight_itemsize


def _pipeline_terms(cfg: Config, w: Widths, geo: Geometry, tokens: int, per_layer: int, moe_per_layer: float,
                    common: dict) -> ActivationTerms:
    """A device runs `layers_per_stage` units per iteration on one microbatch, checkpointed per iteration."""
    size, target = geo.compute_itemsize, compiler(cfg)
    policy = effective_policy(cfg.remat_policy, target)
    if policy.keeps == "everything":  # layers/pipeline.py: none saves matmul outputs in a stage
        policy = remat.policy("minimal")
    microbatch = tokens // geo.microbatches
    stage_layers = cfg.model.pipeline.layers_per_stage * per_layer
    layer = w.saved_bytes(policy, size) + _option_bytes(cfg, w, policy)
    # the stage's first layer input is the iteration's kept input, counted once, in `pipeline`
    first_input = w.stream * size if policy.keeps == "names" and remat.LAYER_INPUT not in policy.host else 0
    inside = 0 if policy.name == "full" else stage_layers * layer - first_input
    local_length = cfg.max_target_length
    return ActivationTerms(
        saved=geo.kept_inputs * microbatch * inside,
        working=microbatch * _stage_working(cfg, w, policy, size, stage_layers) * _frozen_share(cfg),
        moe=microbatch * moe_per_layer * stage_layers,
        pipeline=(geo.kept_inputs + geo.buffer_microbatches) * size * microbatch * w.stream,
        block=w.block_bytes(max(microbatch // local_length, 1)),
        host=geo.kept_inputs * microbatch * stage_layers * w.host_bytes(policy, size),
        **common,
    )
