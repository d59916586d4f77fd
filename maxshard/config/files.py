"""The config files: a YAML file's mapping, its `base_config:` ancestors and the model presets beside them, each file
read from disk once inside `reading_files_once()`. The loader (config/loader.py) merges what these return and
coerces it; every problem with a file itself is a ConfigError that names the file.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import yaml

from maxshard.config import yaml_text
from maxshard.errors import ConfigError

__all__ = ["reading_files_once", "read_yaml", "file_chain", "model_file"]

_file_cache: dict[str, dict[str, Any]] | None = None  # a dict only inside `reading_files_once()`


@contextlib.contextmanager
def reading_files_once() -> Iterator[None]:
    """Inside the block each config file is read from disk once; later parses get a copy of what was read.

    For tools that parse the same files hundreds of times, as the planner's layout search does (YAML parsing is
    most of what `parse` costs). Outside the block every parse reads the files again, so an edited file is seen.
    """
    global _file_cache
    outer = _file_cache
    _file_cache = {} if outer is None else outer
    try:
        yield
    finally:
        _file_cache = outer


def read_yaml(path: str) -> dict[str, Any]:
    """The mapping a config file holds (a copy of the one read before, inside `reading_files_once`)."""
    if _file_cache is None:
        return _load_yaml(path)
    key = os.path.realpath(path)
    if key not in _file_cache:
        _file_cache[key] = _load_yaml(path)
    return copy.deepcopy(_file_cache[key])  # callers pop base_config from what they get


def _load_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml_text.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"invalid YAML in {path}{where}: {problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of key: value, not {type(data).__name__}")
    return data


def file_chain(path: str) -> list[tuple[str, dict[str, Any]]]:
    """The file and its `base_config:` ancestors, root first."""
    chain: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    current: str | None = path
    while current is not None:
        real = os.path.realpath(current)
        if real in seen:
            raise ConfigError(f"base_config cycle: {current} is its own ancestor")
        seen.add(real)
        data = read_yaml(current)
        parent = data.pop("base_config", None)
        chain.append((current, data))
        if parent is None:
            current = None
        elif not isinstance(parent, str):
            raise ConfigError(f"base_config in {current} must be a file path")
        else:
            current = os.path.join(os.path.dirname(current), parent)
    return list(reversed(chain))


def model_file(model_name: str, chain: list[tuple[str, dict[str, Any]]]) -> str:
    """`configs/models/NAME.yml` next to any file of the chain (nearest to the command line first), or a path."""
    if model_name.endswith((".yml", ".yaml")):
        return model_name
    for path, _ in reversed(chain):
        candidate = os.path.join(os.path.dirname(path), "models", f"{model_name}.yml")
        if os.path.isfile(candidate):
            return candidate
    presets = sorted(
        {name[:-4] for path, _ in chain for name in _listdir(os.path.join(os.path.dirname(path), "models"))}
    )
    raise ConfigError(f"model_name={model_name!r} has no preset; available: {', '.join(presets) or 'none'}")


def _listdir(path: str) -> list[str]:
    return [n for n in os.listdir(path) if n.endswith(".yml")] if os.path.isdir(path) else []
