"""MoE routing: router scores (softmax or sigmoid), the top-k choice (optionally limited to the best expert groups and
steered by a selection bias), the slots of the dropping path, and the router losses. The arithmetic of the routing
section of `moe.py`'s docstring, apart from the layer that applies it; `moe` re-exports these names.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxshard.spec.model_config import ModelConfig

__all__ = ["Routing", "Scoring", "route", "router_losses", "router_scores", "sequence_balance_loss"]


class Routing(NamedTuple):
    """One routing decision. Masks are float32 0/1."""

    dispatch: jax.Array  # [group, tokens, experts, capacity] 1 where the token sits in that slot
    combine: jax.Array  # [group, tokens, experts, capacity] the token's router weight at that slot
    weights: jax.Array  # [group, tokens, experts] top-k weight (`_top_k`'s), 0 for experts not chosen
    chosen: jax.Array  # [group, tokens, experts] 1 where a real token chose the expert (before drops)
    kept: jax.Array  # [group, tokens, experts] 1 where that choice got a slot
    top_weights: jax.Array  # [group, tokens, k] weights of the k choices (`_top_k`'s), 0 for padding
    top_experts: jax.Array  # [group, tokens, k] int32 expert of each choice; num_experts (none) for padding


@dataclasses.dataclass(frozen=True)
class Scoring:
    """How router logits become scores and choices (the module docstring): `kind` softmax or sigmoid; experts in
    `n_group` groups of which the `topk_group` best may be chosen; chosen weights renormalised to sum to 1 (or not)
    and multiplied by `scale`."""

    kind: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0
    renormalize: bool = True

    @classmethod
    def of(cls, cfg: ModelConfig) -> Scoring:
        return cls(cfg.moe_router, cfg.moe_n_group, cfg.moe_topk_group, cfg.moe_routed_scaling_factor,
                   cfg.moe_renormalize_top_k)


def router_scores(logits: jax.Array, kind: str) -> jax.Array:
    """Router scores [..., experts] in float32: a softmax over the experts, or each expert's sigmoid."""
    logits = logits.astype(jnp.float32)
    if kind == "sigmoid":
        return jax.nn.sigmoid(logits)
    if kind == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    raise ValueError(f"moe_router must be softmax or sigmoid, got {kind!r}")


def _normalized(scores: jax.Array, kind: str) -> jax.Array:
    """Scores that sum to 1 over the experts (the losses' P_i): the softmax as it is, sigmoids over their sum."""
    return scores if kind == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)


def _group_limited(choice: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """`choice` [..., experts] with the experts outside a token's `topk_group` best groups at -inf; a group's score
    is the sum of its two best choice scores (one when a group holds a single expert)."""
    *lead, experts = choice.shape
    per_group = experts // n_group
    grouped = choice.reshape(*lead, n_group, per_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, per_group))[0], axis=-1)  # [..., n_group]
    best = jax.lax.top_k(group_scores, topk_group)[1]  # [..., topk_group]
    kept = jnp.any(best[..., :, None] == jnp.arange(n_group), axis=-2)  # [..., n_group]
    return jnp.where(jnp.repeat(kept, per_group, axis=-1), choice, -jnp.inf)


