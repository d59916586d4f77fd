"""The step's loss and gradients under a table pipeline schedule (`pipeline_schedule: gpipe | 1f1b |
interleaved_1f1b | zero_bubble`), taken from the runner (model/layers/pipeline_runner.py) instead of `jax.grad`.

`Trainer._grads` asks `value_and_grad(trainer)` in place of `jax.value_and_grad(trainer._loss)` when `runs(cfg)`;
the function has the same signature and returns the same (loss, sums) and gradient trees, so gradient
accumulation, the optimizer and the metrics are the same code for every schedule, and circular's path is untouched.

The model splits in three around the stack: the first part (the embedding and the stack of dense first layers,
`first_k_dense_replace`; on stage 0, per microbatch, inside its forward; its gradient inside the stage's B), the
stages, and the last part (the layers a pattern leaves over, final norm, head, objective; the multi-token
prediction modules and their loss, `mtp_depth`, which read the microbatch's embedded tokens again there), which runs
on the last stage right after each microbatch's forward so that its backward can start at once (1F1B). Its output
head over loss pieces is grouped over the microbatch's token shards within the stage, as `Trainer._head` groups the
whole batch's (one gather and one reduction a microbatch, not one a piece: `_last_stage_groups`). No stage
holds the whole batch's activations: only the token ids and the other batch fields travel whole. A frozen DPO
reference is computed before, by the model's own forward (the circular order: the same function), and travels with
its microbatch. Under `quantization` the stages and stacks, applied as roots of their own, are quantized as the
Transformer is (`_Root`), and the Transformer's entry points the last part uses are intercepted already.

MoE router statistics: each stage returns what its layers sowed and its share of the router losses, computed by
moe_stats' own `loss_sums` and `objective` with the batch's weight split evenly over the MoE layers of the
R x S x M stage-microbatches (and the last part's, below; the loss is linear in the summed statistics:
each of them enters the circular pipeline's objective as weight_sum x its value / their number). The weight is the
objective's `weight_sum` of the whole call, known from the batch before the run; the runner's statistics
[R, M, S, ...] go where the circular pipeline puts them, so the sums, metrics and selection-bias moves are computed
as for the circular schedule.

The last part's MoE layers (a layer the attention pattern leaves over after the pipeline, and the prediction
modules' with `mtp_depth` on an MoE model) run per microbatch, where the circular pipeline runs them once on the
whole batch: each counts as one entry of the router statistics' mean, as there, and its z-loss and sequence-wise
loss are its microbatches' weighted by their share of the batch's real tokens and of its sequences holding one
(`_last_router_parts`), which add up to the whole batch's exactly. The Switch balance loss is a product of two
whole-batch means, whose backward would need every microbatch's routing before the first backward:
parallel/stages.py refuses its weight there, and its statistic (a metric) is the microbatches' mean. Loads, counts
and the selection biases' loads add up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.config import Config
from maxshard.model import quantization, trainable
from maxshard.spec import blocks, pipeline_schedule
from maxshard.model.layers import moe, moe_stats, mtp, pipeline_runner
from maxshard.model.layers.decoder import remat_policy, rematted, scanned_stack, stack_unit
from maxshard.model.layers.pipeline import _stage_class
from maxshard.model.transformer import scale_embedded
from maxshard.parallel import axis_names as ax
from maxshard.parallel import sharding
from maxshard.parallel.sharding import constrain
from maxshard.parallel.token_groups import TokenGroups
from maxshard.training.loss import GroupedHead, head_token_logps

__all__ = ["runs", "value_and_grad"]

_REFERENCE = "__reference_logps"  # the frozen reference's log-probabilities, beside the batch fields
_SHARE = "__router_loss_weight"  # each stage-microbatch's share of the call's weight_sum (MoE router losses)
_LAST_SHARE = "__last_router_loss_weight"  # the last part's MoE layers' share of it
_LAST_PARTS = "__last_router_parts"  # a microbatch's parts of the last part's router statistics [3]
_LAST_ROUTER = "__last_router_stats"  # the last part's router statistics, in its sums (summed over microbatches)
_RUNNER_FIELDS = (_REFERENCE, _SHARE, _LAST_SHARE, _LAST_PARTS)


def runs(cfg: Config) -> bool:
    """True when the run's gradients come from the table runner."""
    return cfg.model.pipeline is not None and cfg.model.pipeline.schedule != "circular"


def _split_stack(tree: Any) -> tuple[Any, Any]:
    """(the pipeline stack decoder/pipeline/layers, everything else); either may be {} (a LoRA split)."""
    tree = dict(tree or {})
    decoder = dict(tree.pop("decoder", {}))
    stack = decoder.pop("pipeline", {}).get("layers", {})
    if decoder:
        tree["decoder"] = decoder
    return stack, tree


