"""maxshard's parameter tree for given model keys, each leaf paired with its row of the name table.

The shapes come from `model.abstract_params` (jax.eval_shape of the real init), so the converter writes exactly the
tree that `Transformer` builds and `load_parameters` checks, and a change to the model cannot drift from it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from maxshard.convert import names
from maxshard.convert.families import Family
from maxshard.errors import ConfigError
from maxshard.spec import blocks
from maxshard.model import transformer as model
from maxshard.spec.model_config import ModelConfig, architecture_keys

__all__ = ["MODEL_KEYS", "model_config", "Param", "params_of"]

# What a checkpoint's config keeps of the network for conversion (the training length and the capacity factor, which
# the converter sets, are implementation fields; both are read when present).
MODEL_KEYS = (*architecture_keys(), "max_target_length", "capacity_factor")


def model_config(keys: Mapping[str, Any]) -> ModelConfig:
    """The network of these model keys (scanned layers, no pipeline, every other field at its default): all the
    converter needs to know the parameter tree, with no run, mesh or devices."""
    return ModelConfig(**{k: keys[k] for k in MODEL_KEYS if k in keys}, scan_layers=True)


@dataclasses.dataclass(frozen=True)
class Param:
    """One maxshard parameter: its path, shape (stacked [units, ...] when `stacked`) and the table row. A stacked
    parameter belongs to one of the decoder's stacks (spec/blocks.py) and to one layer of its repeated unit of
    `period` layers: its unit r is Hugging Face's layer `first + r * period` (DeepSeek-V3's MoE stack starts
    after its dense first layers; in Gemma 3's units of 6, layer_2's parameters are layers 2, 8, 14, ...)."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    entry: names.Entry
    stacked: bool
    first: int = 0
    period: int = 1
    layer: int | None = None  # a parameter of one Hugging Face layer, unstacked (a multi-token prediction module's)

    @property
    def stack(self) -> str:
        """The decoder stack's name ("layers", "dense_layers"), the module's ("mtp_1") for a parameter of one
        layer; "" for a global parameter."""
        return self.path[1] if self.stacked else self.path[0] if self.layer is not None else ""

    @property
    def lead(self) -> int:
        """Leading dims that index Hugging Face tensors: 0 (global), 1 (layers) or 2 (layers, experts)."""
        return int(self.stacked) + int(self.entry.per_expert)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The shape of one Hugging Face tensor's slice (the whole shape for a global parameter)."""
        return self.shape[self.lead :]

    def indices(self) -> list[tuple[int, ...]]:
        """Every Hugging Face tensor's index: [()] for a global one, (layer,) or (layer, expert) in file order,
        layers numbered as Hugging Face numbers them."""
        ranges = [range(n) for n in self.shape[: self.lead]]
        if self.layer is not None:
            return [(self.layer, *rest) for rest in itertools.product(*ranges)]
        if self.stacked:
            ranges[0] = range(self.first, self.first + self.period * self.shape[0], self.period)
        return list(itertools.product(*ranges))

    def local(self, index: tuple[int, ...]) -> tuple[int, ...]:
        """A Hugging Face tensor's index (`indices`) in this parameter's own array: its unit of the stack."""
        if self.layer is not None:
            return tuple(index[1:])
        return ((index[0] - self.first) // self.period, *index[1:]) if self.stacked else index


def _key(entry: Any) -> str:
    return str(getattr(entry, "key", entry))


def params_of(cfg: ModelConfig, family: Family) -> list[Param]:
    """Every parameter of the model in tree order; a leaf the family's table does not know is an error."""
    by_path = {e.path: e for e in (*names.global_rows(cfg), names.HEAD, names.SCORE)}
    stacks, first = {}, 0
    for stack in blocks.stacks(cfg):  # each unit layer's table (its kinds) and first Hugging Face layer
        stacks[stack.name] = [({e.path: e for e in names.per_layer(family, cfg, layer)}, first + j, len(stack.unit))
                              for j, layer in enumerate(stack.unit)]
        first += stack.num_layers
    mtp_tables = dict(names.mtp_rows(family, cfg))
    leaves, _ = jax.tree_util.tree_flatten_with_path(nn.unbox(model.abstract_params(cfg)))
    out = []
    for key_path, leaf in leaves:
        path = tuple(_key(k) for k in key_path)
        stacked = path[0] == "decoder" and path[1] in stacks
        mtp_layer = names.mtp_layer(cfg, path[0], family)
        if mtp_layer is not None:  # a multi-token prediction module: one decoder layer and its own rows
            entry = mtp_tables.get(path[1:])
            if entry is None:
                raise ConfigError(f"parameter {'/'.join(path)} has no tensor in {family.architecture}")
            out.append(Param(path, tuple(leaf.shape), entry, False, mtp_layer, 1, mtp_layer))
            continue
        if stacked:
            unit_layer = blocks.unit_layer_index(path[2])
            table, offset, period = stacks[path[1]][unit_layer or 0]
            inner = path[3:] if unit_layer is not None else path[2:]
        else:
            table, offset, period, inner = by_path, 0, 1, path
        entry = table.get(inner)
        if entry is None:
            raise ConfigError(f"parameter {'/'.join(path)} has no tensor in {family.architecture}")
        out.append(Param(path, tuple(leaf.shape), entry, stacked, offset, period))
    return out
