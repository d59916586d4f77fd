"""Rewards for GRPO: a function `(prompt: str, completion: str, record: dict) -> float` per completion, named by the
config key `reward`.

    exact_match        built in: 1.0 when the completion's answer equals the record's `reward_answer_field`, both
                       stripped, else 0.0. The answer is the whole stripped completion, or with `reward_answer_regex`
                       the regex's first match in it (`re.search`): its group 1 if it has groups, else the match; no
                       match scores 0.0.
    model:STEP_DIR     a trained reward model's checkpoint step (generation/reward_model.py, which GRPO's rollouts
                       build on the policy's mesh; `load_reward` leaves it to them)
    PATH.py:function   a function in a Python file of your own (relative paths resolved against the working
                       directory when the config is loaded, as path keys are), loaded once with importlib; it gets
                       the prompt as rendered text, the completion's text and the prompt's whole record.

Loading is checked before anything trains (`load_reward`, which the preflight calls before the model is built): a
missing file or function, a file that does not import (its own error, shortened) are one ConfigError line naming
`reward`. A file is imported once per process while it is unchanged (same size and modification time), so that check
does not run its top-level code twice. Scoring (`score`) is strict: a reward that raises,
returns something that is not a number (bool counts as one) or returns NaN or infinity stops the run with one line
naming the record's index in the batch and what went wrong (`RewardError`, a ConfigError, so the CLI prints one line
and exits 2): a silently wrong reward would train the model on noise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from maxshard.config import Config
from maxshard.data.prompts import Prompt
from maxshard.errors import ConfigError

__all__ = ["RewardError", "Reward", "ExactMatch", "MODEL_PREFIX", "load_reward", "load_function", "score",
           "describe"]

MODEL_PREFIX = "model:"  # reward=model:STEP_DIR (generation/reward_model.py)

Reward = Callable[[str, str, dict], float]
_MESSAGE_CHARS = 160  # of a reward's or a reward file's own error text
_IMPORTED: dict[str, tuple[tuple[int, int], Any]] = {}  # path -> ((size, mtime_ns), module) of reward files imported


class RewardError(ConfigError):
    """A reward that failed on one record of a batch: one line naming the record and what went wrong."""


@dataclasses.dataclass(frozen=True)
class ExactMatch:
    """The built-in `exact_match` reward (module docstring)."""

    field: str  # reward_answer_field
    regex: str = ""  # reward_answer_regex

    def __call__(self, prompt: str, completion: str, record: dict) -> float:
        if record.get(self.field) is None:
            raise RewardError(f"reward_answer_field={self.field}: the record has no such field, or it is null "
                              f"(fields: {', '.join(map(str, list(record)[:12]))})")
        answer = self.answer(completion)
        return float(answer is not None and answer.strip() == str(record[self.field]).strip())

    def answer(self, completion: str) -> str | None:
        """The completion's answer: the regex's first match (group 1 if any), or the whole completion; None when
        the regex does not match."""
        if not self.regex:
            return completion.strip()
        pattern = re.compile(self.regex)
        match = pattern.search(completion)
        if match is None:
            return None
        return match.group(1) if pattern.groups else match.group(0)


@dataclasses.dataclass(frozen=True)
class _Named:
    """A reward with the config value that named it, for messages."""

    function: Reward
    name: str

    def __call__(self, prompt: str, completion: str, record: dict) -> float:
        return self.function(prompt, completion, record)


def load_reward(cfg: Config) -> Reward:
    """The reward `cfg.reward` names (module docstring); every failure is one ConfigError line naming `reward`."""
    if cfg.reward.startswith(MODEL_PREFIX):
        raise ConfigError(f"reward={cfg.reward}: a reward model is loaded with the policy's mesh "
                          "(generation/reward_model.py), not as a function")
    if cfg.reward == "exact_match":
        try:
            re.compile(cfg.reward_answer_regex)
        except re.error as e:
            raise ConfigError(f"reward_answer_regex={cfg.reward_answer_regex!r} is not a regular expression: {e}") \
                from None
        return _Named(ExactMatch(cfg.reward_answer_field, cfg.reward_answer_regex), "reward=exact_match")
    return _Named(load_function(cfg.reward, "reward", "exact_match, model:STEP_DIR (a reward model's checkpoint "
                                                      "step), or "), f"reward={cfg.reward}")


def load_function(value: str, key: str, choices: str = "") -> Callable[..., Any]:
    """The function a `PATH.py:function` value of config key `key` names, its file imported once while unchanged
    (module docstring); every failure is one ConfigError line naming `key`. `choices`: the key's other values, for
    the message."""
    path, _, name = value.rpartition(":")
    if not (path.endswith(".py") and name.isidentifier()):
        raise ConfigError(f"{key}={value}: {choices}PATH.py:function (a Python file and a function in it)")
    setting = f"{key}={value}"
    module = _load_file(os.path.abspath(os.path.expanduser(path)), setting)
    function = getattr(module, name, None)
    if function is None:
        defined = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ConfigError(f"{setting}: {path} has no function {name} "
                          f"(it defines: {', '.join(defined[:12]) or 'none'})")
    if not callable(function):
        kind = type(function).__name__
        article = "an" if kind[0] in "aeiou" else "a"
        raise ConfigError(f"{setting}: {name} in {path} is not callable ({article} {kind})")
    return function


def _load_file(path: str, setting: str) -> Any:
    """The module of a user's Python file (`setting`: the `key=value` naming it, for messages), imported under a
    name of its own (registered while it runs, as dataclasses and pickling need); any failure of the file itself is
    one line with its error."""
    if not os.path.isfile(path):
        raise ConfigError(f"{setting}: no such file {path}")
    stat = os.stat(path)
    version = (stat.st_size, stat.st_mtime_ns)
    if path in _IMPORTED and _IMPORTED[path][0] == version:
        return _IMPORTED[path][1]
    module_name = "maxshard_reward_" + hashlib.sha256(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{setting}: cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(module_name, None)
        raise ConfigError(f"{setting}: {path} line {e.lineno}: SyntaxError: {e.msg}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the file does on import is its own error
        sys.modules.pop(module_name, None)
        raise ConfigError(f"{setting}: importing {path} failed: {describe(e)}") from None
    _IMPORTED[path] = (version, module)
    return module


def score(reward: Reward, prompts: Sequence[Prompt], completions: Sequence[str]) -> np.ndarray:
    """float32 [n]: `reward(prompt.text, completion, prompt.record)` of each pair, in order; `RewardError` naming
    the record's index when the reward fails on one (module docstring). A reward with a `batch(prompts, completions)`
    method (a reward model, generation/reward_model.py) scores them all in one call."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if hasattr(reward, "batch"):
        return np.asarray(reward.batch(prompts, completions), np.float32)
    name = getattr(reward, "name", None) or f"reward {getattr(reward, '__name__', type(reward).__name__)}"
    rewards = np.zeros(len(prompts), np.float32)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        try:
            value = reward(prompt.text, completion, prompt.record)
        except RewardError as e:
            raise RewardError(f"{name}: record {i}: {e}") from None
        except Exception as e:  # noqa: BLE001 - a user's reward may raise anything; it stops the run in one line
            raise RewardError(f"{name}: record {i}: the reward raised {describe(e)}") from None
        rewards[i] = _as_number(value, name, i)
    return rewards


def _as_number(value: Any, name: str, index: int) -> float:
    """A reward's value as a float: a real number or a bool, finite (and within float32)."""
    if not isinstance(value, (numbers.Real, np.bool_)):
        raise RewardError(f"{name}: record {index}: the reward returned {type(value).__name__} "
                          f"{_shorten(repr(value), 40)}, not a number")
    number = float(value)
    if not math.isfinite(number) or abs(number) > float(np.finfo(np.float32).max):
        raise RewardError(f"{name}: record {index}: the reward returned {number}, not a finite (float32) number")
    return number


def describe(error: BaseException) -> str:
    """`Type: first line of the message`, shortened."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {_shorten(text, _MESSAGE_CHARS)}" if text else type(error).__name__


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
