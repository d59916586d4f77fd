"""Mixture of Experts: top-k routing with per-expert capacity (token dropping), expert parallelism, router losses.

Routing runs in float32. A router softmax over `num_experts` picks each token's top `k` experts; their
probabilities are renormalised to sum to 1 (Mixtral's softmax over the top-k logits is the same function; with
`moe_renormalize_top_k: false` they keep their softmax values, as Qwen3-MoE without norm_topk_prob) and weigh the
experts' outputs (drops do not renormalise again).

Groups and capacity. A group is `moe_group_size` consecutive tokens of one sequence (default 0: the whole
sequence); each group routes on its own, so routing never depends on how the batch is sharded. Every expert takes
at most C tokens per group of g tokens:

    C = min(g, ceil(g * k / num_experts * capacity_factor))

The dispatch and combine masks are [groups, g, experts, C], so their size is length x g x k x capacity_factor per
sequence: quadratic in the length with whole-sequence groups, linear with a fixed `moe_group_size`. Smaller groups
balance over fewer tokens (a burst of tokens for one expert in one group drops where a whole sequence might not).

Priority. Slots are filled choice-major, then in position order: every token's 1st choice is placed before any
token's 2nd choice. A choice whose slot would be >= C is dropped: that token gets nothing from that expert (its
other choices, if kept, still contribute with their weights) and the residual path carries it. Padding tokens
(segment_id 0) choose nothing and take no slot.

Worked example: one group of 4 tokens, 2 experts, k = 2, capacity_factor = 0.5, so C = ceil(4 * 2 / 2 * 0.5) = 2.

    token                 0       1       2       3
    1st choice (slot)   e0 (0)  e1 (0)  e0 (1)  e0 (2)x     x: slot >= C, dropped
    2nd choice (slot)   e1 (1)  e0 (3)x e1 (2)x e1 (3)x     2nd choices queue behind every 1st choice
    experts kept        e0, e1  e1      e0      none        4 of 8 assignments dropped; token 3 keeps its residual

Dispatch and combine are einsums with one-hot masks [group, tokens, experts, capacity], so every shape is static.
Expert parallelism: tokens arrive sharded over the batch axes (where the `expert` mesh axis acts as data
parallelism) and are processed sharded over experts; the constraints below make the compiler insert all-to-alls:

    x           [group, tokens, embed]               group over (data, fsdp, fsdp_transpose, expert)
    dispatched  [experts, group, capacity, embed]    experts over expert, group over (data, fsdp, fsdp_transpose)
    hidden      [experts, group, capacity, mlp]      SwiGLU of each expert, local to its expert shard
    combined    [group, tokens, embed]               back to the batch layout

Dropless (`capacity_factor <= 0`): by default (`moe_dropless_impl` auto, ragged_dot or tiled) grouped matmuls over
the tokens sorted by expert, with expert parallelism by an all-to-all exchange in shard_map: see `moe_grouped.py`.
On TPU and GPU that exchange is ragged (`moe_exchange`, `moe_ragged.py`): only routed rows move, into a receive
buffer no routing overflows by default; with `moe_ragged_buffer_factor` > 0 it holds that many times the balanced
share of rows (fewer FLOPs), and the assignments a full buffer leaves home count as dropped (moe/dropped_fraction).
`moe_dropless_impl=dense` keeps the reference: every expert computes every token and the router weights (zero for
experts a token did not choose) combine them, num_experts / k times the expert FLOPs.

Shared experts (`num_shared_experts` = n > 0): a dense SwiGLU every token passes through, beside the routed experts
and added to their output (DeepSeek-style). The n shared experts are one MLP of width n x mlp_dim, params under
"shared" with the dense MLP's logical axes: a SwiGLU of concatenated hidden units is exactly the sum of n separate
SwiGLUs, and one wider matmul beats n narrow ones.

Router losses, per MoE layer, over the non-padding tokens T:
    load balance  num_experts * sum_i f_i * P_i, f_i = share of the T * k assignments that chose expert i (before
                  drops), P_i = mean router probability of expert i. 1.0 when perfectly balanced.
    z-loss        mean over T of logsumexp(logits)^2, keeps router logits small.
Each MoE layer sows them with drop and load counts into the "intermediates" collection (stacked by nn.scan);
`collect_stats`, `loss_sums` and `metrics` turn them into the training objective and the metrics dict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.model.config import ModelConfig
from maxshard.model.layers import moe_grouped
from maxshard.model.layers.linears import DenseGeneral
from maxshard.model.layers.mlp import MLP
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = [
    "EXPERT_EINSUMS",
    "MoEBlock",
    "Routing",
    "capacity",
    "group_size",
    "route",
    "router_losses",
    "collect_stats",
    "loss_sums",
    "objective",
    "metrics",
    "STATS_COLLECTION",
]

STATS_COLLECTION = "intermediates"
_STATS_NAME = "moe_stats"
_LOAD_STAT = "load"  # the one per-expert statistic: [experts]; the others are scalars


# --------------------------------------------------------------------------------------------- capacity


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Slots per expert and group: ceil(tokens * k / experts * factor), at most `tokens` (never more useful)."""
    return max(1, min(tokens, math.ceil(tokens * k / experts * factor)))