def _top_k(scores: jax.Array, k: int, token_mask: jax.Array, scoring: Scoring, bias: jax.Array | None,
           expert_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k weights [group, tokens, k] (the chosen scores, renormalised or not, times the scale and each chosen
    expert's `expert_scale`), their experts [group, tokens, k] (num_experts for padding) and one-hot choices
    [group, tokens, k, experts]. The bias and the group limit decide which experts; the weights are the unbiased
    scores."""
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias).astype(jnp.float32)
    if scoring.n_group > 1 and scoring.topk_group < scoring.n_group:
        choice = _group_limited(choice, scoring.n_group, scoring.topk_group)
    top_experts = jax.lax.top_k(choice, k)[1]  # [g, s, k]
    top_weights = jnp.take_along_axis(scores, top_experts, axis=-1)
    if scoring.renormalize:  # + 1e-20 as transformers' DeepseekV3TopkRouter (a no-op for any real score sum)
        top_weights = top_weights / (jnp.sum(top_weights, axis=-1, keepdims=True) + 1e-20)
    if scoring.scale != 1.0:
        top_weights = top_weights * scoring.scale
    if expert_scale is not None:  # Gemma 4's learned per-expert scale, after the renormalisation
        top_weights = top_weights * jnp.take(expert_scale.astype(jnp.float32), top_experts)
    choices = jax.nn.one_hot(top_experts, scores.shape[-1], dtype=jnp.int32)  # [g, s, k, e]
    real = token_mask[:, :, None]
    top_experts = jnp.where(real, top_experts, scores.shape[-1]).astype(jnp.int32)
    return top_weights * real, top_experts, choices * real[..., None].astype(jnp.int32)


def _slots(choices: jax.Array) -> jax.Array:
    """Slot of each choice in its expert's queue [group, tokens, k, experts]: choice-major, then position order."""
    g, s, k, e = choices.shape
    queue = choices.transpose(0, 2, 1, 3).reshape(g, k * s, e)  # [g, k*s, e]: all 1st choices, then 2nd, ...
    slots = jnp.cumsum(queue, axis=1) - 1
    return slots.reshape(g, k, s, e).transpose(0, 2, 1, 3)


def route(logits: jax.Array, k: int, slots_per_expert: int, token_mask: jax.Array, renormalize: bool = True,
          scoring: Scoring | None = None, bias: jax.Array | None = None, expert_scale: jax.Array | None = None
          ) -> Routing:
    """Top-k routing of logits [group, tokens, experts] with `slots_per_expert` slots (dropless: tokens).
    `scoring` (default: a softmax with `renormalize`), the selection `bias` [experts] and the weights' per-expert
    `expert_scale` [experts] (Gemma 4) as layers/moe.py's docstring."""
    scoring = scoring or Scoring(renormalize=renormalize)
    scores = router_scores(logits, scoring.kind)
    top_weights, top_experts, choices = _top_k(scores, k, token_mask, scoring, bias, expert_scale)
    slots = _slots(choices)  # [g, s, k, e]
    keep = choices * (slots < slots_per_expert)  # [g, s, k, e]
    # An expert appears at most once among a token's k choices, so summing over k loses nothing.
    slot = jnp.sum(slots * keep, axis=2)  # [g, s, e]
    kept = jnp.sum(keep, axis=2).astype(jnp.float32)  # [g, s, e]
    weights = jnp.einsum("gsk,gske->gse", top_weights, choices.astype(jnp.float32))
    dispatch = jax.nn.one_hot(slot, slots_per_expert, dtype=jnp.float32) * kept[..., None]  # [g, s, e, c]
    chosen = jnp.sum(choices, axis=2).astype(jnp.float32)
    return Routing(dispatch, dispatch * weights[..., None], weights, chosen, kept, top_weights, top_experts)


def router_losses(logits: jax.Array, chosen: jax.Array, token_mask: jax.Array, kind: str = "softmax"
                  ) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, z-loss) over the real tokens; logits, chosen [group, tokens, experts]."""
    logits = logits.astype(jnp.float32)
    mask = token_mask.astype(jnp.float32)  # [g, s]
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    probs = _normalized(router_scores(logits, kind), kind)
    mean_prob = jnp.einsum("gse,gs->e", probs, mask) / tokens  # P_i
    share = jnp.sum(chosen, axis=(0, 1)) / jnp.maximum(jnp.sum(chosen), 1.0)  # f_i, no gradient (from top-k)
    balance = logits.shape[-1] * jnp.sum(share * mean_prob)
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * mask) / tokens
    return balance, z


def sequence_balance_loss(logits: jax.Array, chosen: jax.Array, token_mask: jax.Array, k: int,
                          kind: str = "softmax") -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss (module docstring) of logits, chosen [sequences, tokens, experts]:
    per sequence sum_i f_i P_i, f_i = E / (k T) x count of its T real tokens choosing i, P_i = their mean
    normalised score of i; the mean over sequences holding a real token. 1.0 when every sequence is balanced."""
    mask = token_mask.astype(jnp.float32)  # [b, s]
    tokens = jnp.sum(mask, axis=1)  # [b]
    per_token = jnp.maximum(tokens, 1.0)[:, None]
    experts = logits.shape[-1]
    f = experts / k * jnp.sum(chosen, axis=1) / per_token  # [b, e]; padding chose nothing
    p = jnp.einsum("bse,bs->be", _normalized(router_scores(logits, kind), kind), mask) / per_token
    real = (tokens > 0).astype(jnp.float32)
    return jnp.sum(jnp.sum(f * p, axis=-1) * real) / jnp.maximum(jnp.sum(real), 1.0)
