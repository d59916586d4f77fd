"""YAML as maxshard reads it: PyYAML's safe loader (plain data, never Python objects), parsed by libyaml's C parser
where PyYAML was built with it (its wheels are), else by the pure-Python one. The two give the same values (one
resolver decides what a scalar is) and raise the same `yaml.YAMLError`s; the C parser is an order of magnitude
faster, which a run pays once and a tool or test suite that loads configs hundreds of times pays each time."""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["safe_load"]

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def safe_load(stream: Any) -> Any:
    """`yaml.safe_load` of a string or a file, through the C parser when there is one."""
    return yaml.load(stream, Loader=_LOADER)  # noqa: S506 - a safe loader