def group_size(tokens: int, moe_group_size: int) -> int:
    """Tokens per routing group of a sequence of `tokens`: `moe_group_size`, or the whole sequence when that is 0
    or not shorter (a short sequence, e.g. one decode step, is one group)."""
    if moe_group_size <= 0 or moe_group_size >= tokens:
        return tokens
    if tokens % moe_group_size:
        raise ValueError(f"moe_group_size={moe_group_size} must divide the sequence length {tokens}")
    return moe_group_size


# --------------------------------------------------------------------------------------------- routing


class Routing(NamedTuple):
    """One routing decision. Masks are float32 0/1."""

    dispatch: jax.Array  # [group, tokens, experts, capacity] 1 where the token sits in that slot
    combine: jax.Array  # [group, tokens, experts, capacity] the token's router weight at that slot
    weights: jax.Array  # [group, tokens, experts] renormalised top-k weight, 0 for experts not chosen
    chosen: jax.Array  # [group, tokens, experts] 1 where a real token chose the expert (before drops)
    kept: jax.Array  # [group, tokens, experts] 1 where that choice got a slot
    top_weights: jax.Array  # [group, tokens, k] renormalised weights of the k choices, 0 for padding
    top_experts: jax.Array  # [group, tokens, k] int32 expert of each choice; num_experts (none) for padding


