"""The generation engine: a sharded KV cache, one jitted prefill and one jitted decode step, the sampling loop.

Batch layout. Prompts are right-padded to the longest one, P tokens, so every sequence's token at position p sits
in cache slot p (see layers/kv_cache.py) and RoPE positions are simply 0, 1, 2, ... per sequence, as in training.
Left-padding would align the write slot of all sequences instead, but then positions and the mask need a
per-sequence offset; with right-padding only the write slot is per sequence, and an elementwise masked write
handles that under any sharding. The prefill gives the padding position -1: a global layer writes it anyway (the
decode steps overwrite it before anything attends to it), but a local layer's ring of `window` slots must keep
each row's last real tokens, and the position is how it tells them from the padding (layers/kv_cache.py). The
batch is padded with one-token dummy rows up to a multiple of the devices the cache's batch dimension is sharded
over (fsdp=8 needs 8 rows), and the dummy rows are dropped at the end.

Steps (both compiled once, ahead of the timed run):
    prefill  [batch, P] prompt -> cache slots 0..P-1 written; the logits at each sequence's last real token give
             its first new token
    decode   [batch] last tokens at positions [batch] (each sequence's own length so far) -> one new token each
Cache length S = P + max_new_tokens (a local layer keeps min(window, S) slots). A sequence that emits
end-of-sequence is done: from then on it emits PAD, and the loop stops once every sequence is done (checked every
few steps) or max_new_tokens are generated.

Several processes (multi-host) run this loop together, each on the same prompts (a global batch every process
holds whole, as training's input does); the host's reads of a step's output (the done flags, the tokens at the end)
gather the rows the other processes' devices hold, so every process returns the same tokens.

MoE models route dropless here (`decode_model`): with capacity-based dropping a token's output would depend on
which other tokens share its sequence in this call, so a cached decode could not match the full forward pass.

Pipelined parameters. Generation runs the model unpipelined, but GRPO samples on the training mesh from the train
state itself, whose main stack a pipeline keeps as [repeats, stages, layers per stage, ...] split over `stage`.
The engine takes those arrays as they are and reshapes them to the scanned [layers, ...] inside its jitted steps
(`pipeline.to_scanned`: the same weights, layer r*S*L + s*L + l at [r, s, l]), so the unpipelined stack runs
layer after layer through the stages' weights and no second copy is kept. The cache and the activations split
their batch over `stage` as well (`stages_as_batch`): a cache split by layers would be gathered whole across the
stages in every step, since the layer scan slices it at a step-dependent layer. What remains is the weights': the
scan gathers the stack across the stages inside each step (per device, transiently, `stage` times its share of
the stack; benchmarks/README.md). A decode that passed activations from stage to stage would not; it is a larger
piece (a cache per stage, a schedule of one-token microbatches).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxshard.data.tokenizer import MAX_STOP_IDS
from maxshard.generation.sampling import Sampling, sample
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import kv_cache, pipeline
from maxshard.model.transformer import Transformer, abstract_cache
from maxshard.parallel import axis_names as ax
from maxshard.parallel import sharding, xla_options
from maxshard.training.step import mesh_context

__all__ = ["decode_model", "Engine", "Result", "batch_multiple", "stop_tuple", "whole_stream", "MAX_STOP_IDS"]

# The host asks whether every sequence is done only every this many steps: in between it queues steps without
# waiting for the device. A finished batch runs at most this many - 1 extra steps, which only emit PAD.
_CHECK_DONE_EVERY = 8
_PAD_STOPS = jax.ShapeDtypeStruct((1 + MAX_STOP_IDS,), jnp.int32)  # PAD, then the stop ids


def decode_model(model: ModelConfig) -> ModelConfig:
    """The model as generation runs it: no remat (no backward pass), no pipeline (pipelined parameters are read as
    the scanned stack: module docstring), MoE routing dropless, and a ragged exchange with its worst-case buffer
    (`moe_ragged_buffer_factor` 0), which no routing overflows."""
    capacity = 0.0 if model.is_moe else model.capacity_factor
    return dataclasses.replace(model, remat_policy="none", pipeline=None, capacity_factor=capacity,
                               moe_ragged_buffer_factor=0.0)


def batch_multiple(mesh: Mesh, rules: sharding.FlaxRules) -> int:
    """Devices the cache's batch dimension is split over: the batch is padded to a multiple of this."""
    spec = sharding.logical_to_spec((ax.CACHE_BATCH,), rules)
    entry = spec[0] if len(spec) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    return math.prod(mesh.shape[a] for a in axes)


