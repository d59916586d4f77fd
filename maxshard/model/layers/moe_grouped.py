"""Dropless MoE with grouped matmuls: each token's k assignments sorted by expert, every expert's SwiGLU run on its
own rows only, results put back in token order and summed with the router weights. Expert FLOPs are those of the k
chosen experts (the all-experts path, `moe_dropless_impl=dense`, computes num_experts / k times as many).

Grouped matmul, `x [rows, embed] @ w[expert of the row]`, with rows sorted by expert and `sizes [experts]` rows each:
  ragged_dot  `jax.lax.ragged_dot`: XLA's ragged-dot instruction. On CPU, jax lowers it to a dense dot over every
              group with the other groups' rows masked to zero, so it costs experts x the FLOPs; on an H100 its
              kernels are dense GEMMs too, slower than tiled and more so with more experts (benchmarks/README.md,
              "Dropless MoE: ragged_dot vs tiled").
  tiled       any backend, FLOPs close to the rows': every expert's rows are padded to whole tiles of b rows, and
              each tile is one [b, embed] @ [embed, mlp] matmul against its expert's kernel (gathered per tile).
              With rows R and E experts, sum_e ceil(n_e / b) <= (R + E (b - 1)) // b tiles, a static bound for any
              routing; b ~ R / (5 E) keeps the padding <= ~1/5 of R and the gathered kernels ~6 x the experts'.
`moe_dropless_impl=auto` takes ragged_dot on TPU and tiled elsewhere (`spec/model_config.py`: `resolve_moe_impl`).
The experts' activation is the model's (`mlp_activation`, layers/mlp.py `GatedActivation`); with `moe_bias` each row
also gets its expert's biases: per tile (tiled) or gathered per row from the group sizes (ragged_dot), zero for the
rows past the groups, so empty rows stay zero.

Expert parallelism (the `exp` dimension of the kernels sharded over P devices, E_l = E / P experts each). The layer
runs in `jax.shard_map`, manual over the mesh axes that split the tokens (the rules of activation_batch and
activation_length) and the expert axes (plus the stage axes inside the pipeline, whose vmap adds them); tensor-like
axes stay automatic, and kernel dimensions sharded over manual axes (FSDP) are all-gathered in the body, their
gradients reduce-scattered by its transpose. Each device routes its own T tokens and exchanges them with the devices
holding their experts, in one of two ways (`moe_exchange`, resolved by `spec/model_config.py`'s `resolve_moe_exchange`):

  ragged      (auto on TPU and GPU) `jax.lax.ragged_all_to_all` moves only the rows routed, and each device
              computes a buffer of ~`moe_ragged_buffer_factor` x T x k rows; rows over it are dropped and counted:
              `moe_ragged.py`. On a CPU mesh the collective is emulated (`ragged_all_to_all.py`, the same contract):
              the tests, and a TPU or GPU config asking for it explicitly, compute it there.
  all_to_all  (auto on CPU: XLA:CPU has no ragged all-to-all, "HLO opcode `ragged-all-to-all` is not supported by
              XLA:CPU ThunkEmitter") a fixed buffer, never overflowing, described below.

The fixed exchange is an `all_to_all` of a buffer [P, slots, embed] with

    slots = T x min(k, E_l)

which always suffices: a token's k choices are distinct experts, so at most min(k, E_l) of them live on one device.
The padding travels too (P x min(k, E_l) / k times the routed rows), and a device's static receive buffer, P x slots
rows, is what its grouped matmul runs over (empty rows are zero and add nothing): dropless with static shapes must
budget for every token choosing one device's experts. A second, tiny all_to_all sends the row counts per expert.

Worked example: one device of P = 2 holds T = 4 tokens; E = 4 experts (e0 e1 on shard 0, e2 e3 on shard 1), k = 2.

    token            t0      t1      t2      t3
    choices        e0 e2   e1 e0   e3 e2   e0 e1
    sorted by expert: e0: t0 t1 t3 | e1: t1 t3 | e2: t0 t2 | e3: t2          sizes [3, 2, 2, 1]
    send [2, 8]:  to shard 0: t0 t1 t3 t1 t3 - - -  counts [3, 2];  to shard 1: t0 t2 t2 - - - - -  counts [2, 1]
    shard 1 sorts what every source sent by local expert (e2, e3), runs the grouped SwiGLU, and sends each row back
    to the slot it came from; the sender puts rows back in assignment order and sums each token's two rows with
    its router weights. Tiled with b = 2 rows, sizes [3, 2, 2, 1] pad to [4, 2, 2, 2]: 5 tiles (bound (8 + 4)//2 = 6).

Padding tokens (segment_id 0) carry expert id E: sorted behind every expert, never sent, never computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxshard.errors import ConfigError  # layout mistakes surface as the config errors they are
from maxshard.model.layers import moe_ragged
from maxshard.model.layers.mlp import GatedActivation
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import MeshAxes, active_mesh_axes, partition_spec

__all__ = ["IMPLS", "EXCHANGES", "TILE_IN", "TILE_OUT", "EXPERT_BIAS_AXES", "Kernels", "tile_rows", "grouped_swiglu",
           "dropless_local", "dropless", "exchange_slots"]

IMPLS = ("ragged_dot", "tiled")
EXCHANGES = ("all_to_all", "ragged")
# wi_0 [E, embed, mlp], wi_1 [E, embed, mlp], wo [E, mlp, embed]; with `moe_bias` (GPT-OSS) three more, each
# expert's biases bi_0, bi_1 [E, mlp] and bo [E, embed] (layers/moe.py).
Kernels = tuple[jax.Array, ...]
EXPERT_BIAS_AXES = ((ax.EXP, ax.MLP), (ax.EXP, ax.MLP), (ax.EXP, ax.EMBED))  # bi_0, bi_1, bo
_SILU = GatedActivation()


# --------------------------------------------------------------------------------------------- grouped matmul


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: ~rows / (5 x groups), a multiple of 8, at least 8 (padding <= groups x (b - 1) rows)."""
    return max(8, rows // (5 * groups) // 8 * 8)


class _Tiles(NamedTuple):
    dest: jax.Array  # [rows] padded row of each sorted row; distinct and out of range for rows past sum(sizes)
    group: jax.Array  # [tiles] expert of each tile
    count: int  # tiles (static)
    size: int  # rows per tile (static)


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _tiles(sizes: jax.Array, rows: int) -> _Tiles:
    """Where each sorted row goes when every group is padded to whole tiles."""
    groups = sizes.shape[0]
    b = tile_rows(rows, groups)
    count = (rows + groups * (b - 1)) // b
    row = jnp.arange(rows, dtype=sizes.dtype)
    row_group = jnp.sum(row[:, None] >= jnp.cumsum(sizes)[None, :], axis=1)  # [rows], `groups` past the end
    padded = (sizes + b - 1) // b * b
    g = jnp.minimum(row_group, groups - 1)
    inside = _exclusive_cumsum(padded)[g] + row - _exclusive_cumsum(sizes)[g]
    dest = jnp.where(row_group < groups, inside, count * b + row)  # past the end: distinct, out of range
    tile_start = jnp.arange(count, dtype=sizes.dtype) * b
    tile_group = jnp.minimum(jnp.sum(tile_start[:, None] >= jnp.cumsum(padded)[None, :], axis=1), groups - 1)
    return _Tiles(dest, tile_group, count, b)


# A tile's matmuls with its group's kernels, by their einsum subscripts (moe.EXPERT_EINSUMS names every expert matmul).
TILE_IN, TILE_OUT = "tbm,tmh->tbh", "tbh,thm->tbm"


def _swiglu_tiled(x: jax.Array, sizes: jax.Array, kernels: Kernels, act: GatedActivation) -> jax.Array:
    """x [rows, embed] sorted by group -> [rows, embed]; each tile one matmul with its group's kernels (and its
    group's biases, broadcast over the tile's rows; padding rows get them too, and are never read back)."""
    wi_0, wi_1, wo = kernels[:3]
    t = _tiles(sizes, x.shape[0])
    padded = jnp.zeros((t.count * t.size, x.shape[1]), x.dtype).at[t.dest].set(x, mode="drop", unique_indices=True)
    tiles = padded.reshape(t.count, t.size, x.shape[1])  # [tiles, b, embed]; padding rows are zero
    gate = jnp.einsum(TILE_IN, tiles, wi_0[t.group])
    up = jnp.einsum(TILE_IN, tiles, wi_1[t.group])
    if len(kernels) > 3:
        gate, up = gate + kernels[3][t.group][:, None, :], up + kernels[4][t.group][:, None, :]
    out = jnp.einsum(TILE_OUT, act(gate, up), wo[t.group])
    if len(kernels) > 3:
        out = out + kernels[5][t.group][:, None, :]
    return out.reshape(-1, x.shape[1]).at[t.dest].get(mode="fill", fill_value=0, unique_indices=True)


@jax.custom_batching.sequential_vmap
def _ragged_dot_loop(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, sizes)


@jax.custom_batching.sequential_vmap
def _ragged_dot_loop_vjp(x: jax.Array, w: jax.Array, sizes: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)[1](g)


@jax.custom_vjp
def _ragged_dot_unbatched(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """`jax.lax.ragged_dot` that stays free of batch dimensions under vmap: a batch runs as a loop of ragged dots.

    Why. XLA:TPU's ragged-dot takes no batch dimensions ("Failed to create RaggedConvSpec from ragged_dot
    instruction ...: number of batch dimensions should be 0, got 1"), and inside the pipeline the layer is vmapped
    over stages: the shard_map of `dropless` is then batched over its device's one stage, and jax's batching rule
    of ragged_dot adds that dimension. `sequential_vmap` runs the batch as a `lax.map` (one iteration there, which
    XLA drops); it has no reverse-mode rule of its own, so the gradient is a custom_vjp whose backward is the
    ragged dot's own vjp, looped the same way."""
    return _ragged_dot_loop(x, w, sizes)


def _ragged_dot_unbatched_fwd(x, w, sizes):
    return _ragged_dot_loop(x, w, sizes), (x, w, sizes)


def _ragged_dot_unbatched_bwd(residuals, g):
    x, w, sizes = residuals
    return (*_ragged_dot_loop_vjp(x, w, sizes, g), None)


_ragged_dot_unbatched.defvjp(_ragged_dot_unbatched_fwd, _ragged_dot_unbatched_bwd)


def _row_biases(biases: Kernels, sizes: jax.Array, rows: int) -> list[jax.Array]:
    """Each sorted row's group's bias [rows, width] (zero for the rows past sum(sizes), which stay zero)."""
    row = jnp.arange(rows, dtype=sizes.dtype)
    group = jnp.sum(row[:, None] >= jnp.cumsum(sizes)[None, :], axis=1)  # [rows]; len(sizes) past the end
    inside = (group < sizes.shape[0])[:, None]
    return [jnp.where(inside, b[jnp.minimum(group, sizes.shape[0] - 1)], 0).astype(b.dtype) for b in biases]


def _swiglu_ragged(x: jax.Array, sizes: jax.Array, kernels: Kernels, act: GatedActivation,
                   dot=jax.lax.ragged_dot) -> jax.Array:
    wi_0, wi_1, wo = kernels[:3]
    gate = dot(x, wi_0, sizes)
    up = dot(x, wi_1, sizes)
    if len(kernels) > 3:
        b_gate, b_up, b_out = _row_biases(kernels[3:], sizes, x.shape[0])
        return dot(act(gate + b_gate, up + b_up), wo, sizes) + b_out
    return dot(act(gate, up), wo, sizes)


# ragged_dot inside the pipeline's stage vmap (`dropless` picks it there): `_ragged_dot_unbatched`.
_RAGGED_IN_VMAP = "ragged_dot in vmap"


def grouped_swiglu(x: jax.Array, sizes: jax.Array, kernels: Kernels, impl: str, act: GatedActivation = _SILU
                   ) -> jax.Array:
    """Every group's gated MLP (`act`, with its biases when `kernels` has them) on its rows: x [rows, embed] sorted
    by group, sizes [groups] (sum <= rows; the rows past the sum come out zero) -> [rows, embed]."""
    if impl == "tiled":
        return _swiglu_tiled(x, sizes, kernels, act)
    if impl == "ragged_dot":
        return _swiglu_ragged(x, sizes, kernels, act)
    if impl == _RAGGED_IN_VMAP:
        return _swiglu_ragged(x, sizes, kernels, act, _ragged_dot_unbatched)
    raise ValueError(f"grouped matmul impl must be one of {IMPLS}, got {impl!r}")


# --------------------------------------------------------------------------------------------- one device


def _sort(ids: jax.Array, groups: int) -> tuple[jax.Array, jax.Array]:
    """(order [n] that sorts ids stably, sizes [groups]); ids >= groups sort last and count in no group."""
    sizes = jnp.sum(ids[:, None] == jnp.arange(groups, dtype=ids.dtype)[None, :], axis=0, dtype=jnp.int32)
    return jnp.argsort(ids, stable=True), sizes


def _inverse(order: jax.Array) -> jax.Array:
    """The permutation that undoes `order` (a scatter of positions: no second sort)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)


def _combine(y: jax.Array, weights: jax.Array) -> jax.Array:
    """y [tokens * k, embed] in assignment order, weights [tokens, k] -> [tokens, embed]."""
    tokens, k = weights.shape
    return jnp.einsum("tkm,tk->tm", y.reshape(tokens, k, -1), weights.astype(y.dtype))


def dropless_local(x: jax.Array, experts: jax.Array, weights: jax.Array, kernels: Kernels, impl: str,
                   act: GatedActivation = _SILU) -> jax.Array:
    """All experts on this device: x [tokens, embed], experts and weights [tokens, k] -> [tokens, embed]."""
    k = experts.shape[1]
    order, sizes = _sort(experts.reshape(-1), kernels[0].shape[0])
    y = grouped_swiglu(x[order // k], sizes, kernels, impl, act)  # [tokens * k, embed], sorted by expert
    return _combine(y[_inverse(order)], weights)


# --------------------------------------------------------------------------------------------- expert parallelism


def exchange_slots(tokens: int, k: int, local_experts: int) -> int:
    """Rows one device reserves per destination: a token sends at most min(k, local experts) rows to one device."""
    return tokens * min(k, local_experts)


class _Fixed(NamedTuple):
    """What the way back of one device's fixed exchange needs."""

    dest: jax.Array  # [T * k] row of each sorted assignment in the send buffer [p * slots]; past its end: padding
    order: jax.Array  # [p * slots] sorts the received buffer by local expert
    local_sizes: jax.Array  # [E_l] received rows per local expert


def _fixed_there(sent: jax.Array, sorted_ids: jax.Array, sizes: jax.Array, local: int, slots: int,
                 axis: tuple[str, ...], p: int) -> tuple[jax.Array, _Fixed]:
    """Rows sorted by expert [T * k, embed] (their experts sorted_ids, sizes [E]) sent in the fixed buffer: what
    arrives, [p * slots, embed] sorted by local expert (empty slots last, zero), and the way back."""
    shard = jnp.minimum(sorted_ids // local, p - 1)
    starts = _exclusive_cumsum(jnp.sum(sizes.reshape(p, local), axis=1))  # [p] first sorted row per destination
    rank = jnp.arange(sorted_ids.shape[0], dtype=sorted_ids.dtype)
    dest = jnp.where(sorted_ids < p * local, shard * slots + rank - starts[shard], p * slots + rank)  # [T * k]
    send = jnp.zeros((p * slots, sent.shape[1]), sent.dtype).at[dest].set(sent, mode="drop", unique_indices=True)
    recv = jax.lax.all_to_all(send.reshape(p, slots, -1), axis, 0, 0, tiled=True)  # [p sources, slots, embed]
    counts = jax.lax.all_to_all(sizes.reshape(p, local), axis, 0, 0, tiled=True)  # [p sources, E_l]
    slot = jnp.arange(slots, dtype=counts.dtype)
    local_ids = jnp.sum(slot[None, :, None] >= jnp.cumsum(counts, axis=1)[:, None, :], axis=-1)  # E_l: empty
    order, local_sizes = _sort(local_ids.reshape(-1), local)
    return recv.reshape(p * slots, -1)[order], _Fixed(dest, order, local_sizes)


def _fixed_back(y: jax.Array, fixed: _Fixed, axis: tuple[str, ...], p: int) -> jax.Array:
    """The received rows' results [p * slots, embed] back to their senders: [T * k, embed] in sorted order."""
    back = jax.lax.all_to_all(y[_inverse(fixed.order)].reshape(p, -1, y.shape[1]), axis, 0, 0, tiled=True)
    return back.reshape(y.shape).at[fixed.dest].get(mode="fill", fill_value=0, unique_indices=True)


def _dropless_exchange(
    x: jax.Array, experts: jax.Array, weights: jax.Array, kernels: Kernels, impl: str, axis: tuple[str, ...], p: int,
    act: GatedActivation = _SILU
) -> jax.Array:
    """Per device (inside shard_map): x [T, embed], experts/weights [T, k]; kernels hold E_l = E / p experts."""
    tokens, k = experts.shape
    local = kernels[0].shape[0]
    order, sizes = _sort(experts.reshape(-1), p * local)  # sizes [E]
    received, fixed = _fixed_there(x[order // k], experts.reshape(-1)[order], sizes, local,
                                   exchange_slots(tokens, k, local), axis, p)
    y = grouped_swiglu(received, fixed.local_sizes, kernels, impl, act)
    return _combine(_fixed_back(y, fixed, axis, p)[_inverse(order)], weights)


def _dropless_ragged(x: jax.Array, experts: jax.Array, weights: jax.Array, kernels: Kernels, impl: str,
                     axis: tuple[str, ...], p: int, factor: float, act: GatedActivation = _SILU
                     ) -> tuple[jax.Array, jax.Array]:
    """Per device (inside shard_map), the ragged exchange (`moe_ragged.py`): (y [T, embed], rows left home)."""
    tokens, k = experts.shape
    local = kernels[0].shape[0]
    order, sizes = _sort(experts.reshape(-1), p * local)  # sizes [E]: this device's rows per expert, padding uncounted
    rows = moe_ragged.buffer_rows(tokens, k, p * local, p, factor)
    plan = moe_ragged.plan(jax.lax.all_gather(sizes, axis), jax.lax.axis_index(axis), rows)
    received = moe_ragged.exchange(x[order // k], rows, plan.there, axis)  # [rows, embed], sorted by local expert
    y = grouped_swiglu(received, plan.local_sizes, kernels, impl, act)
    y = moe_ragged.exchange(y, tokens * k, plan.back, axis)  # [T * k, embed] in sorted order; rows not sent: zero
    return _combine(y[_inverse(order)], weights), plan.unsent


def _within(dims: Sequence[MeshAxes], keep: Sequence[str]) -> list[MeshAxes]:
    """Per dimension, those of its mesh axes that are among `keep` (the shard_map's manual axes)."""
    return [tuple(a for a in d if a in keep) for d in dims]


def _gather(w: jax.Array, dims: list[tuple[str, ...]]) -> jax.Array:
    """Whole non-expert dimensions of a local kernel: all-gather the manual axes that shard them (FSDP)."""
    for d, axes in enumerate(dims[1:], start=1):
        if axes:
            w = jax.lax.all_gather(w, axes, axis=d, tiled=True)
    return w


def _dropless_here(x: jax.Array, experts: jax.Array, weights: jax.Array, kernels: Kernels, impl: str,
                   act: GatedActivation = _SILU) -> jax.Array:
    """`dropless_local` on [batch, length, ...] arrays."""
    k, embed = experts.shape[-1], x.shape[-1]
    flat = dropless_local(x.reshape(-1, embed), experts.reshape(-1, k), weights.reshape(-1, k), kernels, impl, act)
    return flat.reshape(x.shape)


def _none_dropped() -> jax.Array:
    return jnp.zeros((), jnp.int32)


def dropless(x: jax.Array, experts: jax.Array, weights: jax.Array, kernels: Kernels, impl: str,
             exchange: str = "all_to_all", buffer_factor: float = 0.0, act: GatedActivation = _SILU
             ) -> tuple[jax.Array, jax.Array]:
    """x [batch, length, embed], experts and weights [batch, length, k] -> ([batch, length, embed], dropped), where
    dropped (int32) counts the assignments a full ragged receive buffer left home (0 for any other path).

    Without a mesh (or logical rules) everything is local; with one, a shard_map manual over the token axes and the
    expert axes, exchanging tokens when the experts are sharded (`exchange`: all_to_all or ragged, whose buffer is
    `buffer_factor` x the balanced share, `moe_ragged.buffer_rows`). A batch that the token axes do not divide (init
    runs a batch of 1) takes the local computation, left for XLA to partition.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"dropless exchange must be one of {EXCHANGES}, got {exchange!r}")
    mesh, rules = jax.sharding.get_abstract_mesh(), nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return _dropless_here(x, experts, weights, kernels, impl, act), _none_dropped()
    # Inside the pipeline the layer is vmapped over stages with spmd_axis_name, which adds the stage axes to the
    # shard_map's specs: they must be manual too (outside a pipeline they have size 1 and are left out), and the
    # body is batched over the device's stage, a batch dimension XLA:TPU's ragged-dot does not take.
    stage_axes = active_mesh_axes(ax.PIPELINE_STATE)[0]  # as the pipeline's vmap asks (layers/pipeline.py)
    if stage_axes and impl == "ragged_dot":
        impl = _RAGGED_IN_VMAP
    names = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    token_dims = active_mesh_axes(ax.TOKENS)[:2]  # x's [batch, length] (layers/moe.py constrains it to ax.TOKENS)
    expert_axes = active_mesh_axes(ax.EXPERT_KERNEL)[0]
    if not set(expert_axes) <= {a for d in token_dims for a in d}:
        raise ConfigError(f"dropless MoE: the expert mesh axes {expert_axes} must also split the tokens "
                          f"(activation_batch or activation_length rules)")
    shards = [math.prod(mesh.shape[a] for a in d) for d in token_dims]
    if not any(token_dims) or x.shape[0] % shards[0] or x.shape[1] % shards[1]:
        # Nothing splits the tokens, or this batch does not split evenly (init's batch of 1, a small decode batch):
        # one logical computation, partitioned by XLA.
        return _dropless_here(x, experts, weights, kernels, impl, act), _none_dropped()
    manual = tuple(a for a in names if any(a in d for d in token_dims) or a in stage_axes)
    kernel_names = (ax.EXPERT_KERNEL, ax.EXPERT_KERNEL, (ax.EXP, ax.MLP, ax.EMBED), *EXPERT_BIAS_AXES)[:len(kernels)]
    kernel_dims = [_within(active_mesh_axes(n), manual) for n in kernel_names]
    p = math.prod(mesh.shape[a] for a in expert_axes)

    def body(x: jax.Array, experts: jax.Array, weights: jax.Array, *kernels: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
        kernels = tuple(_gather(w, dims) for w, dims in zip(kernels, kernel_dims))
        if p == 1:
            return _dropless_here(x, experts, weights, kernels, impl, act), _none_dropped()[None]
        k, embed = experts.shape[-1], x.shape[-1]
        flat = (x.reshape(-1, embed), experts.reshape(-1, k), weights.reshape(-1, k), kernels, impl, expert_axes, p)
        if exchange == "ragged":
            y, unsent = _dropless_ragged(*flat, buffer_factor, act)
            return y.reshape(x.shape), unsent[None]
        return _dropless_exchange(*flat, act).reshape(x.shape), _none_dropped()[None]

    token_spec = partition_spec([*token_dims, ()])
    per_device = PartitionSpec(tuple(a for d in token_dims for a in d))  # one count per token shard
    run = jax.shard_map(body, in_specs=(token_spec,) * 3 + tuple(partition_spec(d) for d in kernel_dims),
                        out_specs=(token_spec, per_device), axis_names=frozenset(manual))
    y, unsent = run(x, experts, weights, *kernels)
    return y, jnp.sum(unsent)