def _top_k(probs: jax.Array, k: int, token_mask: jax.Array, renormalize: bool = True
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k weights [group, tokens, k] (renormalised to sum to 1, or the softmax's own probabilities), their
    experts [group, tokens, k] (num_experts for padding) and one-hot choices [group, tokens, k, experts]."""
    top_probs, top_experts = jax.lax.top_k(probs, k)  # [g, s, k]
    top_weights = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True) if renormalize else top_probs
    choices = jax.nn.one_hot(top_experts, probs.shape[-1], dtype=jnp.int32)  # [g, s, k, e]
    real = token_mask[:, :, None]
    top_experts = jnp.where(real, top_experts, probs.shape[-1]).astype(jnp.int32)
    return top_weights * real, top_experts, choices * real[..., None].astype(jnp.int32)


def _slots(choices: jax.Array) -> jax.Array:
    """Slot of each choice in its expert's queue [group, tokens, k, experts]: choice-major, then position order."""
    g, s, k, e = choices.shape
    queue = choices.transpose(0, 2, 1, 3).reshape(g, k * s, e)  # [g, k*s, e]: all 1st choices, then 2nd, ...
    slots = jnp.cumsum(queue, axis=1) - 1
    return slots.reshape(g, k, s, e).transpose(0, 2, 1, 3)


def route(logits: jax.Array, k: int, slots_per_expert: int, token_mask: jax.Array, renormalize: bool = True
          ) -> Routing:
    """Top-k routing of logits [group, tokens, experts] with `slots_per_expert` slots (dropless: tokens)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_weights, top_experts, choices = _top_k(probs, k, token_mask, renormalize)  # [g, s, k], [g, s, k], [g, s, k, e]
    slots = _slots(choices)  # [g, s, k, e]
    keep = choices * (slots < slots_per_expert)  # [g, s, k, e]
    # An expert appears at most once among a token's k choices, so summing over k loses nothing.
    slot = jnp.sum(slots * keep, axis=2)  # [g, s, e]
    kept = jnp.sum(keep, axis=2).astype(jnp.float32)  # [g, s, e]
    weights = jnp.einsum("gsk,gske->gse", top_weights, choices.astype(jnp.float32))
    dispatch = jax.nn.one_hot(slot, slots_per_expert, dtype=jnp.float32) * kept[..., None]  # [g, s, e, c]
    chosen = jnp.sum(choices, axis=2).astype(jnp.float32)
    return Routing(dispatch, dispatch * weights[..., None], weights, chosen, kept, top_weights, top_experts)


def router_losses(logits: jax.Array, chosen: jax.Array, token_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, z-loss) over the real tokens; logits, chosen [group, tokens, experts]."""
    logits = logits.astype(jnp.float32)
    mask = token_mask.astype(jnp.float32)  # [g, s]
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    probs = jax.nn.softmax(logits, axis=-1)
    mean_prob = jnp.einsum("gse,gs->e", probs, mask) / tokens  # P_i
    share = jnp.sum(chosen, axis=(0, 1)) / jnp.maximum(jnp.sum(chosen), 1.0)  # f_i, no gradient (from top-k)
    balance = logits.shape[-1] * jnp.sum(share * mean_prob)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * mask) / tokens
    return balance, z


def _routing_stats(logits: jax.Array, routing: Routing, token_mask: jax.Array, unsent: jax.Array | float = 0.0
                   ) -> dict[str, jax.Array]:
    """Router losses and counts; `unsent`: dropless assignments a full ragged exchange buffer dropped
    (`moe_ragged.py`), counted with the capacity drops."""
    balance, z = router_losses(logits, routing.chosen, token_mask)
    assigned = jnp.sum(routing.chosen)
    return {
        "lb_loss": balance,
        "z_loss": z,
        "assigned": assigned,
        "dropped": assigned - jnp.sum(routing.kept) + unsent,
        _LOAD_STAT: jnp.sum(routing.chosen, axis=(0, 1)),  # [experts] routed assignments, before drops
    }


# --------------------------------------------------------------------------------------------- the layer


# The routed experts' matmuls by their einsum subscripts: into the hidden width from tokens dispatched per expert
# ('egcm') or shared by all experts ('gcm', the dense path), out of it, and the dropless path's tiles. The dispatch,
# combine and routing einsums of this module are the others: quantization (model/quantization.py) tells them apart
# by these, since a rule can only name the module.
_EXPERT_IN = {"egcm": "egcm,emh->egch", "gcm": "gcm,emh->egch"}
_EXPERT_OUT = "egch,ehm->egcm"
EXPERT_EINSUMS = frozenset({*_EXPERT_IN.values(), _EXPERT_OUT, moe_grouped.TILE_IN, moe_grouped.TILE_OUT})


def _expert_init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Fan-in truncated normal for [experts, in, out]: each expert initialised like a dense kernel."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", 1, 2, batch_axis=(0,))(
        key, shape, dtype
    )


