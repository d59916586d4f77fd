"""Generation in fewer rows than prompts: a row whose sequence finished takes the next waiting prompt, so the batch
never waits for its longest completion (`Engine.generate(..., rows=R)`; GRPO's `grpo_rollout_rows`).

The engine's batch holds R rows (rounded up to the cache's batch shards). A refill is one compiled call: the
prefill of a whole [R, P] batch of prompts into a fresh cache (`Engine._prefill`), of which only the rows being
refilled are kept. Their cache rows, first token, position and done flag replace the finished rows' (a select
along each cache leaf's batch axis, found from its logical name), and the other rows go on untouched: rows never
read one another (attention is within a row and MoE routes dropless in generation), so a sequence's tokens do
not depend on what shares the batch with it.

The host loop runs decode steps in chunks and reads the new tokens after each: a chunk is at most the engine's
done-check period and never longer than the fewest tokens any row may still add, so no row writes past its cache
(P + max_new_tokens slots). After a chunk, rows that emitted a stop id or reached max_new_tokens are finished and
refilled from the waiting prompts; rows with none left idle (they run on, their tokens dropped) until every row
has. The sampling keys are the
run's (new token i of the loop draws with fold_in(key, i), the k-th refill's prefill with its own fold), so the
same prompts, parameters and seed give the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxshard.generation import decode
from maxshard.generation.sampling import Sampling
from maxshard.parallel import axis_names as ax
from maxshard.training.step import mesh_context

if TYPE_CHECKING:
    from maxshard.generation.decode import Engine, Result

__all__ = ["generate"]

_REFILL_KEYS = 1 << 24  # the k-th refill's prefill draws with fold_in(key, _REFILL_KEYS + k), apart from the steps'


def _batch_axes(boxed: Any) -> Any:
    """Each cache leaf's batch axis, from its logical names (every leaf has one: a cache is per sequence)."""
    return jax.tree.map(lambda b: b.names.index(ax.CACHE_BATCH), boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _compile(engine: Engine, batch: int, prompt_length: int, cache_length: int) -> Any:
    """The refill step for this shape (module docstring), compiled once per shape."""
    shape = (batch, prompt_length, cache_length)
    if shape in engine._refills:
        return engine._refills[shape]
    cache_shardings, zeros, step_out = engine._layout(batch, cache_length)
    axes = _batch_axes(engine.abstract_cache(batch, cache_length))

    def refill(params: Any, cache: Any, tokens: jax.Array, positions: jax.Array, done: jax.Array, prompts: jax.Array,
               lengths: jax.Array, fresh: jax.Array, key: jax.Array, pad_stops: jax.Array,
               sampling: tuple[jax.Array, ...]) -> Any:
        empty = jax.tree.map(lambda z: jnp.zeros(z.shape, z.dtype), zeros)
        first, logits, filled, first_done, first_positions = engine._prefill(params, empty, prompts, lengths, key,
                                                                             pad_stops, sampling)

        def select(new: jax.Array, old: jax.Array, axis: int) -> jax.Array:
            shape = [1] * old.ndim
            shape[axis] = batch
            return jnp.where(fresh.reshape(shape), new, old)

        cache = jax.tree.map(select, filled, cache, axes)
        return (jnp.where(fresh, first, tokens), logits, cache, jnp.where(fresh, first_done, done),
                jnp.where(fresh, first_positions, positions))

    rows, replicated = step_out[0], NamedSharding(engine.mesh, PartitionSpec())
    vector = jax.ShapeDtypeStruct((batch,), jnp.int32)
    with mesh_context(engine.mesh, engine.rules):
        step = jax.jit(refill, donate_argnums=1, out_shardings=step_out, compiler_options=engine._options,
                       in_shardings=(engine._params_shardings(), cache_shardings, rows, rows, rows, rows, rows, rows,
                                     replicated, replicated, (replicated,) * 3))
        step = step.lower(engine.params, zeros, vector, vector, jax.ShapeDtypeStruct((batch,), bool),
                          jax.ShapeDtypeStruct((batch, prompt_length), jnp.int32), vector,
                          jax.ShapeDtypeStruct((batch,), bool), jax.random.key(0), decode._PAD_STOPS,
                          Sampling().arrays()).compile()
    engine._refills[shape] = step
    return step


def generate(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | Sequence[int],
             pad_id: int, sampling: Sampling, seed: int, rows: int, prompt_length: int = 0) -> Result:
    """Each prompt continued by up to `max_new_tokens` tokens in `rows` rows (module docstring); the Result of
    `Engine.generate`, its prefill time every refill's."""
    multiple = decode.batch_multiple(engine.mesh, engine.rules)
    rows = -(-rows // multiple) * multiple
    prompt_length = max(max(len(p) for p in prompts), prompt_length)
    started = time.perf_counter()
    new_cache, step = engine.compile_decode(rows, prompt_length + max_new_tokens)
    refill = _compile(engine, rows, prompt_length, prompt_length + max_new_tokens)
    compile_seconds = time.perf_counter() - started
    loop = _Loop(engine, refill, step, jax.random.key(seed), sampling.arrays(), rows, prompt_length, pad_id,
                 decode.stop_tuple(eos_id), max_new_tokens)
    result = loop(prompts, new_cache)
    result.compile_seconds = compile_seconds
    return result


class _Loop:
    """One refilled generation's host loop (module docstring)."""

    def __init__(self, engine: Engine, refill: Any, step: Any, key: jax.Array, sampling: tuple[np.ndarray, ...],
                 rows: int, prompt_length: int, pad_id: int, stops: tuple[int, ...], max_new_tokens: int) -> None:
        self.engine, self.refill, self.step, self.key, self.sampling = engine, refill, step, key, sampling
        self.rows, self.prompt_length, self.pad_id, self.stops = rows, prompt_length, pad_id, stops
        self.max_new_tokens = max_new_tokens
        self.pad_stops = np.array([pad_id, *stops, *[-1] * (decode.MAX_STOP_IDS - len(stops))], np.int32)
        self.prefill_seconds = self.decode_seconds = 0.0
        self.refills = self.steps = 0

    def __call__(self, prompts: Sequence[Sequence[int]], new_cache: Any) -> Result:
        waiting = list(range(len(prompts)))[::-1]  # popped from the end: prompt order
        serving = [-1] * self.rows  # the prompt each row continues, -1: idle
        out: list[list[int]] = [[] for _ in prompts]
        cache = jax.block_until_ready(new_cache())
        state = (np.zeros(self.rows, np.int32), np.zeros(self.rows, np.int32), np.ones(self.rows, bool))
        finished = list(range(self.rows))
        while True:
            fresh = self._assign(finished, waiting, serving)
            if fresh.any():
                state, cache = self._refill(cache, state, fresh, serving, prompts, out)
            if all(p < 0 for p in serving):
                break
            left = min(self.max_new_tokens - len(out[p]) for p in serving if p >= 0)
            state, cache = self._decode(cache, state, min(left, decode._CHECK_DONE_EVERY), serving, out)
            finished = [r for r, p in enumerate(serving) if p >= 0 and self._finished(out[p])]
        tokens = [decode._until_eos(row[: self.max_new_tokens], self.stops) for row in out]
        return decode.Result(tokens, sum(len(p) for p in prompts), self.prefill_seconds, self.steps,
                             self.decode_seconds, 0.0)

    def _finished(self, tokens: list[int]) -> bool:
        return len(tokens) >= self.max_new_tokens or any(t in self.stops for t in tokens)

    def _assign(self, finished: list[int], waiting: list[int], serving: list[int]) -> np.ndarray:
        """The finished rows take the next waiting prompts (the rest idle); [rows] bool of the rows refilled."""
        fresh = np.zeros(self.rows, bool)
        for r in finished:
            serving[r] = waiting.pop() if waiting else -1
            fresh[r] = serving[r] >= 0
        return fresh

    def _refill(self, cache: Any, state: tuple, fresh: np.ndarray, serving: list[int],
                prompts: Sequence[Sequence[int]], out: list[list[int]]) -> tuple[tuple, Any]:
        batch = np.full((self.rows, self.prompt_length), self.pad_id, np.int32)
        lengths = np.ones(self.rows, np.int32)
        for r in np.flatnonzero(fresh):
            batch[r, : len(prompts[serving[r]])] = prompts[serving[r]]
            lengths[r] = len(prompts[serving[r]])
        started = time.perf_counter()
        key = jax.random.fold_in(self.key, _REFILL_KEYS + self.refills)
        token, _, cache, done, positions = self.refill(self.engine.params, cache, *state, batch, lengths, fresh, key,
                                                       self.pad_stops, self.sampling)
        first = decode._host(token)
        self.prefill_seconds += time.perf_counter() - started
        self.refills += 1
        for r in np.flatnonzero(fresh):
            out[serving[r]].append(int(first[r]))
        return (token, positions, done), cache

    def _decode(self, cache: Any, state: tuple, count: int, serving: list[int],
                out: list[list[int]]) -> tuple[tuple, Any]:
        """`count` decode steps; each serving row's new tokens appended to its prompt's."""
        if count == 0:  # max_new_tokens 1: the refill's token was every row's whole completion
            return state, cache
        token, positions, done = state
        started, columns = time.perf_counter(), []
        for _ in range(count):
            self.steps += 1
            token, _, cache, done, positions = self.step(self.engine.params, cache, token, positions, done, self.key,
                                                         np.int32(self.steps), self.pad_stops, self.sampling)
            columns.append(token)
        ids = decode._host_columns(columns)
        self.decode_seconds += time.perf_counter() - started
        for r, p in enumerate(serving):
            if p >= 0:
                out[p].extend(int(t) for t in ids[r])
        return (token, positions, done), cache
