"""YAML files + `key=value` overrides -> one frozen, validated `Config`.

Why a frozen dataclass and not pydantic: it is in the standard library (no new dependency), the field types read as
documentation, and freezing it means no code can mutate configuration behind another module's back. The schema
lives in `maxshard/config/schema.py`, the files are read by `maxshard/config/files.py`; this module merges, coerces and
derives.

Precedence, lowest first: the `base_config:` chain of YAML files (root first, the file on the command line last),
the model preset (`model_name` -> `models/NAME.yml` beside a file of the chain), then `key=value` overrides. `mesh_rules` are applied last, for keys the command line did not set.
Every user mistake raises `ConfigError` with one line that names the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from collections.abc import Sequence
from typing import Any

from maxshard import dataset_types
from maxshard.config import files, yaml_text
from maxshard.config.files import reading_files_once  # re-exported: config.reading_files_once
from maxshard.config.ranges import check_group_batch, check_ranges
from maxshard.config.schema import MESH_AXES, Config, knob_name, path_keys
from maxshard.config.structures import parse_flags, parse_logical_rules, parse_mixture, parse_names
from maxshard.errors import ConfigError

__all__ = ["Config", "MESH_AXES", "knob_name", "load", "parse", "finalize", "user_keys", "resolve_path",
           "resolve_paths", "load_parsed", "reading_files_once", "simulate_cpu_devices"]

_HINTS = typing.get_type_hints(Config)
_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_USER_KEYS = tuple(name for name, f in _FIELDS.items() if not f.metadata.get("derived"))
_USER_KEY_SET = frozenset(_USER_KEYS)  # every key of every file is looked up: a set, built once


def user_keys() -> tuple[str, ...]:
    """Keys a user may set (derived fields are computed, never set)."""
    return _USER_KEYS


# --------------------------------------------------------------------------------------------- coercion


def _unknown_key(key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, user_keys(), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see configs/base.yml for every key"
    if key in _FIELDS:
        return ConfigError(f"{key} is derived and cannot be set (from {source})")
    return ConfigError(f"unknown key {key!r} (from {source}){hint}")


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))


def _coerce(key: str, value: Any, source: str) -> Any:
    """Checks `value` against the declared type of `key` and converts where that loses nothing."""
    hint = _HINTS[key]
    special = _SPECIAL_PARSERS.get(key)
    if special is not None:
        return special(value, source)
    result = _coerce_scalar(hint, value)
    if result is _INVALID:
        raise ConfigError(f"{key} expects {_type_name(hint)}, got {value!r} (from {source})")
    if hint is int and not _INT64_MIN <= result <= _INT64_MAX:  # YAML ints are unbounded; steps etc. meet floats
        raise ConfigError(f"{key} must fit in a signed 64-bit integer, got {result} (from {source})")
    return result


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


_INVALID = object()


def _coerce_scalar(hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) is typing.Literal:
        return value if value in typing.get_args(hint) and not isinstance(value, bool) else _INVALID
    if hint is bool:
        return value if isinstance(value, bool) else _INVALID
    if hint is int:
        if isinstance(value, bool):
            return _INVALID
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value if isinstance(value, int) else _INVALID
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                return _INVALID
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _INVALID
        try:
            return float(value)
        except OverflowError:  # an int too large for a float
            return _INVALID
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        return _INVALID
    raise TypeError(f"unsupported config type {hint}")


def _parse_mesh_rules(value: Any, source: str) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """`[[regex, {key: value, ...}], ...]`; each override is checked like any other key."""
    where = f"mesh_rules (from {source})"
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list of [regex, {{key: value}}] pairs")
    rules = []
    for i, rule in enumerate(value):
        if not isinstance(rule, (list, tuple)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise ConfigError(f"{where}: rule {i} must be [regex, {{key: value}}], got {rule!r}")
        pattern, overrides = rule
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"{where}: rule {i} has an invalid regex {pattern!r}: {e}") from None
        if not isinstance(overrides, dict):
            raise ConfigError(f"{where}: rule {i} ({pattern!r}) must map to {{key: value}}")
        checked = []
        for key, val in overrides.items():
            if key in ("mesh_rules", "mesh_selector", "model_name") or key not in _USER_KEY_SET:
                raise ConfigError(f"{where}: rule {pattern!r} cannot set {key!r}")
            checked.append((key, _coerce(key, val, f"mesh_rules {pattern!r}")))
        rules.append((pattern, tuple(checked)))
    return tuple(rules)


_SPECIAL_PARSERS = {"logical_axis_rules": parse_logical_rules, "mesh_rules": _parse_mesh_rules,
                    "dataset_mixture": parse_mixture, "lora_targets": parse_names,
                    "attention_pattern": lambda value, source: parse_names(value, source, "attention_pattern"),
                    "layer_types": lambda value, source: parse_names(value, source, "layer_types"),
                    "rope_layers": lambda value, source: parse_flags(value, source, "rope_layers")}


def _parse_override(token: str) -> tuple[str, Any]:
    if "=" not in token:
        raise ConfigError(f"expected key=value after the config file, got {token!r}")
    key, raw = token.split("=", 1)
    key = key.strip()
    if key not in _USER_KEY_SET:
        raise _unknown_key(key, "command line")
    hint = _HINTS[key]
    if hint is str or _is_text_choice(hint):  # keep text exactly as typed: run_name=007 stays "007", profiler= is ""
        return key, raw
    try:
        value = yaml_text.safe_load(raw)
    except Exception as e:  # noqa: BLE001 - any YAML failure is a user mistake
        raise ConfigError(f"{key}={raw!r} is not a valid YAML value: {type(e).__name__}") from None
    return key, value


def _is_text_choice(hint: Any) -> bool:
    """A Literal of strings only (dtype, profiler, ...)."""
    return typing.get_origin(hint) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(hint))


# --------------------------------------------------------------------------------------------- load


def parse(argv: Sequence[str]) -> Config:
    """`[path.yml, key=value, ...]` -> Config with user keys set and derived fields still empty."""
    if not argv:
        raise ConfigError("usage: python -m maxshard.train CONFIG.yml [key=value ...]")
    path, tokens = argv[0], argv[1:]
    overrides: dict[str, Any] = {}
    for token in tokens:
        key, value = _parse_override(token)
        if key in overrides:
            raise ConfigError(f"{key} is given twice on the command line")
        overrides[key] = value

    chain = files.file_chain(path)
    values: dict[str, Any] = {}
    for file_path, data in chain:
        _merge_file(values, data, file_path)
    model_name = overrides.get("model_name", values.get("model_name", ""))
    if model_name:
        model_path = files.model_file(str(model_name), chain)
        model_values: dict[str, Any] = {}
        _merge_file(model_values, files.read_yaml(model_path), model_path)
        values.update(model_values)
        allow = overrides.get("override_model_config", values.get("override_model_config", False)) is True
        if not allow:
            _check_model_conflicts(model_values, overrides, model_path)
    for key, value in overrides.items():
        values[key] = _coerce(key, value, "command line")
    values["explicit_keys"] = tuple(sorted(overrides))
    return check_ranges(Config(**values))


def _merge_file(values: dict[str, Any], data: dict[str, Any], path: str) -> None:
    for key, value in data.items():
        if key not in _USER_KEY_SET:
            raise _unknown_key(str(key), path)
        values[key] = _coerce(key, value, path)


def _check_model_conflicts(model_values: dict[str, Any], overrides: dict[str, Any], model_path: str) -> None:
    for key, value in overrides.items():
        if key in model_values and _coerce(key, value, "command line") != model_values[key]:
            raise ConfigError(
                f"{key} is set by model preset {model_path} ({model_values[key]!r}) and on the command line "
                f"({value!r}); add override_model_config=true to let the command line win"
            )


def finalize(cfg: Config, num_devices: int, device_kind: str = "cpu", num_processes: int = 1) -> Config:
    """Applies `mesh_rules` for this hardware and computes the derived fields."""
    cfg = _apply_mesh_rules(cfg, f"{device_kind}-{num_devices}")
    global_batch = cfg.per_device_batch_size * num_devices
    whole = math.isfinite(global_batch) and math.isclose(global_batch, round(global_batch))
    if not whole or round(global_batch) < 1:
        raise ConfigError(
            f"per_device_batch_size={cfg.per_device_batch_size} x {num_devices} devices = {global_batch:g} "
            "is not a whole global batch of at least 1"
        )
    schedule_steps = cfg.learning_rate_schedule_steps if cfg.learning_rate_schedule_steps > 0 else cfg.steps
    cfg = resolve_paths(cfg)
    run_dir = os.path.join(cfg.base_output_directory, cfg.run_name)
    return check_group_batch(dataclasses.replace(
        cfg,
        num_devices=num_devices,
        num_processes=num_processes,
        device_kind=device_kind,
        global_batch_size=int(round(global_batch)),
        schedule_steps=schedule_steps,
        warmup_steps=int(cfg.warmup_steps_fraction * schedule_steps),
        run_dir=run_dir,
        checkpoint_dir=os.path.join(run_dir, "checkpoints"),
        tensorboard_dir=os.path.join(run_dir, "tensorboard"),
    ))


def resolve_path(path: str) -> str:
    """A relative local path made absolute against the working directory; "" and URLs (gs://...) unchanged.

    Orbax and grain workers need absolute paths, and a path resolved once here means the same file wherever the
    process later changes directory."""
    if not path or "://" in path:
        return path
    return os.path.abspath(os.path.expanduser(path))


def _resolve_source(source: str) -> str:
    if source.startswith(dataset_types.CHAT_PREFIX):
        return dataset_types.CHAT_PREFIX + _resolve_source(source.removeprefix(dataset_types.CHAT_PREFIX))
    return source if source.startswith(tuple(dataset_types.PREFIXES)) else resolve_path(source)


def resolve_paths(cfg: Config) -> Config:
    """Every path key (`schema.path_keys`), mixture source, reward and environment file (`PATH.py:function`)
    resolved with `resolve_path` (`hf:NAME` sources name a dataset, not necessarily a path, and stay as written, as
    do prefixes)."""
    mixture = tuple((_resolve_source(s), w) for s, w in cfg.dataset_mixture)
    functions = {key: _resolve_function(getattr(cfg, key)) for key in ("reward", "grpo_environment")}
    return dataclasses.replace(cfg, dataset_mixture=mixture, **functions,
                               **{key: resolve_path(getattr(cfg, key)) for key in path_keys()})


def _resolve_function(value: str) -> str:
    """A `PATH.py:function` value with its path resolved; any other value as it is."""
    file, _, function = value.rpartition(":")
    return f"{resolve_path(file)}:{function}" if file.endswith(".py") else value


def _apply_mesh_rules(cfg: Config, detected: str) -> Config:
    selector = cfg.mesh_selector or detected
    for pattern, overrides in cfg.mesh_rules:
        if re.search(pattern, selector):
            chosen = {k: v for k, v in overrides if k not in cfg.explicit_keys}
            return check_ranges(dataclasses.replace(cfg, **chosen, mesh_rule_applied=pattern))
    return cfg


def load(argv: Sequence[str], num_devices: int | None = None, device_kind: str | None = None) -> Config:
    """parse + finalize. Without `num_devices`, asks JAX (after applying `cpu_device_count`)."""
    return load_parsed(parse(argv), num_devices, device_kind)


def load_parsed(cfg: Config, num_devices: int | None = None, device_kind: str | None = None) -> Config:
    """finalize a parsed config; without `num_devices`, asks JAX (after applying `cpu_device_count`)."""
    if num_devices is None:
        import jax  # deferred: parsing alone must not start a backend

        if cfg.cpu_device_count > 0:
            simulate_cpu_devices(jax, cfg.cpu_device_count)
        num_devices = jax.device_count()
        device_kind = jax.devices()[0].device_kind
        return finalize(cfg, num_devices, device_kind, jax.process_count())
    return finalize(cfg, num_devices, device_kind or "cpu")


def simulate_cpu_devices(jax: Any, count: int) -> None:
    """Applies `cpu_device_count`; it only works before JAX starts a backend.

    Simulated CPU devices make this a CPU run: unless JAX_PLATFORMS says otherwise, JAX is told so, and does not
    probe an installed accelerator plugin first (libtpu, installed for ahead-of-time TPU compiles, prints a screen
    of warnings when it finds no TPU)."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
        if not jax.config.jax_platforms:
            jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        if jax.devices()[0].platform == "cpu" and jax.device_count() != count:
            raise ConfigError(
                f"cpu_device_count={count} cannot take effect: JAX already started with {jax.device_count()} devices"
            ) from None