@dataclasses.dataclass
class Result:
    """Generated ids per prompt (ending with EOS where the model ended it) and the timings of the run."""

    tokens: list[list[int]]
    prompt_tokens: int  # real (unpadded) prompt tokens
    prefill_seconds: float
    decode_steps: int
    decode_seconds: float
    compile_seconds: float
    step_logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # [batch, vocab] per new token, if kept


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def whole_stream(rules: sharding.FlaxRules) -> sharding.FlaxRules:
    """`rules` with the residual stream's length split only as the activations' length is: training splits it
    over tensor_sequence too (layers/decoder.py), but a decode step holds one position per sequence, which such a
    split would pad and gather back in every layer."""
    length = dict(rules).get(ax.LENGTH)
    return tuple((name, length if name == ax.NORM_LENGTH else axes) for name, axes in rules)


def stages_as_batch(rules: sharding.FlaxRules) -> sharding.FlaxRules:
    """`rules` for sampling from a pipelined model on its training mesh (module docstring): the mesh axes that split
    the layer stack (`stage`) split the batch of the cache and of the activations instead, and the cache keeps its
    layers whole, so the step's layer scan reads its cache where it lies."""
    stage = dict(rules).get(ax.LAYERS)
    if not stage:
        return rules
    stage_axes = (stage,) if isinstance(stage, str) else tuple(stage)
    out = []
    for name, axes in rules:
        if name == ax.LAYERS:
            axes = None
        elif name in (ax.CACHE_BATCH, ax.BATCH, ax.BATCH_NO_EXP):
            axes = (*stage_axes, *(() if axes is None else (axes,) if isinstance(axes, str) else axes))
        out.append((name, axes))
    return tuple(out)


