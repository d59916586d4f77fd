"""Config keys whose values are structures rather than scalars: the logical axis rules, the data mixture and lists
of names (lora_targets, attention_pattern).

Each parser takes the raw YAML (or command-line) value and where it came from, and returns the frozen form the
Config holds, or raises one ConfigError line naming the key.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from maxshard.config import yaml_text
from maxshard.config.schema import MESH_AXES
from maxshard.errors import ConfigError

__all__ = ["parse_logical_rules", "parse_mixture", "parse_names", "parse_flags"]


def parse_logical_rules(value: Any, source: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`[[logical_name, mesh_axis | [mesh_axes] | null], ...]` -> ((name, (axes...)), ...)."""
    where = f"logical_axis_rules (from {source})"
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list of [logical_name, mesh_axes] pairs")
    rules = []
    for i, rule in enumerate(value):
        if not isinstance(rule, (list, tuple)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise ConfigError(f"{where}: rule {i} must be [logical_name, mesh_axes], got {rule!r}")
        name, axes = rule
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        elif not isinstance(axes, (list, tuple)) or not all(isinstance(a, str) for a in axes):
            raise ConfigError(f"{where}: rule {name!r} must map to a mesh axis, a list of them or null, got {axes!r}")
        for axis in axes:
            if axis not in MESH_AXES:
                raise ConfigError(f"{where}: rule {name!r} names unknown mesh axis {axis!r}; mesh axes: {', '.join(MESH_AXES)}")
        dups = sorted({a for a in axes if axes.count(a) > 1})
        if dups:
            raise ConfigError(f"{where}: rule {name!r} uses mesh axis {dups[0]!r} twice")
        rules.append((name, tuple(axes)))
    return tuple(rules)


def parse_mixture(value: Any, source: str) -> tuple[tuple[str, float], ...]:
    """`[[source, weight], ...]` -> ((source, weight), ...); weights are positive token shares (normalised later).

    Which reader a source needs (its extension, or `hf:NAME`) is judged by the data package when the input is built.
    """
    if isinstance(value, str) and value.strip():  # written as a quoted YAML list
        try:
            value = yaml_text.safe_load(value)
        except yaml.YAMLError:
            pass
    if value in ("", None):
        return ()
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"dataset_mixture must be a list [[source, weight], ...] with weights > 0, got {value!r} "
                          f"(from {source})")
    pairs = []
    for i, item in enumerate(value):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and item[0]):
            raise ConfigError(f"dataset_mixture[{i}] must be [source, weight], got {item!r} (from {source})")
        weight = item[1]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ConfigError(f"dataset_mixture[{i}] ({item[0]}): the weight must be a number > 0, got {weight!r} "
                              f"(from {source})")
        pairs.append((item[0], float(weight)))
    return tuple(pairs)


def parse_names(value: Any, source: str, key: str = "lora_targets") -> tuple[str, ...]:
    """lora_targets, attention_pattern: a list of names, from YAML (`[q, v]`) or a command line (`q,v`)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) and i.strip() for i in items):
        raise ConfigError(f"{key} expects a list of names like [a, b] or a,b, got {value!r} (from {source})")
    return tuple(i.strip() for i in items)


def parse_flags(value: Any, source: str, key: str) -> tuple[int, ...]:
    """rope_layers: one 0 or 1 a layer, from YAML (`[1, 1, 0]`) or a command line (`1,1,0`)."""
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, (list, tuple)):
        items = [i.strip() if isinstance(i, str) else i for i in items]
        flags = [{"0": 0, "1": 1}.get(i, i) if isinstance(i, str) else i for i in items]
        if all(f in (0, 1) and not isinstance(f, (bool, float)) for f in flags):
            return tuple(int(f) for f in flags)
    raise ConfigError(f"{key} expects a list of 0 and 1 like [1, 1, 1, 0] or 1,1,1,0, got {value!r} (from {source})")