class MoEBlock(nn.Module):
    """Routed SwiGLU experts replacing the MLP: x [batch, length, embed], segment_ids [batch, length]."""

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    def _kernel(self, name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
        init = nn.with_logical_partitioning(_expert_init, axes)
        return jnp.asarray(self.param(name, init, shape, self.weight_dtype), self.dtype)

    def _kernels(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """wi_0, wi_1 [experts, embed, mlp] and wo [experts, mlp, embed], in the compute dtype."""
        e, m, h = self.cfg.num_experts, self.cfg.emb_dim, self.cfg.mlp_dim
        wi_0 = self._kernel("wi_0", (e, m, h), ax.EXPERT_KERNEL)
        wi_1 = self._kernel("wi_1", (e, m, h), ax.EXPERT_KERNEL)
        return wi_0, wi_1, self._kernel("wo", (e, h, m), (ax.EXP, ax.MLP, ax.EMBED))

    def _experts(self, x: jax.Array, spec: str, token_axis: str | None) -> jax.Array:
        """Every expert's SwiGLU. x is [experts, group, tokens, embed] ('egcm') or [group, tokens, embed] ('gcm',
        shared by all experts); returns [experts, group, tokens, embed]."""
        wi_0, wi_1, wo = self._kernels()
        hidden_axes = (ax.ACT_EXP, ax.BATCH_NO_EXP, token_axis, ax.ACT_MLP)
        gate = constrain(jnp.einsum(_EXPERT_IN[spec], x, wi_0), hidden_axes)
        up = constrain(jnp.einsum(_EXPERT_IN[spec], x, wi_1), hidden_axes)
        out = jnp.einsum(_EXPERT_OUT, nn.silu(gate) * up, wo)
        return constrain(out, (ax.ACT_EXP, ax.BATCH_NO_EXP, token_axis, ax.ACT_EMBED))

    def _dropping(self, x: jax.Array, routing: Routing) -> jax.Array:
        """Dispatch to [experts, group, capacity, embed], run the experts, combine back to [group, tokens, embed]."""
        dispatch = constrain(routing.dispatch.astype(self.dtype), (ax.BATCH, ax.LENGTH, None, None))
        dispatched = jnp.einsum("gsm,gsec->egcm", x, dispatch)
        dispatched = constrain(dispatched, ax.DISPATCHED)
        out = self._experts(dispatched, "egcm", None)  # [e, g, c, m]
        combine = constrain(routing.combine.astype(self.dtype), (ax.BATCH, ax.LENGTH, None, None))
        return jnp.einsum("egcm,gsec->gsm", out, combine)

    def _dropless(self, x: jax.Array, routing: Routing) -> tuple[jax.Array, jax.Array | float]:
        """(output, assignments dropped by a full ragged exchange buffer): grouped matmuls over the chosen experts
        (`moe_grouped`), or with `moe_dropless_impl=dense` every expert on every token, weighted by the router
        (0 for experts not chosen), which drops nothing."""
        cfg = self.cfg
        if cfg.moe_dropless_impl != "dense":
            return moe_grouped.dropless(x, routing.top_experts, routing.top_weights, self._kernels(),
                                        cfg.moe_dropless_impl, cfg.moe_exchange, cfg.moe_ragged_buffer_factor)
        x = constrain(x, (ax.BATCH_NO_EXP, ax.LENGTH, ax.ACT_EMBED))
        out = self._experts(x, "gcm", ax.LENGTH)  # [e, g, s, m]
        return jnp.einsum("egsm,gse->gsm", out, routing.weights.astype(self.dtype)), 0.0

    def _routed(self, x: jax.Array, logits: jax.Array, mask: jax.Array) -> jax.Array:
        """The routed experts' output [batch, length, embed]; sows the router statistics."""
        cfg, (batch, length, embed) = self.cfg, x.shape
        if cfg.capacity_factor <= 0:
            routing = route(logits, cfg.num_experts_per_tok, length, mask, cfg.moe_renormalize_top_k)
            y, unsent = self._dropless(x, routing)
            self.sow(STATS_COLLECTION, _STATS_NAME, _routing_stats(logits, routing, mask, unsent))
            return y
        g = group_size(length, cfg.moe_group_size)
        groups = batch * length // g
        x, logits, mask = x.reshape(groups, g, embed), logits.reshape(groups, g, -1), mask.reshape(groups, g)
        routing = route(logits, cfg.num_experts_per_tok, capacity(g, cfg.num_experts_per_tok, cfg.num_experts,
                                                                  cfg.capacity_factor), mask,
                        cfg.moe_renormalize_top_k)
        self.sow(STATS_COLLECTION, _STATS_NAME, _routing_stats(logits, routing, mask))
        return self._dropping(x, routing).reshape(batch, length, embed)

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = constrain(jnp.asarray(x, self.dtype), ax.TOKENS)
        router = DenseGeneral((cfg.num_experts,), (ax.EMBED, None), 1, jnp.float32, self.weight_dtype, name="gate")
        logits = router(x.astype(jnp.float32))  # [batch, length, experts] float32
        y = self._routed(x, logits, segment_ids != 0)
        if cfg.num_shared_experts > 0:
            y = y + MLP(cfg.num_shared_experts * cfg.mlp_dim, self.dtype, self.weight_dtype, name="shared")(x)
        return constrain(y, ax.TOKENS)


# --------------------------------------------------------------------------------------------- losses and metrics


def _find_stats(tree: Mapping[str, Any], found: list[dict[str, jax.Array]]) -> None:
    for key, value in tree.items():
        if key == _STATS_NAME:
            found.extend(value)  # sow keeps a tuple of values
        elif isinstance(value, Mapping):
            _find_stats(value, found)


def collect_stats(intermediates: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Every MoE layer's sown statistics, flattened: scalars [moe_layers], load [moe_layers, experts].

    Under nn.scan a sown value gains leading stacked dims ([layers, ...]); reshaping folds them into one.
    """
    found: list[dict[str, jax.Array]] = []
    _find_stats(intermediates, found)
    if not found:
        return {}

    def flat(name: str, value: jax.Array) -> jax.Array:
        return value.reshape(-1, value.shape[-1]) if name == _LOAD_STAT else value.reshape(-1)

    return {name: jnp.concatenate([flat(name, s[name]) for s in found]) for name in found[0]}


def loss_sums(stats: Mapping[str, jax.Array], weight_sum: jax.Array) -> dict[str, jax.Array]:
    """Per-batch sums that add up across microbatches. Router losses are averaged over MoE layers and scaled by
    the batch's loss weight, so after the step divides by the total weight they are token-weighted means."""
    if not stats:
        return {}
    return {
        "moe_lb_loss": weight_sum * jnp.mean(stats["lb_loss"]),
        "moe_z_loss": weight_sum * jnp.mean(stats["z_loss"]),
        "moe_assigned": jnp.sum(stats["assigned"]),
        "moe_dropped": jnp.sum(stats["dropped"]),
        "moe_load": stats[_LOAD_STAT],  # [moe_layers, experts]
    }


def objective(sums: Mapping[str, jax.Array], balance_weight: float, z_weight: float) -> jax.Array | float:
    """The router losses' share of the summed training objective (0.0 for dense models); the weights are the run's
    `load_balance_loss_weight` and `router_z_loss_weight`."""
    if "moe_lb_loss" not in sums:
        return 0.0
    return balance_weight * sums["moe_lb_loss"] + z_weight * sums["moe_z_loss"]


def metrics(sums: Mapping[str, jax.Array], weight_sum: jax.Array) -> dict[str, jax.Array]:
    """MoE entries of the metrics dict (none for dense models), keyed `moe/...` so TensorBoard groups them.

    Expert load is measured per layer as routed assignments over their mean (1.0: balanced); min and max are
    over all MoE layers and experts, cv (std / mean over experts) is averaged over layers.
    """
    if "moe_lb_loss" not in sums:
        return {}
    load = sums["moe_load"]  # [moe_layers, experts]
    mean = jnp.maximum(jnp.mean(load, axis=-1, keepdims=True), 1e-9)
    relative = load / mean
    return {
        "moe/lb_loss": sums["moe_lb_loss"] / jnp.maximum(weight_sum, 1.0),
        "moe/z_loss": sums["moe_z_loss"] / jnp.maximum(weight_sum, 1.0),
        "moe/dropped_fraction": sums["moe_dropped"] / jnp.maximum(sums["moe_assigned"], 1.0),
        "moe/expert_load_min": jnp.min(relative),
        "moe/expert_load_max": jnp.max(relative),
        "moe/expert_load_cv": jnp.mean(jnp.std(relative, axis=-1)),
    }