class Engine:
    """A model's jitted prefill and decode steps on a mesh, the prefill compiled once per (batch, prompt length,
    cache length), the decode step once per (batch, cache length); the sampling parameters and the seed are
    arguments, so one compilation serves them all."""

    def __init__(self, model: ModelConfig, mesh: Mesh, rules: sharding.FlaxRules, params: Any, allowed: jax.Array
                 ) -> None:
        self.cfg, self.mesh, self.rules, self.params = decode_model(model), mesh, whole_stream(rules), params
        self._options = xla_options.for_mesh(mesh)  # the ragged-dot kernel on TPU (parallel/xla_options.py)
        self.model = Transformer(self.cfg)
        # A pipelined model's parameters (GRPO samples from them as they train) are read as the unpipelined stack
        # inside the jitted steps (module docstring)
        self._view = pipeline.to_scanned if model.pipeline is not None else (lambda p: p)
        if model.pipeline is not None:
            self.rules = stages_as_batch(self.rules)
        self.allowed = jax.device_put(allowed, NamedSharding(mesh, PartitionSpec()))
        self._compiled: dict[tuple[int, int, int], tuple[Any, Any, Any]] = {}
        self._decode_steps: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._layouts: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        self._refills: dict[tuple[int, int, int], Any] = {}  # generation/refill.py's steps

    # ------------------------------------------------------------------ the steps

    def _apply(self, params: Any, cache: Any, tokens: jax.Array, positions: jax.Array) -> tuple[jax.Array, Any]:
        """tokens, positions [batch, T] -> (logits [batch, T, vocab], the cache with this call's k/v written)."""
        segments = jnp.ones_like(tokens)
        variables = {"params": self._view(params), kv_cache.COLLECTION: cache}
        logits, state = self.model.apply(variables, tokens, segments, positions, mutable=[kv_cache.COLLECTION])
        return logits, state[kv_cache.COLLECTION]

    def _prefill(self, params: Any, cache: Any, prompts: jax.Array, lengths: jax.Array, key: jax.Array,
                 pad_stops: jax.Array, sampling: tuple[jax.Array, ...]) -> Any:
        """prompts [batch, P] right-padded, lengths [batch] -> the first step's (tokens, logits [batch, vocab],
        cache, done, positions): the new tokens go to positions `lengths`."""
        index = jnp.arange(prompts.shape[1], dtype=jnp.int32)[None, :]
        positions = jnp.where(index < lengths[:, None], index, -1)  # the padding at -1: no local layer keeps it
        logits, cache = self._apply(params, cache, prompts, positions)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [batch, vocab]
        chosen = sample(last, self.allowed, jax.random.fold_in(key, 0), *sampling)
        return chosen, last, cache, _stopped(chosen, pad_stops), lengths

    def _decode(self, params: Any, cache: Any, tokens: jax.Array, positions: jax.Array, done: jax.Array,
                key: jax.Array, index: jax.Array, pad_stops: jax.Array, sampling: tuple[jax.Array, ...]) -> Any:
        """tokens at positions [batch], done [batch] -> (next tokens, logits [batch, vocab], cache, done, positions
        + 1); new token `index` draws with fold_in(key, index); pad_stops = (pad, stop ids.., -1 ..): a finished
        sequence emits PAD."""
        logits, cache = self._apply(params, cache, tokens[:, None], positions[:, None])
        logits = logits[:, 0]
        chosen = sample(logits, self.allowed, jax.random.fold_in(key, index), *sampling)
        chosen = jnp.where(done, pad_stops[0], chosen)
        return chosen, logits, cache, done | _stopped(chosen, pad_stops), positions + 1

    # ------------------------------------------------------------------ shapes, shardings, compilation

    def abstract_cache(self, batch: int, length: int) -> Any:
        """The boxed cache of `batch` sequences of `length` slots (shapes and logical names, nothing allocated)."""
        with mesh_context(self.mesh, self.rules):
            return abstract_cache(self.cfg, jax.eval_shape(self._view, self.params), batch, length)

    def _layout(self, batch: int, cache_length: int) -> tuple[Any, Any, Any]:
        """(cache shardings, cache shapes, the shardings of a step's outputs) for this shape."""
        if (batch, cache_length) in self._layouts:
            return self._layouts[batch, cache_length]
        boxed = self.abstract_cache(batch, cache_length)
        cache_shardings = sharding.tree_shardings(boxed, self.mesh, self.rules)
        zeros = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.value.shape, b.value.dtype), boxed, is_leaf=_is_box)
        rows = NamedSharding(self.mesh, sharding.logical_to_spec((ax.CACHE_BATCH,), self.rules))
        step_out = (rows, rows, cache_shardings, rows, rows)  # tokens, logits, cache, done, positions
        self._layouts[batch, cache_length] = (cache_shardings, zeros, step_out)
        return self._layouts[batch, cache_length]

    def compile_decode(self, batch: int, cache_length: int) -> tuple[Any, Any]:
        """(new_cache, decode) compiled for this shape, cached per shape: the decode step does not depend on the
        prompt length (its compiled memory is what benchmarks and tests read, `memory_analysis()`)."""
        shape = (batch, cache_length)
        if shape in self._decode_steps:
            return self._decode_steps[shape]
        cache_shardings, zeros, step_out = self._layout(batch, cache_length)
        rows, replicated = step_out[0], NamedSharding(self.mesh, PartitionSpec())
        vector = jax.ShapeDtypeStruct((batch,), jnp.int32)
        with mesh_context(self.mesh, self.rules):
            new_cache = jax.jit(lambda: jax.tree.map(lambda z: jnp.zeros(z.shape, z.dtype), zeros),
                                out_shardings=cache_shardings).lower().compile()
            decode = jax.jit(self._decode, donate_argnums=1, out_shardings=step_out, compiler_options=self._options,
                             in_shardings=(self._params_shardings(), cache_shardings, rows, rows, rows, replicated,
                                           replicated, replicated, (replicated,) * 3))
            decode = decode.lower(self.params, zeros, vector, vector, jax.ShapeDtypeStruct((batch,), bool),
                                  jax.random.key(0), jax.ShapeDtypeStruct((), jnp.int32), _PAD_STOPS,
                                  Sampling().arrays()).compile()
        self._decode_steps[shape] = (new_cache, decode)
        return new_cache, decode

    def compile(self, batch: int, prompt_length: int, cache_length: int) -> tuple[Any, Any, Any]:
        """(new_cache, prefill, decode) compiled for this shape; cached per shape."""
        shape = (batch, prompt_length, cache_length)
        if shape in self._compiled:
            return self._compiled[shape]
        new_cache, decode = self.compile_decode(batch, cache_length)
        cache_shardings, zeros, step_out = self._layout(batch, cache_length)
        rows, replicated = step_out[0], NamedSharding(self.mesh, PartitionSpec())
        scalars = (replicated, replicated, (replicated,) * 3)  # key, pad_stops, sampling
        with mesh_context(self.mesh, self.rules):
            prefill = jax.jit(self._prefill, donate_argnums=1, out_shardings=step_out, compiler_options=self._options,
                              in_shardings=(self._params_shardings(), cache_shardings, rows, rows, *scalars))
            prefill = prefill.lower(self.params, zeros, jax.ShapeDtypeStruct((batch, prompt_length), jnp.int32),
                                    jax.ShapeDtypeStruct((batch,), jnp.int32), jax.random.key(0), _PAD_STOPS,
                                    Sampling().arrays()).compile()
        self._compiled[shape] = (new_cache, prefill, decode)
        return self._compiled[shape]

    def _params_shardings(self) -> Any:
        return jax.tree.map(lambda x: x.sharding, self.params)

    # ------------------------------------------------------------------ the loop

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: int | Sequence[int],
                 pad_id: int, sampling: Sampling = Sampling(), seed: int = 0, keep_logits: bool = False,
                 prompt_length: int = 0, rows: int = 0) -> Result:
        """Each prompt (token ids, as the tokenizer starts them) continued by up to `max_new_tokens` tokens; a
        sequence stops at the first of its EOS id(s) (`eos_id`: one id or several, e.g. Qwen's two). Prompts are
        padded to at least `prompt_length`, so calls with shorter prompts reuse one compilation. `rows` > 0 and
        fewer than the prompts: that many rows decode at once, each finished row taking the next waiting prompt
        (generation/refill.py; no logits kept)."""
        if 0 < rows < len(prompts):
            from maxshard.generation import refill  # deferred: it builds on this module

            if keep_logits:
                raise ValueError("keep_logits keeps every step's logits of one batch: not with rows (refilled)")

            return refill.generate(self, prompts, max_new_tokens, eos_id, pad_id, sampling, seed, rows, prompt_length)
        multiple = batch_multiple(self.mesh, self.rules)
        rows = -(-len(prompts) // multiple) * multiple
        padded = list(prompts) + [list(prompts[0][:1])] * (rows - len(prompts))  # dummy rows: a 1-token prompt
        lengths = np.array([len(p) for p in padded], np.int32)
        prompt_length = max(int(lengths.max()), prompt_length)
        tokens = np.full((rows, prompt_length), pad_id, np.int32)
        for i, p in enumerate(padded):
            tokens[i, : len(p)] = p
        started = time.perf_counter()
        new_cache, prefill, decode = self.compile(rows, prompt_length, prompt_length + max_new_tokens)
        compile_seconds = time.perf_counter() - started
        run = _Run(self, new_cache, prefill, decode, jax.random.key(seed), sampling.arrays(), keep_logits)
        return run(tokens, lengths, max_new_tokens, eos_id, pad_id, len(prompts), compile_seconds)


@dataclasses.dataclass
class _Run:
    """One generation: the timed prefill, then decode steps until every sequence is done."""

    engine: Engine
    new_cache: Callable[[], Any]
    prefill: Callable[..., Any]
    decode: Callable[..., Any]
    key: jax.Array
    sampling: tuple[np.ndarray, ...]
    keep_logits: bool

    def __call__(self, tokens: np.ndarray, lengths: np.ndarray, max_new_tokens: int, eos_id: int | Sequence[int],
                 pad_id: int, real_rows: int, compile_seconds: float) -> Result:
        params, logits_kept = self.engine.params, []
        cache = jax.block_until_ready(self.new_cache())
        stops = stop_tuple(eos_id)
        pad_stops = np.array([pad_id, *stops, *[-1] * (MAX_STOP_IDS - len(stops))], np.int32)
        started = time.perf_counter()
        token, logits, cache, done, positions = self.prefill(params, cache, tokens, lengths, self.key, pad_stops,
                                                             self.sampling)
        jax.block_until_ready(done)
        prefill_seconds = time.perf_counter() - started
        generated, steps = [token], 0
        logits_kept.append(logits)
        started = time.perf_counter()
        while steps + 1 < max_new_tokens:
            if steps % _CHECK_DONE_EVERY == 0 and bool(np.all(_host(done)[:real_rows])):
                break
            steps += 1
            token, logits, cache, done, positions = self.decode(params, cache, token, positions, done, self.key,
                                                                np.int32(steps), pad_stops, self.sampling)
            generated.append(token)
            if self.keep_logits:
                logits_kept.append(logits)
        jax.block_until_ready(generated[-1])
        decode_seconds = time.perf_counter() - started
        ids = _host_columns(generated)[:real_rows]  # [real_rows, new tokens]
        return Result(
            tokens=[_until_eos(row, stops) for row in ids.tolist()],
            prompt_tokens=int(lengths[:real_rows].sum()),
            prefill_seconds=prefill_seconds,
            decode_steps=steps,
            decode_seconds=decode_seconds,
            compile_seconds=compile_seconds,
            step_logits=[_host(x)[:real_rows] for x in logits_kept] if self.keep_logits else [],
        )


def _host(x: jax.Array) -> np.ndarray:
    """A step's output whole on this host. With several processes (multi-host) each holds only its devices' rows:
    the rest are gathered from the others, which run the same loop and so gather at the same point."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils  # deferred: one process never needs it

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _host_columns(columns: list[jax.Array]) -> np.ndarray:
    """[batch] outputs of the steps -> [batch, steps] on this host; several processes gather once, stacked."""
    if all(c.is_fully_addressable for c in columns):
        return np.stack(jax.device_get(columns), axis=1)
    return _host(jnp.stack(columns, axis=1))


def _until_eos(row: list[int], stops: tuple[int, ...]) -> list[int]:
    """Generated ids up to and including the first EOS (any of `stops`)."""
    end = next((i for i, t in enumerate(row) if t in stops), len(row) - 1)
    return row[: end + 1]


def stop_tuple(eos_id: int | Sequence[int]) -> tuple[int, ...]:
    """One EOS id or several as a tuple; more than MAX_STOP_IDS is a ValueError (the compiled steps hold that many):
    a caller's mistake, since a tokenizer refuses more when it loads (data/tokenizer.py)."""
    stops = (int(eos_id),) if isinstance(eos_id, (int, np.integer)) else tuple(int(i) for i in eos_id)
    if not 1 <= len(stops) <= MAX_STOP_IDS:
        raise ValueError(f"{len(stops)} EOS ids; generation stops at 1 to {MAX_STOP_IDS}")
    return stops


def _stopped(chosen: jax.Array, pad_stops: jax.Array) -> jax.Array:
    """[batch] bool: the chosen token is one of the stop ids (pad_stops[1:], -1 where unused)."""
    return jnp.any(chosen[:, None] == pad_stops[None, 1:], axis=-1)
