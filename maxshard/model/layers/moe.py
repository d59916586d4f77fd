"""Mixture of Experts: top-k routing with per-expert capacity (token dropping), expert parallelism, router losses.

Routing runs in float32. The router's logits become scores, a softmax over `num_experts` (Mixtral, Qwen) or an
elementwise sigmoid (`moe_router: sigmoid`, DeepSeek-V3), and each token picks its top `k` experts by score; their
scores are renormalised to sum to 1 (Mixtral's softmax over the top-k logits is the same function; with
`moe_renormalize_top_k: false` they keep their own values, as Qwen3-MoE without norm_topk_prob), multiplied by
`moe_routed_scaling_factor`, and weigh the experts' outputs (drops do not renormalise again). DeepSeek-V3's two
additions, exactly as transformers' DeepseekV3TopkRouter computes them (tests/test_moe_routing.py holds its
choices on a fixture):

  group-limited  the experts fall in `moe_n_group` equal groups of consecutive ids; a group's score is the sum of
                 its two best (biased) scores; only the experts of the `moe_topk_group` best groups may be chosen.
  selection bias `moe_router_bias`: a per-expert bias `router_bias` [experts] (float32, beside the router kernel
                 `gate`; Hugging Face's `mlp.gate.e_score_correction_bias`) is added to the scores for choosing
                 (the groups and the top k) and never to the weights. It never trains (model/trainable.py keeps it
                 frozen): the train step moves it by `moe_bias_update_rate` toward equal load after every step
                 (`move_bias`, aux-loss-free balancing), from the per-layer loads the layer sows beside it.

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
On TPU and GPU that exchange is ragged by default (`moe_exchange`, `moe_ragged.py`; on CPU emulated if asked
for): only routed rows move, into a receive buffer no routing overflows by default; with `moe_ragged_buffer_factor`
> 0 it holds that many times the balanced share of rows (fewer FLOPs), and the assignments a full buffer leaves home
count as dropped (moe/dropped_fraction).
`moe_dropless_impl=dense` keeps the reference: every expert computes every token and the router weights (zero for
experts a token did not choose) combine them, num_experts / k times the expert FLOPs.

Routed experts are `expert_dim` wide (`moe_mlp_dim`, else mlp_dim). Shared experts (`num_shared_experts` = n > 0):
a dense SwiGLU every token passes through, beside the routed experts and added to their output (DeepSeek-style,
never scaled by `moe_routed_scaling_factor`). The n shared experts are one MLP of width n x expert_dim, params under
"shared" with the dense MLP's logical axes: a SwiGLU of concatenated hidden units is exactly the sum of n separate
SwiGLUs, and one wider matmul beats n narrow ones. With `shared_expert_gate` (Qwen3-Next, Qwen3.5-MoE) their output
is multiplied per token by sigmoid(x @ w), w [embed, 1] ("shared_gate", transformers' shared_expert_gate), before it
joins the routed experts'.

Weights on the input (`moe_weights_on_input`, Llama 4, top-1 routing): each token goes into its expert already
multiplied by its router weight, and the expert's output joins unweighted (transformers' Llama4TextMoe); the gated
MLP is not linear in its input, so this is another function than weighting the output. Every path takes it by
the same exchange of weights (`_weighed`): the scaled tokens, and a routing whose weights are 1.

Biases (`moe_bias`, GPT-OSS): the router's logits gain a bias `gate/bias` [experts] (it moves the choice and the
weights alike, unlike DeepSeek's selection bias), and every expert's gate, up and down projections gain biases
`bi_0`, `bi_1` [experts, mlp] and `bo` [experts, embed]; an expert's output (its `bo` included) is weighted by the
router, as transformers' GptOssExperts computes it. Every path (dropping, dropless grouped and dense, under expert
parallelism) applies them, and the experts' activation is the model's (`mlp_activation`: GPT-OSS's clamped SwiGLU).

Beside the MLP (`moe_beside_mlp`, Gemma 4's MoE block): the layer keeps its dense MLP and the experts run beside
it (layers/decoder.py adds their outputs). The experts read their own norm of the layer's residual stream; the
router reads the residual itself, normalised without a weight, times a learned scale ("router_norm") and
embed^-1/2, and the renormalised top-k weights are multiplied by a learned per-expert scale ("expert_scale"
[experts]), as transformers' Gemma4TextRouter computes them.

Router losses, per MoE layer, over the non-padding tokens T:
    load balance  num_experts * sum_i f_i * P_i, f_i = share of the T * k assignments that chose expert i (before
                  drops), P_i = mean normalised score of expert i (the softmax; sigmoid scores divided by their
                  sum over experts). 1.0 when perfectly balanced.
    sequence      DeepSeek-V3's sequence-wise balance loss (its eq. 17-20): the same sum per sequence (a batch row,
                  its real tokens), f_i = E / (k T) x tokens of the row choosing i, averaged over the rows that hold
                  a real token; weighted by the run's `moe_seq_balance_loss_weight`.
    z-loss        mean over T of logsumexp(logits)^2, keeps router logits small.
Each MoE layer sows them with drop and load counts into the "intermediates" collection (stacked by nn.scan);
layers/moe_stats.py (`collect_stats`, `loss_sums`, `objective`, `metrics`, `move_bias`; re-exported here) turns
them into the training objective, the metrics dict and the selection biases' moves.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import moe_grouped
from maxshard.model.layers.linears import DenseGeneral
from maxshard.model.layers.mlp import MLP, activation
from maxshard.model.layers.norms import RMSNorm
from maxshard.model.layers.moe_routing import (Routing, Scoring, route, router_losses, router_scores,
                                                sequence_balance_loss)
from maxshard.model.layers.moe_stats import (BIAS_LOAD, BIAS_PARAM, LOAD_STAT, STATS_COLLECTION, STATS_NAME,
                                              collect_stats, loss_sums, metrics, move_bias, objective)
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = [
    "EXPERT_EINSUMS",
    "MoEBlock",
    "Routing",
    "Scoring",
    "BIAS_PARAM",
    "EXPERT_SCALE",
    "capacity",
    "group_size",
    "route",
    "router_losses",
    "router_scores",
    "sequence_balance_loss",
    "collect_stats",
    "move_bias",
    "loss_sums",
    "objective",
    "metrics",
    "STATS_COLLECTION",
]



EXPERT_SCALE = "expert_scale"  # Gemma 4's per-expert scale of the router weights (`moe_beside_mlp`)


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


def _routing_stats(logits: jax.Array, routing: Routing, token_mask: jax.Array, kind: str, sequences: int,
                   unsent: jax.Array | float = 0.0) -> dict[str, jax.Array]:
    """Router losses and counts; `sequences`: the batch rows the groups fold back into (the sequence-wise loss);
    `unsent`: dropless assignments a full ragged exchange buffer dropped (`moe_ragged.py`), counted with the
    capacity drops."""
    balance, z = router_losses(logits, routing.chosen, token_mask, kind)
    k = routing.top_experts.shape[-1]
    per_row = lambda v: v.reshape(sequences, -1, *v.shape[2:])  # noqa: E731 [groups, g, ...] -> [batch, length, ...]
    seq = sequence_balance_loss(per_row(logits), per_row(routing.chosen), per_row(token_mask), k, kind)
    assigned = jnp.sum(routing.chosen)
    return {
        "lb_loss": balance,
        "z_loss": z,
        "seq_loss": seq,
        "assigned": assigned,
        "dropped": assigned - jnp.sum(routing.kept) + unsent,
        LOAD_STAT: jnp.sum(routing.chosen, axis=(0, 1)),  # [experts] routed assignments, before drops
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
    """Routed gated-MLP experts replacing the MLP: x [batch, length, embed], segment_ids [batch, length]. With
    `moe_bias` (GPT-OSS) the router's logits and every expert's three projections carry biases."""

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    def _kernel(self, name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
        init = nn.with_logical_partitioning(_expert_init, axes)
        return jnp.asarray(self.param(name, init, shape, self.weight_dtype), self.dtype)

    def _bias(self, name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
        init = nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)
        return jnp.asarray(self.param(name, init, shape, self.weight_dtype), self.dtype)

    def _kernels(self) -> moe_grouped.Kernels:
        """wi_0, wi_1 [experts, embed, mlp] and wo [experts, mlp, embed], in the compute dtype; with `moe_bias`
        (GPT-OSS) also each expert's biases bi_0, bi_1 [experts, mlp] (added to the gate and up projections) and
        bo [experts, embed] (added to its output, before the router weight)."""
        e, m, h = self.cfg.num_experts, self.cfg.emb_dim, self.cfg.expert_dim
        wi_0 = self._kernel("wi_0", (e, m, h), ax.EXPERT_KERNEL)
        wi_1 = self._kernel("wi_1", (e, m, h), ax.EXPERT_KERNEL)
        kernels = (wi_0, wi_1, self._kernel("wo", (e, h, m), (ax.EXP, ax.MLP, ax.EMBED)))
        if not self.cfg.moe_bias:
            return kernels
        return kernels + (self._bias("bi_0", (e, h), moe_grouped.EXPERT_BIAS_AXES[0]),
                          self._bias("bi_1", (e, h), moe_grouped.EXPERT_BIAS_AXES[1]),
                          self._bias("bo", (e, m), moe_grouped.EXPERT_BIAS_AXES[2]))

    def _experts(self, x: jax.Array, spec: str, token_axis: str | None) -> jax.Array:
        """Every expert's gated MLP (`mlp_activation`). x is [experts, group, tokens, embed] ('egcm') or [group,
        tokens, embed] ('gcm', shared by all experts); returns [experts, group, tokens, embed]."""
        kernels = self._kernels()
        wi_0, wi_1, wo = kernels[:3]
        hidden_axes = (ax.ACT_EXP, ax.BATCH_NO_EXP, token_axis, ax.ACT_MLP)
        gate = jnp.einsum(_EXPERT_IN[spec], x, wi_0)
        up = jnp.einsum(_EXPERT_IN[spec], x, wi_1)
        if len(kernels) > 3:  # per-expert biases, broadcast over [group, tokens]
            gate, up = gate + kernels[3][:, None, None, :], up + kernels[4][:, None, None, :]
        gate, up = constrain(gate, hidden_axes), constrain(up, hidden_axes)
        out = jnp.einsum(_EXPERT_OUT, activation(self.cfg)(gate, up), wo)
        if len(kernels) > 3:
            out = out + kernels[5][:, None, None, :]
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
                                        cfg.moe_dropless_impl, cfg.moe_exchange, cfg.moe_ragged_buffer_factor,
                                        activation(cfg))
        x = constrain(x, (ax.BATCH_NO_EXP, ax.LENGTH, ax.ACT_EMBED))
        out = self._experts(x, "gcm", ax.LENGTH)  # [e, g, s, m]
        return jnp.einsum("egsm,gse->gsm", out, routing.weights.astype(self.dtype)), 0.0

    def _routed(self, x: jax.Array, logits: jax.Array, mask: jax.Array, bias: jax.Array | None,
                expert_scale: jax.Array | None) -> jax.Array:
        """The routed experts' output [batch, length, embed]; sows the router statistics (and, with a selection
        bias, the load beside it)."""
        cfg, (batch, length, embed) = self.cfg, x.shape
        scoring, k = Scoring.of(cfg), cfg.num_experts_per_tok
        if cfg.capacity_factor <= 0:
            routing = route(logits, k, length, mask, scoring=scoring, bias=bias, expert_scale=expert_scale)
            y, unsent = self._dropless(*self._weighed(x, routing))
            self._sow(logits, routing, mask, batch, bias, unsent)
            return y
        g = group_size(length, cfg.moe_group_size)
        groups = batch * length // g
        x, logits, mask = x.reshape(groups, g, embed), logits.reshape(groups, g, -1), mask.reshape(groups, g)
        routing = route(logits, k, capacity(g, k, cfg.num_experts, cfg.capacity_factor), mask, scoring=scoring,
                        bias=bias, expert_scale=expert_scale)
        self._sow(logits, routing, mask, batch, bias)
        return self._dropping(*self._weighed(x, routing)).reshape(batch, length, embed)

    def _weighed(self, x: jax.Array, routing: Routing) -> tuple[jax.Array, Routing]:
        """(x, routing) as the experts take them: unchanged, or with `moe_weights_on_input` (Llama 4, top-1) each
        token scaled by its router weight on the way in and the experts' outputs combined with weight 1."""
        if not self.cfg.moe_weights_on_input:
            return x, routing
        weight = routing.top_weights[..., :1]  # [..., tokens, 1]: k = 1 (config/ranges.py); 0 for padding
        real = (routing.top_experts[..., :1] < self.cfg.num_experts).astype(routing.top_weights.dtype)
        ones = routing._replace(combine=routing.dispatch, weights=routing.chosen, top_weights=real)
        return x * weight.astype(x.dtype), ones

    def _sow(self, logits: jax.Array, routing: Routing, mask: jax.Array, batch: int, bias: jax.Array | None,
             unsent: jax.Array | float = 0.0) -> None:
        stats = _routing_stats(logits, routing, mask, self.cfg.moe_router, batch, unsent)
        self.sow(STATS_COLLECTION, STATS_NAME, stats)
        if bias is not None:  # the train step's `move_bias` finds it by the bias's own path
            self.sow(STATS_COLLECTION, BIAS_LOAD, stats[LOAD_STAT])

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, residual: jax.Array | None = None) -> jax.Array:
        """x [batch, length, embed] -> the experts' output. `residual`: with `moe_beside_mlp` (Gemma 4) the
        layer's residual stream, which the router reads through its own norm (x is the experts' norm of it)."""
        cfg = self.cfg
        x = constrain(jnp.asarray(x, self.dtype), ax.TOKENS)
        router = DenseGeneral((cfg.num_experts,), (ax.EMBED, None), 1, jnp.float32, self.weight_dtype,
                              use_bias=cfg.moe_bias, name="gate")  # GPT-OSS's router has a bias
        logits = router(self._router_input(x, residual))  # [batch, length, experts] float32
        # float32 whatever weight_dtype: steps of moe_bias_update_rate (DeepSeek-V3: 0.001) vanish in bfloat16.
        bias = self.param(BIAS_PARAM, nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)),
                          (cfg.num_experts,), jnp.float32) if cfg.moe_router_bias else None
        expert_scale = self.param(EXPERT_SCALE, nn.with_logical_partitioning(nn.initializers.ones_init(), (None,)),
                                  (cfg.num_experts,), self.weight_dtype) if cfg.moe_beside_mlp else None
        y = self._routed(x, logits, segment_ids != 0, bias, expert_scale)
        if cfg.num_shared_experts > 0:
            y = y + self._shared(x)
        return constrain(y, ax.TOKENS)

    def _router_input(self, x: jax.Array, residual: jax.Array | None) -> jax.Array:
        """What the router reads, in float32: x, or with `moe_beside_mlp` the residual normalised without a weight,
        times a learned scale (not 1 + scale) and embed^-1/2 (Gemma 4)."""
        if not self.cfg.moe_beside_mlp:
            return x.astype(jnp.float32)
        residual = constrain(jnp.asarray(residual, jnp.float32), ax.TOKENS)
        norm = RMSNorm(self.cfg.norm_epsilon, jnp.float32, self.weight_dtype, name="router_norm")
        return norm(residual) * self.cfg.emb_dim ** -0.5

    def _shared(self, x: jax.Array) -> jax.Array:
        """The shared experts' output [batch, length, embed]; with `shared_expert_gate` scaled per token by
        sigmoid(x @ w) ([embed, 1], in the compute dtype as transformers' Linear)."""
        cfg = self.cfg
        out = MLP(cfg.num_shared_experts * cfg.expert_dim, self.dtype, self.weight_dtype, gated=activation(cfg),
                  name="shared")(x)
        if not cfg.shared_expert_gate:
            return out
        gate = DenseGeneral((1,), (ax.EMBED, None), 1, self.dtype, self.weight_dtype, name="shared_gate")(x)
        return out * jax.nn.sigmoid(gate)
