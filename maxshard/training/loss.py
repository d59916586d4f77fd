"""The training loss: weighted cross-entropy of next-token logits, whole or in chunks of the sequence.

The logits of a batch are [batch, length, vocab] in float32, and their gradient as large again. For a large
vocabulary that is the biggest array of a step: Llama-3's 128k vocabulary at 4 x 8192 tokens per device is 16.8 GB,
over half a v6e chip, for the logits alone. With `loss_chunks` C > 1 the output head and the loss run over C pieces
of the sequence in turn (`jax.lax.scan`), each rematerialised in the backward pass (`jax.checkpoint`): only one
piece's logits [batch, length / C, vocab] and their gradient exist at a time, for one more head matmul per token
in the backward pass.

The pieces are strided, not contiguous: piece c holds positions c, c + C, c + 2C, ... So every piece is spread over
the same devices as the whole sequence when context or sequence parallelism shards the length (a contiguous piece
would sit on a few of them). The loss is a sum over tokens, so the order does not change it beyond rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

__all__ = ["loss_sums", "chunked_loss_sums"]


def loss_sums(logits: jax.Array, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted cross-entropy, sum of weights) over [batch, length]."""
    return _sums(logits, batch["targets"], batch["loss_weights"])


def _sums(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weights = weights.astype(jnp.float32)
    return jnp.sum(ce * weights), jnp.sum(weights)


def _strided(a: jax.Array, chunks: int) -> jax.Array:
    """[batch, length, ...] -> [chunks, batch, length / chunks, ...]; piece c holds positions c, c + chunks, ..."""
    batch, length = a.shape[:2]
    return jnp.moveaxis(a.reshape(batch, length // chunks, chunks, *a.shape[2:]), 2, 0)


def chunked_loss_sums(
    head: Callable[[jax.Array], jax.Array], hidden: jax.Array, batch: Mapping[str, jax.Array], chunks: int
) -> tuple[jax.Array, jax.Array]:
    """`loss_sums(head(hidden), batch)` without the whole logits: `head` maps [batch, tokens, embed] to float32
    logits [batch, tokens, vocab]; `hidden` is [batch, length, embed]; `chunks` divides the length."""

    @jax.checkpoint
    def piece(x: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _sums(head(x), targets, weights)

    def step(carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], None]:
        loss, weight = piece(*xs)
        return (carry[0] + loss, carry[1] + weight), None

    pieces = tuple(_strided(a, chunks) for a in (hidden, batch["targets"], batch["loss_weights"]))
    zero = jnp.zeros((), jnp.float32)
    (loss_sum, weight_sum), _ = jax.lax.scan(step, (zero, zero), pieces)
    return loss_sum, weight_sum
