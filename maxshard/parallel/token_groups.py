"""The tokens of a batch as one group per device: a weight's gradient summed over pieces of work without a
reduction across devices at every piece.

The output head runs over pieces of the sequence in a scan (training/loss.py). Its weights are sharded like every
parameter (fsdp), and the tokens of each piece are spread over the batch's and the length's mesh axes. Left to XLA,
each piece gathers the head whole (in its forward and again in its recomputed backward) and reduces its gradient
across those devices: at many pieces most of the step's collective bytes (benchmarks/README.md, "MaxText's
`train_compile` vs maxshard, same XLA:TPU").

Here the tokens of a piece [batch, length, ...] are regrouped [groups, batch / b, length / l, ...], one group per
device of the b batch and l length shards, and the head is broadcast to [groups, ...] with the group dimension over
those axes: each device holds the head whole, gathered once before the scan, and applies its own copy to its own
tokens (`jax.vmap` over the groups). The gradient of a device's copy is that device's partial sum; it accumulates
over the pieces where it is, and the broadcast's transpose (a sum over the groups) reduces it once after the scan.
Same numbers, one gather and one reduction; the price is the head and its gradient whole over those axes for the
length of the loss (planning/gather_memory.py `grouped_head_bytes`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxshard.parallel import sharding

__all__ = ["TokenGroups"]


@dataclasses.dataclass(frozen=True)
class TokenGroups:
    """One group of tokens per device of `batch_axes` x `length_axes` (the mesh axes, each of size > 1, of a
    [batch, length, ...] array's first two dimensions)."""

    mesh: Mesh
    rules: sharding.FlaxRules
    batch_axes: tuple[str, ...]
    length_axes: tuple[str, ...]

    def _count(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def size(self) -> int:
        return self._count(self.batch_axes) * self._count(self.length_axes)

    @property
    def axes(self) -> tuple[str, ...]:
        return (*self.batch_axes, *self.length_axes)

    def fits(self, rows: int, length: int) -> bool:
        """Whether [rows, length] tokens split into whole groups."""
        return rows % self._count(self.batch_axes) == 0 and length % self._count(self.length_axes) == 0

    def _pin(self, x: jax.Array, spec: PartitionSpec) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def weights(self, tree: Any, shardings: Any) -> Any:
        """Each array of `tree` (sharded as `shardings`) as [groups, ...]: group g's copy on the devices of group
        g, whole over the groups' axes, still split over the others (tensor) as before."""
        def spread(x: jax.Array, s: NamedSharding) -> jax.Array:
            kept = [tuple(a for a in sharding.as_axes(e) if a not in self.axes) for e in s.spec]
            kept += [()] * (x.ndim - len(kept))
            return self._pin(jnp.broadcast_to(x, (self.size, *x.shape)), sharding.partition_spec([self.axes, *kept]))

        return jax.tree.map(spread, tree, shardings)

    def tokens(self, x: jax.Array) -> jax.Array:
        """[batch, length, ...] -> [groups, batch / b, length / l, ...], group g on the devices holding its tokens."""
        b, l = self._count(self.batch_axes), self._count(self.length_axes)
        rows, length, rest = x.shape[0], x.shape[1], x.shape[2:]
        split = x.reshape(b, rows // b, l, length // l, *rest)
        grouped = jnp.moveaxis(split, 2, 1).reshape(b * l, rows // b, length // l, *rest)
        return self._pin(grouped, PartitionSpec(self.axes))

    def ungroup(self, x: jax.Array) -> jax.Array:
        """The inverse of `tokens`: [groups, batch / b, length / l, ...] -> [batch, length, ...]."""
        b, l = self._count(self.batch_axes), self._count(self.length_axes)
        rows, length, rest = x.shape[1], x.shape[2], x.shape[3:]
        split = jnp.moveaxis(x.reshape(b, l, rows, length, *rest), 1, 2)
        return split.reshape(b * rows, l * length, *rest)

    def map(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` over the groups (`jax.vmap` of every argument's leading dimension). Inside, the group dimension
        holds the groups' mesh axes, so the rules given to `fn`'s layers map no logical name to them: a layer's
        constraint on its tokens leaves them where the group put them."""
        stripped = tuple((name, tuple(a for a in sharding.as_axes(axes) if a not in self.axes) or None)
                         for name, axes in self.rules)

        def within(*args: Any) -> Any:
            with nn.logical_axis_rules(stripped):
                return fn(*args)

        return jax.vmap(within, spmd_axis_name=self.axes)
