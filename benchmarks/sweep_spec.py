"""The sweep file: reading and checking it, expanding its points, and naming their runs.

Kept apart from running and reporting so that the local runner and the XPK printer build every point's overrides
and run name the same way (a point's XPK workload and its local run share one name).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_KEYS = {"name", "base_config", "fixed", "grid", "points", "xpk"}


class SweepError(ValueError):
    """A mistake in the sweep file or the flags: reported in one line, exit code 2."""


@dataclasses.dataclass(frozen=True)
class Point:
    index: int
    name: str
    overrides: dict[str, Any]  # point keys only (grid + point), without the fixed ones


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    base_config: str
    fixed: dict[str, Any]
    points: tuple[Point, ...]
    xpk: dict[str, Any]

    def merged(self, point: Point) -> dict[str, Any]:
        """A point's keys over the fixed ones: what its run is given."""
        return {**self.fixed, **point.overrides}


def _mapping(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, Mapping):
        raise SweepError(f"'{key}' must be a mapping of key: value, got {type(value).__name__}")
    return dict(value)


def short_name(key: str, value: Any) -> str:
    """A readable name part: 'ici_fsdp_parallelism', 8 -> 'fsdp8'; 'dcn_data_parallelism', 2 -> 'dcn_data2';
    any other key by its initials: 'per_device_batch_size', 4 -> 'pdbs=4'; 'remat_policy', 'full' -> 'rp=full'."""
    match = re.fullmatch(r"(ici_|dcn_)(\w+)_parallelism", key)
    if match:
        return f"{'' if match[1] == 'ici_' else 'dcn_'}{match[2]}{value}"
    initials = "".join(word[0] for word in key.split("_") if word)
    return f"{initials}={format_value(value)}"


def expand_points(grid: Mapping[str, Sequence[Any]], points: Sequence[Mapping[str, Any]]) -> tuple[Point, ...]:
    """Every point crossed with every grid combination (either may be absent), numbered from 0."""
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"grid key {key!r} must map to a non-empty list, got {values!r}")
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else [{}]
    out = []
    for point in points or [{}]:
        if not isinstance(point, Mapping):
            raise SweepError(f"each entry of 'points' must be a mapping, got {point!r}")
        keys = {k: v for k, v in point.items() if k != "name"}
        for combo in combos:
            parts = [str(point["name"])] if "name" in point else [short_name(k, v) for k, v in keys.items()]
            name = "-".join(parts + [short_name(k, v) for k, v in combo.items()]) or "default"
            out.append(Point(len(out), name, {**combo, **keys}))
    return tuple(out)


def load_sweep(path: str) -> Sweep:
    """Reads and checks a sweep file; SweepError on any mistake."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"cannot read sweep file {path}: {e}") from None
    if not isinstance(data, Mapping):
        raise SweepError(f"sweep file {path} must hold a mapping")
    unknown = set(data) - SWEEP_KEYS
    if unknown:
        raise SweepError(f"unknown key(s) {sorted(unknown)} in {path}; allowed: {sorted(SWEEP_KEYS)}")
    if not data.get("base_config"):
        raise SweepError(f"{path} needs base_config (e.g. configs/base.yml)")
    points = data.get("points") or []
    if not isinstance(points, list):
        raise SweepError(f"'points' in {path} must be a list of mappings")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = str(data.get("name") or stem)
    return Sweep(name, str(data["base_config"]), _mapping(data, "fixed"),
                 expand_points(_mapping(data, "grid"), points), _mapping(data, "xpk"))  # fmt: skip


def format_value(value: Any) -> str:
    """A YAML value as the trainer's key=value parser reads it back (true/false, flow lists)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)  # JSON is YAML flow syntax
    return str(value)


def overrides_argv(values: Mapping[str, Any]) -> list[str]:
    """`key=value` arguments for the trainer's command line."""
    return [f"{k}={format_value(v)}" for k, v in values.items()]


def run_name(sweep: Sweep, point: Point) -> str:
    """'cpu-layouts-03-fsdp4xtp2': lowercase, digits and '-', so it also makes a valid XPK workload name."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{sweep.name}-{point.index:02d}-{point.name}".lower()).strip("-")
    return slug[:60].rstrip("-")
