"""Next-token choice from logits: greedy, or sampling with temperature, top-k and top-p (nucleus).

Order of the filters: tokens the model must never emit are removed first (`allowed`: padding of the vocabulary to
`vocab_size_multiple`, PAD and BOS, none of which is ever a training target); then top-k keeps the k most likely;
then top-p keeps the smallest set of the most likely tokens whose probabilities (after temperature and top-k) reach
top_p; then one token is drawn. Temperature 0 is greedy: the first most likely token, no randomness.

Ties are broken by the lowest id everywhere (argmax and a stable sort both prefer it), so top_k=1 is exactly greedy.
The parameters are traced values, not constants: one compiled decode step serves every temperature, top_k and
top_p, and greedy (temperature 0) skips the sort through `lax.cond`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Sampling", "sample", "allowed_tokens"]

_NEG = jnp.finfo(jnp.float32).min


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy; top_k 0: off; top_p 1: off (the config keys of the same names)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(temperature, top_k, top_p) as the scalars a compiled step takes."""
        return np.float32(self.temperature), np.int32(self.top_k), np.float32(self.top_p)


def allowed_tokens(model_vocab: int, tokenizer_vocab: int, never: tuple[int, ...]) -> jax.Array:
    """bool [model_vocab]: ids the tokenizer has, minus `never` (PAD, BOS)."""
    ids = jnp.arange(model_vocab)
    allowed = ids < tokenizer_vocab
    for token in never:
        allowed &= ids != token
    return allowed


def _filtered(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [b, vocab] with everything outside the top-k (by rank, lowest id first among ties) and outside the
    top-p head set to the minimum; top_k <= 0 and top_p >= 1 keep everything."""
    rows = jnp.arange(logits.shape[0])[:, None]
    order = jnp.argsort(-logits, axis=-1, stable=True)  # [b, vocab] most likely first
    ranks = jnp.zeros(logits.shape, jnp.int32).at[rows, order].set(jnp.arange(logits.shape[-1], dtype=jnp.int32))
    logits = jnp.where((top_k <= 0) | (ranks < top_k), logits, _NEG)
    probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)  # still sorted: filtered ones last
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above each one
    keep = jnp.zeros(logits.shape, bool).at[rows, order].set((before < top_p) | (top_p >= 1.0))
    return jnp.where(keep, logits, _NEG)


def sample(logits: jax.Array, allowed: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
    """logits [batch, vocab] float32 -> token ids [batch] int32 (the parameters as in `Sampling.arrays`)."""
    logits = logits.astype(jnp.float32)

    def greedy() -> jax.Array:
        return jnp.argmax(jnp.where(allowed[None, :], logits, _NEG), axis=-1).astype(jnp.int32)

    def draw() -> jax.Array:
        scaled = jnp.where(allowed[None, :], logits / temperature, _NEG)  # masked after dividing: no -inf
        return jax.random.categorical(key, _filtered(scaled, top_k, top_p), axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature == 0, greedy, draw)
