"""Log-likelihoods of continuations, many rows per call, on the run's mesh.

A row is what lm-eval's Hugging Face backend feeds its model for one request: the model input `inputs` (context +
continuation without its last token), scored at its last `continuation` positions against the next tokens. Rows
are right-padded to a bucket length (a power of two from 16, so a task compiles a handful of programs, not one per
length) and stacked `rows` at a time, sharded over the mesh as the training batch is (`INPUT_AXES`). Padding never
changes a real token's score: attention is causal and padding only follows the real tokens; rows added to fill a
batch are dropped before anything is returned.

The model runs as generation runs it (`decode_model`): no remat, no pipeline, MoE routing dropless, so a row's
score does not depend on which other rows share its batch (capacity-based dropping would make it so).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxshard.generation.decode import decode_model
from maxshard.spec.model_config import ModelConfig
from maxshard.model.transformer import Transformer
from maxshard.parallel import axis_names as ax
from maxshard.parallel import sharding, xla_options
from maxshard.training.loss import token_logps
from maxshard.training.step import mesh_context

__all__ = ["Row", "Scorer", "bucket_length"]

_MIN_LENGTH = 16


@dataclasses.dataclass(frozen=True)
class Row:
    """One scored sequence: the model reads `inputs`; the last `continuation` of its positions predict `targets`
    (the tokens that follow them, the continuation's tokens)."""

    inputs: tuple[int, ...]
    targets: tuple[int, ...]

    @property
    def continuation(self) -> int:
        return len(self.targets)


def bucket_length(length: int, multiple: int = 1) -> int:
    """The padded length of a row of `length` tokens: the next power of two from 16, a multiple of `multiple`."""
    padded = max(_MIN_LENGTH, 1 << max(length - 1, 0).bit_length())
    return -(-padded // multiple) * multiple


class Scorer:
    """`params` of `model` on `mesh`, scoring `Row`s `rows_per_call` at a time (rounded up to a multiple of the
    devices the batch is split over). One compiled program per bucket length."""

    def __init__(self, model: ModelConfig, mesh: Mesh, rules: sharding.FlaxRules, params: Any, rows_per_call: int
                 ) -> None:
        self.mesh, self.rules, self.params = mesh, rules, params
        self.model = Transformer(decode_model(model))
        batch_axes, length_axes = sharding.mesh_axes(ax.INPUT_AXES, rules, dict(mesh.shape))
        self.row_multiple = math.prod(mesh.shape[a] for a in batch_axes)
        self.length_multiple = math.prod(mesh.shape[a] for a in length_axes) * 2  # ring attention: 2 chunks each
        self.rows = -(-rows_per_call // self.row_multiple) * self.row_multiple
        self._compiled: dict[int, tuple[Any, NamedSharding]] = {}

    def _score(self, params: Any, tokens: jax.Array, targets: jax.Array, scored: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
        """tokens, targets, scored [rows, length] -> (sum of log p(target) over scored positions, whether every
        scored target is the most likely token), each [rows]."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits = self.model.apply({"params": params}, tokens, jnp.ones_like(tokens), positions)
        logps = token_logps(logits, targets)
        greedy = jnp.argmax(logits, axis=-1) == targets
        return jnp.sum(jnp.where(scored, logps, 0.0), axis=1), jnp.all(greedy | ~scored, axis=1)

    def _program(self, length: int) -> tuple[Any, NamedSharding]:
        """The compiled scoring of [rows, length] and the rows' sharding."""
        if length not in self._compiled:
            spec = sharding.logical_to_spec(ax.INPUT_AXES, self.rules, dict(self.mesh.shape), (self.rows, length),
                                            "scored rows [rows, length]")
            rows = NamedSharding(self.mesh, spec)
            out = NamedSharding(self.mesh, PartitionSpec())
            params = jax.tree.map(lambda x: x.sharding, self.params)
            with mesh_context(self.mesh, self.rules):
                step = jax.jit(self._score, in_shardings=(params, rows, rows, rows), out_shardings=(out, out),
                               compiler_options=xla_options.for_mesh(self.mesh))
                tokens = jax.ShapeDtypeStruct((self.rows, length), jnp.int32)
                mask = jax.ShapeDtypeStruct((self.rows, length), bool)
                self._compiled[length] = (step.lower(self.params, tokens, tokens, mask).compile(), rows)
        return self._compiled[length]

    def score(self, rows: Sequence[Row], pad_id: int = 0) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether greedy decoding would produce it) per row, in order. Rows
        are scored longest first, so a call's rows have similar lengths; calls are `self.rows` rows each."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].inputs))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.rows):
            chosen = order[start : start + self.rows]
            length = bucket_length(len(rows[chosen[0]].inputs), self.length_multiple)
            tokens = np.full((self.rows, length), pad_id, np.int32)
            targets = np.zeros((self.rows, length), np.int32)
            scored = np.zeros((self.rows, length), bool)
            for slot, i in enumerate(chosen):
                row, n = rows[i], len(rows[i].inputs)
                tokens[slot, :n] = row.inputs
                targets[slot, n - row.continuation : n] = row.targets
                scored[slot, n - row.continuation : n] = True
            program, rows_sharding = self._program(length)
            arrays = [jax.make_array_from_callback(a.shape, rows_sharding, lambda index, a=a: a[index])
                      for a in (tokens, targets, scored)]  # every process holds every row: any process count
            logps, greedy = jax.device_get(program(self.params, *arrays))
            for slot, i in enumerate(chosen):  # the filler rows after len(chosen) are never read
                results[i] = (float(logps[slot]), bool(greedy[slot]))
        return results
