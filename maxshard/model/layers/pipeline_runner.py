"""The runner of the table schedules (gpipe, 1f1b, interleaved_1f1b, zero_bubble; spec/pipeline_tables.py): the
loss and every gradient of a pipelined decoder stack, each stage's backward computed explicitly per microbatch.

Why a runner and not `jax.grad`: in 1F1B a stage starts the backward of microbatch m while later microbatches are
still in their forward, so the backward cannot be the transpose of one forward program (what `jax.grad` of the
circular pipeline is). Here the step's gradients come from the runner (training/pipelined.py asks it instead of
`jax.value_and_grad`), and the circular pipeline's path is untouched.

How. `jax.shard_map` over the `stage` mesh axis only: each device holds its stage's weights ([R, 1, L, ...] of the
[R, S, L, ...] stack: virtual stage v is repeat v) and steps through the table's ticks in a `lax.scan`; every other
mesh axis (fsdp, tensor, data, ...) stays automatically partitioned inside a stage, so the layers keep their own
sharding constraints (the logical rules inside the runner drop `stage`, which is manual there). At each tick a
device does what its column of the table says, by `lax.switch`:
  F       its virtual stage on a microbatch (stage 0 embeds the microbatch's tokens first, `first_fn`), keeping the
          stage input in its stash slot; on the last logical stage (F_LAST) also `last_fn` (final norm, head,
          objective) with its value and gradient: the loss sums and the cotangent that starts the backward, kept in
          a cotangent slot;
  B       `jax.vjp` of the stage with respect to its input, from the stash and the cotangent slots: the input
          gradient, handed back (on stage 0 it goes through the embedding's vjp into the embedding's gradient);
  W       `jax.vjp` of the stage with respect to its trained weights, added to their gradient sum.
A fused table (gpipe, 1f1b, interleaved_1f1b: W then B on consecutive ticks) computes the whole backward once at W,
keeping the input gradient in the cotangent's slot, and B hands it on: one recomputed forward per backward, as the
circular pipeline's checkpoint has. Zero-bubble's split B and W each recompute the stage's forward, and W also
walks back through the activations to reach each layer's output cotangent: the table's unit ticks hold for F, B and
W only approximately (a split at the matmuls, as the paper's, would keep each layer's input and output cotangent).
Then the two hand-offs of the tick, whatever each device did (SPMD): forward outputs one device on, input gradients
one device back, each a `ppermute` over `stage` (the ring closes, for interleaved's wrap from the last device to the
first), stored where the table says (`recv_forward`, `recv_backward`; -1: nothing arrives). B and W each recompute
the stage's forward (a checkpoint per stage and microbatch, with the remat policy inside), so between F and the
last of B and W a microbatch costs one stage input, not the stage's activations.

Sown values (MoE router statistics). A stage returns, beside its output, what its layers sowed and the share
of the objective that depends on them (`penalty`, a scalar: the router losses, linear in the summed statistics
once the batch's weight is known, so training/pipelined.py computes each stage-microbatch's share before the run).
F keeps the sown values at their (virtual stage, microbatch) slot; B and W differentiate (output, penalty) with the
cotangents (dy, 1): the router losses' gradient enters each stage's backward where it arises, as `jax.grad` of
the circular pipeline gets it. The run returns them [R, M, S, ...], the circular pipeline's layout of its "stages"
entry (layers/pipeline.py), so moe_stats.collect_stats reads both alike (loads per layer and microbatch; the
selection biases' loads summed over microbatches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxshard.spec.pipeline_tables import B, F, F_LAST, IDLE, W, Table

__all__ = ["split_microbatches", "run"]

STAGE = "stage"  # the mesh axis of the stages (parallel/axis_names: the rule of activation_stage)

# (trained w, frozen w, x [mb, len, E], aux) -> (y, (penalty, sown)): the penalty a float32 scalar, sown a tree
StageFn = Callable[[Any, Any, jax.Array, Any], tuple[jax.Array, tuple[jax.Array, Any]]]
FirstFn = Callable[[Any, Any, Any], jax.Array]  # (trained, frozen, aux) -> x [mb, len, E]: the embedding
LastFn = Callable[[Any, Any, jax.Array, Any], tuple[jax.Array, dict]]  # (trained, frozen, y, aux) -> (loss, sums)


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[batch, ...] -> [m, batch/m, ...]; microbatch i holds rows i, i+m, ... (as the circular pipeline splits)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _rules_without_stage() -> tuple:
    """The active logical rules with the `stage` mesh axis taken out: inside the runner it is manual."""
    rules = []
    for name, axes in nn.get_logical_axis_rules():
        if axes == STAGE:
            axes = None
        elif isinstance(axes, (tuple, list)):
            axes = tuple(a for a in axes if a != STAGE) or None
        rules.append((name, axes))
    return tuple(rules)


def run(table: Table, first_fn: FirstFn, stage_fn: StageFn, last_fn: LastFn, stack: tuple[Any, Any],
        outer: tuple[Any, Any], aux: Any, mesh: Any, stack_specs: Any = None) -> tuple[dict, Any, Any, Any]:
    """(loss sums over the microbatches, gradient sums of the trained stack [R, S, L, ...], of the trained `outer`
    parameters, what the stages sowed [R, M, S, ...]: virtual stage, microbatch, device).

    stack: (trained, frozen) weights [R, S, L, ...]; outer: (trained, frozen) parameters that `first_fn` (the
    embedding, on stage 0) and `last_fn` (final norm, head, objective, on the last stage) read; aux: a tree of
    [M, ...] arrays (token ids, segment ids, positions, targets, ...), indexed by the microbatch of the action;
    stack_specs: the PartitionSpec of each trained stack leaf (its state sharding), or None (no constraint).

    Why the specs: a stage's weight gradient is computed from its gathered weights, one layer at a time in the
    backward of the layer scan. Without a constraint XLA:TPU's sharding propagation does not reach that scan
    through the tick loop, the switch and the vjp, and the scan accumulates the stage's gradient whole (every fsdp
    shard of every layer, float32) before reducing it once: at large widths more than the in-flight activations
    save. Pinned to the state's sharding, each layer's gradient is reduce-scattered inside the scan, as `jax.grad`
    of the circular pipeline does (benchmarks/README.md, "Pipeline schedules: in-flight activations")."""
    s, j_last = table.stages, table.virtual * table.stages - 1
    branch = np.zeros(5, np.int32)
    branch[[IDLE, F, F_LAST, B, W]] = [0, 1, 1, 2, 3]  # the switch's branches: F and F_LAST share one
    columns = tuple(jnp.asarray(a) for a in (table.kind, branch[table.kind], table.microbatch, table.virtual_stage,
                                             table.stash_slot, table.cot_slot, table.recv_forward, table.recv_backward))
    stack_spec = jax.tree.map(lambda _: P(None, STAGE), stack)
    rules = _rules_without_stage()

    pin = _pin_fn(stack_specs)

    def body(stack: tuple[Any, Any], outer: tuple[Any, Any], aux: Any):
        with nn.logical_axis_rules(rules):
            pinned_stage = lambda w, wf, x, a: stage_fn(pin(w), wf, x, a)  # noqa: E731
            return _ticks(table, columns, first_fn, pinned_stage, last_fn, stack, outer, aux, s, j_last)

    return jax.shard_map(body, mesh=mesh, axis_names={STAGE}, check_vma=False, in_specs=(stack_spec, P(), P()),
                         out_specs=(P(), stack_spec[0], P(), P(None, None, STAGE)))(stack, outer, aux)


def _ticks(table: Table, columns: tuple, first_fn: FirstFn, stage_fn: StageFn, last_fn: LastFn,
           stack: tuple[Any, Any], outer: tuple[Any, Any], aux: Any, s: int, j_last: int):
    """The scan over ticks on one device (inside shard_map); returns what `run` returns, summed over stages."""
    d = jax.lax.axis_index(STAGE)
    trained, frozen = jax.tree.map(lambda w: w[:, 0], stack)  # [R, L, ...]: this device's virtual stages
    outer_t, outer_f = outer
    x_shape = jax.eval_shape(first_fn, outer_t, outer_f, _at(aux, 0))
    sums_shape = jax.eval_shape(lambda x: last_fn(outer_t, outer_f, x, _at(aux, 0))[1], x_shape)
    sown_shape = jax.eval_shape(lambda w, wf, x: stage_fn(w, wf, x, _at(aux, 0))[1][1], _at(trained, 0),
                                _at(frozen, 0), x_shape)

    def zero() -> jax.Array:
        """A stage input of zeros, made in each branch that sends nothing: one array made once outside the tick loop
        is held for the whole step (a stage input's bytes)."""
        return jnp.zeros(x_shape.shape, x_shape.dtype)

    microbatches = jax.tree.leaves(aux)[0].shape[0]

    carry = dict(
        stash=jnp.zeros((table.in_flight, *x_shape.shape), x_shape.dtype),
        cots=jnp.zeros((table.cotangents, *x_shape.shape), x_shape.dtype),
        grads=jax.tree.map(jnp.zeros_like, trained),
        outer_grads=jax.tree.map(jnp.zeros_like, outer_t),
        sums=jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), sums_shape),
        sown=jax.tree.map(lambda a: jnp.zeros((table.virtual, microbatches, *a.shape), a.dtype), sown_shape),
    )

    def tick(c: dict, t: jax.Array) -> tuple[dict, None]:
        kind, branch, m, v, ss, cs, rf, rb = (col[t, d] for col in columns)
        j = v * s + d
        w = jax.tree.map(lambda a: a[v], trained)
        wf = jax.tree.map(lambda a: a[v], frozen)
        a_m = _at(aux, m)

        # The tick's stage input is read inside the branches that use it: read before the switch it was a copy of a
        # stage input live through every tick's work (benchmarks/README.md, "Pipeline schedules: in-flight
        # activations"). The output cotangent is read before: the fused W writes the input gradient to its
        # slot, and with the read inside, XLA:CPU copies the whole cotangent buffer first (M stage inputs in gpipe).
        def x_kept(c: dict) -> jax.Array:
            return c["stash"][ss]

        dy = c["cots"][cs]

        def differentiated(w: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            """(y, penalty): what B and W differentiate, with the cotangents `seeds` (the sown values take none)."""
            y, (penalty, _) = stage_fn(w, wf, x, a_m)
            return y, penalty

        seeds = (dy, jnp.ones((), jnp.float32))

        def stage_input(c: dict) -> tuple[dict, jax.Array]:
            """Stage 0 embeds its microbatch; the others read what arrived. Kept until the stage's B and W."""
            kept = x_kept(c)  # outside the cond: XLA:TPU rejects a cond whose branches shard the read apart
            x = jax.lax.cond(j == 0, lambda: first_fn(outer_t, outer_f, a_m).astype(x_shape.dtype), lambda: kept)
            return {**c, "stash": c["stash"].at[ss].set(x)}, x

        def idle(c: dict) -> tuple[dict, jax.Array, jax.Array]:
            return c, zero(), zero()

        def forward(c: dict) -> tuple[dict, jax.Array, jax.Array]:
            """F, and on the last logical stage (F_LAST) the head and objective with their gradient."""
            c, x = stage_input(c)
            y, (_, sown) = stage_fn(w, wf, x, a_m)
            c = {**c, "sown": jax.tree.map(lambda acc, s: acc.at[v, m].set(s), c["sown"], sown)}

            def head(c: dict) -> dict:
                loss = lambda ot, y: last_fn(ot, outer_f, y, a_m)  # noqa: E731
                (_, sums), (g_outer, g_y) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(outer_t, y)
                return {**c, "cots": c["cots"].at[cs].set(g_y.astype(x_shape.dtype)),
                        "outer_grads": jax.tree.map(jnp.add, c["outer_grads"], g_outer),
                        "sums": jax.tree.map(jnp.add, c["sums"], sums)}

            return jax.lax.cond(kind == F_LAST, head, lambda c: c, c), y, zero()  # nothing receives the last's y

        def hand_back(c: dict, g_x: jax.Array) -> tuple[dict, jax.Array, jax.Array]:
            """The input gradient goes to the previous stage; on stage 0 through the embedding's vjp instead."""

            def embedding_grad(acc: Any) -> Any:
                _, embed_vjp = jax.vjp(lambda ot: first_fn(ot, outer_f, a_m), outer_t)
                return jax.tree.map(jnp.add, acc, embed_vjp(g_x.astype(x_shape.dtype))[0])

            outer_grads = jax.lax.cond(j == 0, embedding_grad, lambda acc: acc, c["outer_grads"])
            return {**c, "outer_grads": outer_grads}, zero(), g_x

        def add_weight_grads(c: dict, g_w: Any) -> dict:
            return {**c, "grads": jax.tree.map(lambda acc, g: acc.at[v].add(g), c["grads"], g_w)}

        def input_grad(c: dict) -> tuple[dict, jax.Array, jax.Array]:  # split (zero-bubble): dx alone
            _, vjp = jax.vjp(lambda x: differentiated(w, x), x_kept(c))
            return hand_back(c, vjp(seeds)[0])

        def weight_grad(c: dict) -> tuple[dict, jax.Array, jax.Array]:  # split (zero-bubble): dw alone
            _, vjp = jax.vjp(lambda w: differentiated(w, x_kept(c)), w)
            return add_weight_grads(c, vjp(seeds)[0]), zero(), zero()

        def whole_backward(c: dict) -> tuple[dict, jax.Array, jax.Array]:  # fused W: dw, and dx kept for B
            _, vjp = jax.vjp(differentiated, w, x_kept(c))
            g_w, g_x = vjp(seeds)
            c = add_weight_grads(c, g_w)
            return {**c, "cots": c["cots"].at[cs].set(g_x.astype(x_shape.dtype))}, zero(), zero()

        def send_input_grad(c: dict) -> tuple[dict, jax.Array, jax.Array]:  # fused B: what W computed
            return hand_back(c, dy)

        branches = [idle, forward, send_input_grad if table.fused else input_grad,
                    whole_backward if table.fused else weight_grad]
        c, send_forward, send_backward = jax.lax.switch(branch, branches, c)
        got_forward = jax.lax.ppermute(send_forward, STAGE, [(i, (i + 1) % s) for i in range(s)])
        got_backward = jax.lax.ppermute(send_backward, STAGE, [(i, (i - 1) % s) for i in range(s)])
        c = {**c, "stash": _store(c["stash"], rf, got_forward), "cots": _store(c["cots"], rb, got_backward)}
        return c, None

    carry, _ = jax.lax.scan(tick, carry, jnp.arange(table.ticks))
    # the embedding and head gradients and the loss sums were computed on the first and last device only
    total = lambda tree: jax.tree.map(lambda a: jax.lax.psum(a, STAGE), tree)  # noqa: E731
    grads = jax.tree.map(lambda g: g[:, None], carry["grads"])  # [R, 1, L, ...]
    sown = jax.tree.map(lambda a: a[:, :, None], carry["sown"])  # [R, M, 1, ...]
    return total(carry["sums"]), grads, total(carry["outer_grads"]), sown


def _pin_fn(stack_specs: Any) -> Callable[[Any], Any]:
    """A function that constrains one virtual stage's trained weights [L, ...] (and, transposed, their gradient)
    to the sharding of the stack [R, S, L, ...] they come from, less R and the manual `stage` axis."""
    if stack_specs is None:
        return lambda w: w

    def drop_stage(entry: Any) -> Any:
        if isinstance(entry, (tuple, list)):
            return tuple(a for a in entry if a != STAGE) or None
        return None if entry == STAGE else entry

    def inner(spec: P) -> P:
        return P(*(drop_stage(e) for e in tuple(spec)[2:]))

    specs = jax.tree.map(inner, stack_specs, is_leaf=lambda x: isinstance(x, P))
    return lambda w: jax.tree.map(jax.lax.with_sharding_constraint, w, specs)


def _at(tree: Any, m: jax.Array | int) -> Any:
    return jax.tree.map(lambda a: a[m], tree)


def _store(buffer: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """buffer[slot] = value where slot >= 0 (the table's -1: nothing arrives)."""
    index = jnp.maximum(slot, 0)
    return buffer.at[index].set(jnp.where(slot >= 0, value, buffer[index]))

