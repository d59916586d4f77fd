"""A Hugging Face family as a YAML file: `python -m maxshard.convert from_hf|to_hf ... --family FILE`.

A family whose layer kinds maxshard has is one row of data (families.Family); a file gives that row without Python.
It names the new `architecture` and `model_type`, optionally `like`, the built-in row it starts from, and any other
Family field that differs (config.json fields to model keys, tensor names, the layer pattern):

    architecture: MyMistralForCausalLM
    model_type: my_mistral
    like: MistralForCausalLM
    fields: {my_window_field: sliding_window}

Every mistake is one line naming the file and the field: an unknown field, a value of the wrong type, a model key
maxshard has no such key for. A tensor the row does not map is refused by from_hf as for any family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import yaml

from maxshard.convert import families
from maxshard.convert.hf_config import LAYER_OPTIONS
from maxshard.errors import ConfigError
from maxshard.spec.model_config import ModelConfig

__all__ = ["load", "register_file"]

_FIELDS = {f.name: f for f in dataclasses.fields(families.Family)}
_MODEL_KEYS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def _typed(path: str, name: str, value: Any, like: Any) -> Any:
    """`value` as the type of the field's value in the row it starts from (lists become tuples)."""
    if isinstance(like, (bool, str)):
        ok = isinstance(value, type(like))
    elif isinstance(like, (int, float)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(like, tuple):
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    elif isinstance(like, Mapping):
        ok = isinstance(value, Mapping)
    else:  # a field whose default is None (renormalize_field, shared_width_field, ...): a name or null
        ok = value is None or isinstance(value, str)
    if not ok:
        raise ConfigError(f"{path}: {name}={value!r} must be like {like!r} (the type of Family.{name})")
    return value


def _check_keys(path: str, row: families.Family) -> None:
    """The model keys the row names must be maxshard's."""
    named = [(f"fields.{field}", key) for field, key in row.fields.items()]
    named += [(f"keys.{key}", key) for key in row.keys]
    named += [(f"carries[{i}]", key) for i, key in enumerate(row.carries)]
    for where, key in named:
        if key not in _MODEL_KEYS:
            raise ConfigError(f"{path}: {where} names {key!r}, which is not a maxshard model key")
    for i, key in enumerate(row.carries):
        if key not in LAYER_OPTIONS:
            raise ConfigError(f"{path}: carries[{i}]={key!r} is not a layer option (one of {', '.join(LAYER_OPTIONS)})")


def load(path: str) -> families.Family:
    """The family row a YAML file describes (not registered)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--family {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a family file is a mapping of Family fields (architecture, model_type, ...)")
    data = dict(data)
    like_name = data.pop("like", None)
    base = families.by_architecture(like_name) if like_name is not None else families.Family("", "")
    if base is None:
        known = ", ".join(f.architecture for f in families.rows())
        raise ConfigError(f"{path}: like={like_name!r} is not a family row (one of {known})")
    for required in ("architecture", "model_type"):
        if not isinstance(data.get(required), str) or not data[required]:
            raise ConfigError(f"{path}: {required} is required (the name config.json gives the family)")
    changes = {}
    for name, value in data.items():
        if name not in _FIELDS:
            raise ConfigError(f"{path}: unknown field {name!r} (a family row has: like, {', '.join(_FIELDS)})")
        changes[name] = _typed(path, name, value, getattr(base, name))
    row = dataclasses.replace(base, **changes)
    _check_keys(path, row)
    return row


def register_file(path: str) -> families.Family:
    """Loads a family file and adds its row for this process."""
    row = load(path)
    families.register(row)
    return row
