"""Per-token log-probabilities of the targets, from the logits whole or in chunks of the sequence: what every
objective (`maxshard/objectives`) computes its loss from. `loss_sums` is the `lm` objective's cross-entropy of them.

The logits of a batch are [batch, length, vocab] in float32, and their gradient as large again. For a large
vocabulary that is the biggest array of a step: Llama-3's 128k vocabulary at 4 x 8192 tokens per device is 16.8 GB,
over half a v6e chip, for the logits alone. With `loss_chunks` C > 1 the output head and the loss run over C pieces
of the sequence in turn (`jax.lax.scan`), each rematerialised in the backward pass (`jax.checkpoint`): only one
piece's logits [batch, length / C, vocab] and their gradient exist at a time, for one more head matmul per token
in the backward pass.

The pieces are strided, not contiguous: piece c holds positions c, c + C, c + 2C, ... So every piece is spread over
the same devices as the whole sequence when context or sequence parallelism shards the length (a contiguous piece
would sit on a few of them). The pieces' log-probabilities are put back in order ([batch, length] is small).

With `groups` (parallel/token_groups.py) the head's weights are gathered once before the scan and their gradient
reduced once after it, not at every piece: each device applies its own copy of the head to its own tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxshard.parallel.token_groups import TokenGroups

__all__ = ["token_logps", "chunked_token_logps", "GroupedHead", "grouped_token_logps", "head_token_logps",
           "loss_sums"]


def token_logps(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """float32 [batch, length]: log p(target) under float32 logits [batch, length, vocab]."""
    return -optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def loss_sums(logits: jax.Array, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted cross-entropy, sum of weights) over [batch, length]."""
    weights = batch["loss_weights"].astype(jnp.float32)
    return jnp.sum(-token_logps(logits, batch["targets"]) * weights), jnp.sum(weights)


def _strided(a: jax.Array, chunks: int) -> jax.Array:
    """[batch, length, ...] -> [chunks, batch, length / chunks, ...]; piece c holds positions c, c + chunks, ..."""
    batch, length = a.shape[:2]
    return jnp.moveaxis(a.reshape(batch, length // chunks, chunks, *a.shape[2:]), 2, 0)


def _unstrided(pieces: jax.Array) -> jax.Array:
    """The inverse of `_strided` for [chunks, batch, length / chunks] -> [batch, length]."""
    chunks, batch, per_piece = pieces.shape
    return jnp.moveaxis(pieces, 0, 2).reshape(batch, per_piece * chunks)


def chunked_token_logps(head: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                        chunks: int, logps: Callable[[jax.Array, jax.Array], jax.Array] = token_logps) -> jax.Array:
    """`logps(head(hidden), targets)` without the whole logits: `head` maps [batch, tokens, embed] to float32
    logits [batch, tokens, vocab]; `hidden` is [batch, length, embed]; `chunks` divides the length."""

    @jax.checkpoint
    def piece(x: jax.Array, piece_targets: jax.Array) -> jax.Array:
        return logps(head(x), piece_targets)

    def step(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        return None, piece(*xs)

    _, pieces = jax.lax.scan(step, None, (_strided(hidden, chunks), _strided(targets, chunks)))
    return _unstrided(pieces)


@dataclasses.dataclass(frozen=True)
class GroupedHead:
    """The output head with its weights explicit, for `grouped_token_logps`: `apply(weights, x)` maps [rows,
    tokens, embed] to float32 logits and reads nothing else that takes a gradient; `weights` is sharded as
    `shardings`."""

    apply: Callable[[Any, jax.Array], jax.Array]
    weights: Any
    shardings: Any
    groups: TokenGroups


def grouped_token_logps(head: GroupedHead, hidden: jax.Array, targets: jax.Array, chunks: int,
                        logps: Callable[[jax.Array, jax.Array], jax.Array] = token_logps) -> jax.Array:
    """`chunked_token_logps` with the head's weights gathered once and their gradient reduced once (module
    docstring): the same numbers."""
    groups = head.groups
    per_group = groups.map(lambda w, x, t: logps(head.apply(w, x), t))

    def pieces_of(weights: Any, hidden: jax.Array) -> jax.Array:
        spread = groups.weights(weights, head.shardings)

        @jax.checkpoint
        def piece(x: jax.Array, piece_targets: jax.Array) -> jax.Array:
            return groups.ungroup(per_group(spread, groups.tokens(x), groups.tokens(piece_targets)))

        def step(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
            return None, piece(*xs)

        _, pieces = jax.lax.scan(step, None, (_strided(hidden, chunks), _strided(targets, chunks)))
        return _unstrided(pieces)

    return _reduced_before_the_layers(pieces_of)(head.weights, hidden)


def head_token_logps(head: GroupedHead | Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                     chunks: int, logps: Callable[[jax.Array, jax.Array], jax.Array] = token_logps) -> jax.Array:
    """The targets' log-probabilities over `chunks` pieces with the head a step chose (Trainer._head): grouped when it
    is a GroupedHead, else the plain head piece by piece."""
    if isinstance(head, GroupedHead):
        return grouped_token_logps(head, hidden, targets, chunks, logps)
    return chunked_token_logps(head, hidden, targets, chunks, logps)


def _reduced_before_the_layers(fn: Callable[[Any, jax.Array], jax.Array]) -> Callable[[Any, jax.Array], jax.Array]:
    """`fn(weights, hidden)`, whose backward hands out the weights' (reduced) gradient and the hidden's together,
    behind an optimization barrier: the layers' backward, which reads the hidden's gradient, starts only after the
    weights' whole gradient is reduced to its shard and freed. Without it XLA:TPU may delay that reduction into the
    layers' backward, holding the whole float32 gradient there (seen in the 125m held-out shapes' live buffers)."""

    @jax.custom_vjp
    def run(weights: Any, hidden: jax.Array) -> jax.Array:
        return fn(weights, hidden)

    def forward(weights: Any, hidden: jax.Array) -> tuple[jax.Array, Callable]:
        return jax.vjp(fn, weights, hidden)

    def backward(vjp: Callable, cotangent: jax.Array) -> tuple[Any, jax.Array]:
        return jax.lax.optimization_barrier(vjp(cotangent))

    run.defvjp(forward, backward)
    return run