def _join_stack(stack: Any, rest: Any) -> Any:
    if not stack:
        return rest
    decoder = {**rest.get("decoder", {}), "pipeline": {"layers": stack}}
    return {**rest, "decoder": decoder}


def _token_logps(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """`loss.token_logps` without a gather: XLA's SPMD partitioner aborts on the target gather from vocab-sharded
    logits inside a partially manual shard_map (tensor > 1), so the target's logit is a masked sum."""
    hit = jnp.arange(logits.shape[-1]) == targets[..., None]
    return jnp.sum(jnp.where(hit, logits, 0.0), axis=-1) - jax.nn.logsumexp(logits, axis=-1)


_LOOKUP_TOKENS = 1024  # tokens per piece of the one-hot lookup (bounds its [tokens, vocab] one-hot)


def _embed(module: Any, inputs: jax.Array) -> jax.Array:
    """The token embedding of one microbatch on stage 0, as one-hot matmuls over pieces of the sequence: XLA's SPMD
    partitioner aborts on the embedding's gather inside a partially manual shard_map once the table is split over
    two mesh axes (tensor > 1), while a matmul partitions under any layout. Exact: each output is one
    table row times 1.0 plus zeros. Its gradient is a matmul too (no scatter)."""
    embed = module.token_embed
    table = jnp.asarray(embed.embedding, embed.dtype)
    rows, length = inputs.shape
    pieces = max(1, length // _LOOKUP_TOKENS) if length % _LOOKUP_TOKENS == 0 else 1

    @jax.checkpoint  # the backward recomputes a piece's one-hot rather than keeping them all
    def lookup(ids: jax.Array) -> jax.Array:
        return jnp.einsum("btv,ve->bte", jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype), table)

    split = inputs.reshape(rows, pieces, length // pieces).swapaxes(0, 1)  # [pieces, rows, length / pieces]
    x = jax.lax.map(lookup, split).swapaxes(0, 1).reshape(rows, length, -1)
    return constrain(scale_embedded(x, module.cfg), ax.EMBEDDED)


def _side_stack(cfg: Any, name: str) -> nn.Module:
    """The stack `name` that runs outside the pipeline (dense first layers, the layers a pattern leaves over), as
    the decoder scans it (layers/decoder.py `scanned_stack`), unbound: applied to params decoder/<name>."""
    stack = blocks.stack_named(cfg, name)
    scanned = scanned_stack(stack, rematted(cfg, stack_unit(cfg, stack)))
    return scanned(cfg, cfg.compute_dtype, cfg.param_dtype, stack=name, parent=None)


class _Root(nn.Module):
    """`stack` (a stage, or a stack outside the pipeline) applied as its own root through a plain method, which qwix can
    intercept under `quantization`: qwix wraps a class's methods after unwrapping Linen's wrappers, and for a scanned
    module's `__call__` that strips the scan. The scope is shared: parameters and sown values keep their paths."""

    stack: nn.Module

    def setup(self) -> None:
        nn.share_scope(self, self.stack)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.stack(*args, **kwargs)


def _quantized(module: nn.Module, mode: str) -> nn.Module:
    """`module`, its matmuls quantized as the Transformer's are (model/quantization.py) when `mode` is not none."""
    return module if mode == "none" else quantization.quantize(_Root(module), mode)


def _run_stacks(modules: list[tuple[str, nn.Module]], params: Any, x: jax.Array, mb: dict) -> tuple[jax.Array, dict]:
    """(the stacks' output, what their MoE layers sowed, under decoder/<stack> as in the whole model)."""
    sown: dict = {}
    for name, module in modules:
        (x, _), values = module.apply({"params": params["decoder"][name]}, x, mb["segment_ids"], mb["positions"],
                                      mutable=[moe.STATS_COLLECTION])
        sown[name] = values.get(moe.STATS_COLLECTION, {})
    return x, {"decoder": sown}


def _fields(mb: dict) -> dict:
    """The batch fields the objective reads (the runner's own entries taken out)."""
    return {k: v for k, v in mb.items() if k not in _RUNNER_FIELDS}


def _last_stage_groups(trainer: Any) -> TokenGroups:
    """The token groups of a microbatch on the last stage (parallel/token_groups.py), called inside the runner's
    shard_map: its mesh is the abstract one there and its rules the runner's, both with `stage` manual, so the
    groups are the microbatch's batch and length shards within the stage."""
    rules = tuple(nn.get_logical_axis_rules())
    dims = sharding.mesh_axes(ax.LOGITS, rules, dict(trainer.mesh.shape))
    return TokenGroups(jax.sharding.get_abstract_mesh(), rules, dims[0], dims[1])


def _hidden_out(module: Any, y: jax.Array) -> jax.Array:
    return module.final_norm(y)


def _last_router_parts(segment_ids: jax.Array, microbatches: int) -> jax.Array:
    """[M, 3]: each microbatch's part of the last part's whole-batch router statistics: 1 / M of the balance
    loss (the microbatches' mean), its share of the real tokens (the z-loss is a mean over them) and of the
    sequences holding one (the sequence-wise loss is a mean over those); 0 where the batch has none."""
    real = pipeline_runner.split_microbatches(segment_ids != 0, microbatches)  # [M, rows, length]
    tokens = jnp.sum(real, axis=(1, 2)).astype(jnp.float32)
    sequences = jnp.sum(jnp.any(real, axis=2), axis=1).astype(jnp.float32)
    share = lambda part: part / jnp.maximum(jnp.sum(part), 1.0)  # noqa: E731
    return jnp.stack([jnp.full((microbatches,), 1.0 / microbatches), share(tokens), share(sequences)], axis=1)


def value_and_grad(trainer: Any) -> Callable[..., tuple[tuple[jax.Array, dict], Any]]:
    """(trained, batch, frozen, reference, totals) -> ((loss, sums), gradients of `trained`), as
    `jax.value_and_grad(trainer._loss, has_aux=True)` gives them."""
    cfg, model, objective = trainer.cfg, trainer.model, trainer.objective
    shape = cfg.model.pipeline
    table = pipeline_schedule.of(shape).table  # type: ignore[union-attr]
    layer = _quantized(_stage_class(stack_unit(cfg.model), shape.layers_per_stage)(
        cfg.model, cfg.model.compute_dtype, cfg.model.param_dtype, parent=None), cfg.quantization)
    policy = jax.checkpoint_policies.dots_saveable if cfg.model.remat_policy == "none" else \
        remat_policy(cfg.model.remat_policy)

    names = [s.name for s in blocks.stacks(cfg.model)]
    main = names.index(blocks.MAIN_STACK)
    before = [(n, _quantized(_side_stack(cfg.model, n), cfg.quantization)) for n in names[:main]]
    after = [(n, _quantized(_side_stack(cfg.model, n), cfg.quantization)) for n in names[main + 1:]]
    stage_microbatches = shape.repeats * shape.stages * shape.microbatches
    router_weights = (cfg.load_balance_loss_weight, cfg.router_z_loss_weight, cfg.moe_seq_balance_loss_weight)
    # the router statistics' entries the circular pipeline averages: each MoE layer of a stage once per
    # stage-microbatch, each of the last part's once (on the whole batch: the layers left over, the modules')
    stage_moe = shape.layers_per_stage * blocks.moe_layers(blocks.main_stack(cfg.model).unit)
    left_over = [blocks.stack_named(cfg.model, n) for n, _ in after]
    last_moe = (sum(s.repeats * blocks.moe_layers(s.unit) for s in left_over)
                + (blocks.moe_layers(blocks.mtp_layers(cfg.model)) if trainer.trains_mtp else 0))
    entries = stage_microbatches * stage_moe + last_moe

    def stage(w: Any, wf: Any, x: jax.Array, aux: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
        """(y, (the router losses' share of the objective, what the layers sowed)); 0 and {} for dense stacks."""
        params = {"params": trainable.merge(w, wf)}
        if not cfg.model.is_moe:
            return layer.apply(params, x, aux["segment_ids"], aux["positions"])[0], (jnp.zeros((), jnp.float32), {})
        (y, _), sown = layer.apply(params, x, aux["segment_ids"], aux["positions"], mutable=[moe.STATS_COLLECTION])
        sown = sown.get(moe.STATS_COLLECTION, {})
        share = moe.loss_sums(moe.collect_stats(sown), aux[_SHARE])
        return y, (jnp.asarray(moe.objective(share, *router_weights), jnp.float32), sown)

    # B and W recompute the stage's forward; the policy decides what that recompute keeps for its backward
    stage_fn = jax.checkpoint(stage, policy=policy, prevent_cse=False)

    def last_fn(lt: Any, lf: Any, y: jax.Array, mb: dict, totals: dict) -> tuple[jax.Array, dict]:
        params = {"params": trainable.merge(lt, lf)}
        y, sown = _run_stacks(after, params["params"], y, mb)
        predicted: list[jax.Array] = []
        if trainer.trains_mtp:  # the prediction modules read the microbatch's embedded tokens, embedded again here
            embedded = model.apply(params, mb["inputs"], method=_embed)
            (hidden, predicted), modules = model.apply(params, y, embedded, mb["segment_ids"], mb["positions"],
                                                       method="after_stack", mutable=[moe.STATS_COLLECTION])
            sown = {**sown, **modules.get(moe.STATS_COLLECTION, {})}  # the circular order: the modules sow last
        else:
            hidden = model.apply(params, y, method=_hidden_out)
        # the MoE layers' statistics, as this microbatch's part of the whole batch's
        router = moe_stats.scaled(moe.collect_stats(sown), *mb[_LAST_PARTS]) if last_moe else {}
        if objective.kind.scores:  # a reward model: the score head's per-token scores, as Trainer._token_logps
            loss_sum, sums = objective.sums(model.apply(params, hidden, method="scores"), _fields(mb), totals,
                                            mb.get(_REFERENCE))
            return _with_router(loss_sum, sums, router, mb)
        head = trainer._head(params["params"], hidden.shape[0], _last_stage_groups(trainer))
        # as Trainer._token_logps: grouped over the microbatch's token shards, or over pieces (one without loss_chunks)
        logps_of = functools.partial(head_token_logps, chunks=max(cfg.loss_chunks, 1), logps=_token_logps)
        whole = not isinstance(head, GroupedHead) and cfg.loss_chunks <= 1
        logps = _token_logps(head(hidden), mb["targets"]) if whole else logps_of(head, hidden, mb["targets"])
        loss_sum, sums = objective.sums(logps, _fields(mb), totals, mb.get(_REFERENCE))
        if predicted:
            sums = {**sums, **mtp.loss_sums(head, predicted, mb, logps_of)}
            loss_sum = loss_sum + mtp.objective(sums, cfg.mtp_loss_weight)  # linear in each microbatch's sums
        return _with_router(loss_sum, sums, router, mb)

    def _with_router(loss_sum: jax.Array, sums: dict, router: dict, mb: dict) -> tuple[jax.Array, dict]:
        """The last part's loss with its MoE layers' router losses, each layer one entry of the mean as the stages'
        layers are."""
        if not router:
            return loss_sum, sums
        loss_sum = loss_sum + moe.objective(moe.loss_sums(router, mb[_LAST_SHARE]), *router_weights)
        return loss_sum, {**sums, _LAST_ROUTER: router}

    def first_fn(ot: Any, of: Any, mb: dict) -> jax.Array:
        params = {"params": trainable.merge(ot, of)}
        return _run_stacks(before, params["params"], model.apply(params, mb["inputs"], method=_embed), mb)[0]

    # the trained stack's state sharding, to which the runner pins each stage's weights and their gradient
    state_specs = jax.tree.map(lambda s: s.spec, trainer.state_shardings.params)
    stack_specs = _split_stack(trainable.split(state_specs, cfg.model)[0])[0]

    def grads(trained: Any, batch: dict, frozen: Any = None, reference: Any = None,
              totals: dict | None = None) -> tuple[tuple[jax.Array, dict], Any]:
        frozen = frozen or {}
        totals = objective.totals(batch) if totals is None else totals
        stack_t, outer_t = _split_stack(trained)
        stack_f, outer_f = _split_stack(frozen)
        ref = trainer._reference_logps(trainable.merge(trained, frozen), reference, batch)
        aux = {k: pipeline_runner.split_microbatches(v, shape.microbatches) for k, v in batch.items()}
        if ref is not None:
            aux[_REFERENCE] = pipeline_runner.split_microbatches(ref, shape.microbatches)
        if cfg.model.is_moe:  # the call's weight_sum (a function of the batch alone), shared by the stages
            nothing = jnp.zeros(batch["targets"].shape, jnp.float32)
            weight = objective.sums(nothing, _fields(batch), totals, nothing if ref is None else ref)[1]["weight_sum"]
            aux[_SHARE] = jnp.full((shape.microbatches,), weight * stage_moe / entries, jnp.float32)
            if last_moe:
                aux[_LAST_SHARE] = jnp.full((shape.microbatches,), weight * last_moe / entries, jnp.float32)
                aux[_LAST_PARTS] = _last_router_parts(batch["segment_ids"], shape.microbatches)
        loss_of = lambda lt, lf, y, mb: last_fn(lt, lf, y, mb, totals)  # noqa: E731
        sums, stack_g, outer_g, sown = pipeline_runner.run(table, first_fn, stage_fn, loss_of, (stack_t, stack_f),
                                                           (outer_t, outer_f), aux, trainer.mesh, stack_specs)
        # where the circular pipeline puts its stages' sown values (layers/pipeline.py), whose paths moe_stats maps
        stats = moe.collect_stats({"decoder": {"pipeline": {"stages": sown}}}) if sown else {}
        if _LAST_ROUTER in sums:  # the circular order: the layers after the pipeline sow after its stages
            stats = moe_stats.joined(stats, sums.pop(_LAST_ROUTER))
        sums = {**sums, **moe.loss_sums(stats, sums["weight_sum"])}
        loss = sums["loss_sum"] + moe.objective(sums, *router_weights) + mtp.objective(sums, cfg.mtp_loss_weight)
        return (loss, sums), _join_stack(stack_g, outer_g)

    return grads
