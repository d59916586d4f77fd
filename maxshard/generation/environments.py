"""Multi-turn GRPO rollouts: episodes in which the model and an environment of the user's take turns
(`grpo_environment`, `grpo_max_turns`).

The environment. `grpo_environment=PATH.py:function` names a function of a file of your own; it is called once per
episode with the prompt's record (all its fields) and returns the episode's environment, an object with

    step(reply: str) -> (observation: str | None, reward: float, done: bool)
        the model's reply of this turn (its text, stop token left out) -> what the environment answers, the reward
        of this turn, and whether the episode is over; while it goes on the observation is the next user turn
    tools (optional)
        a dict of name -> function, or a list of functions (named by __name__), the model may call

A reply holding tool calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes form Qwen's and
most open models' chat templates write), is answered by the tools and not by `step`: each call's result (str() of
what the tool returned) becomes a `tool` message. A call the model got wrong (not JSON, an unknown tool, arguments
the tool refuses) is answered with an error text the model reads, as a tool would answer it, since it is the
model's mistake, not the run's. An episode's reward is the sum of its steps' rewards. The tools are listed to the
model as the chat template lists them: the template's `tools` variable holds each one's JSON schema (`tool_schema`:
its name, its docstring's first paragraph, its parameters' types from their annotations), so an episode with tools
starts from its prompt rendered again with them (within grpo_max_prompt_length).

An episode starts from the prompt's ids (a text prompt is a conversation of one user turn) and alternates:

    model turn     up to grpo_max_new_tokens sampled tokens (ending with the stop token where one stopped it)
    environment    the tool results, or step's observation as a user turn; their tokens are what the run's chat
                   template adds after the model's turn: render(conversation + [reply, answers], generation prompt)
                   past render(conversation + [reply]), after the whitespace that closes the model's turn

A reply that reaches grpo_max_new_tokens without a stop is closed by the tokenizer's first stop id before the
environment's tokens, as the template closes a turn. The row keeps every token as the model saw it (its own turns as
sampled, never re-tokenized), and only the model's sampled tokens take loss. An episode ends when step says done,
after grpo_max_turns model turns, or when the next turn would not fit the row (max_target_length + 1 tokens);
`rollout/episodes_cut` counts those that did not end by done. Every turn of every episode is sampled together, the
finished ones' rows filled with a one-token dummy, so the engine compiles one shape for the first turn and one for
the later ones; with grpo_rollout_rows the engine's rows are fixed and refilled (generation/refill.py), and only the
episodes going on are asked.

Strict, as rewards are: an environment (or its factory) that raises, returns the wrong type or a reward that is not
a finite number stops the run with one line naming `grpo_environment`, the record's index and the turn
(`EnvironmentFailed`). Episodes are deterministic given the model's samples (the rollout's sampling keys derive from
the seed, the rollout and the turn), so a resumed run plays the episodes the uninterrupted one did, provided the
environment is itself deterministic.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import numbers
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from maxshard import rewards
from maxshard.data.chat import encode_rendered
from maxshard.data.chat_template import ChatTemplate, TemplateError
from maxshard.data.prompts import Prompt
from maxshard.errors import ConfigError
from maxshard.generation.decode import Result

__all__ = ["EnvironmentFailed", "Episode", "Episodes", "ENDINGS", "tool_calls", "tool_schema", "context_limit",
           "load_factory"]

ENDINGS = ("done", "turns", "length")  # why an episode ended (module docstring)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

# (contexts, prompt length, turn) -> each context's sampled tokens (Result.tokens) and the turn's timings
Sampler = Callable[[list[list[int]], int, int], Result]


class EnvironmentFailed(ConfigError):
    """An environment that failed on one episode: one line naming it, the record and the turn."""


def load_factory(setting: str) -> Callable[[dict], Any]:
    """The function `grpo_environment` names (its file imported once; one ConfigError line if it cannot be)."""
    return rewards.load_function(setting, "grpo_environment")


def context_limit(max_target_length: int, max_new_tokens: int) -> int:
    """The longest context a turn may start from: its reply must still fit the row's max_target_length + 1
    tokens. Later turns are padded to it (one compiled shape); GRPO's plan sizes its sampling cache by it."""
    return max_target_length + 1 - max_new_tokens


@dataclasses.dataclass
class Episode:
    """One episode as it is played: its tokens as the model saw them and which of them it sampled."""

    environment: Any
    tools: dict[str, Callable[..., Any]]
    schemas: list[dict[str, Any]] | None  # the tools as the template lists them (None: no tools)
    messages: list[dict[str, Any]]  # the conversation so far, as the chat template renders it
    tokens: list[int]
    sampled: list[bool]  # per token: the model's (the loss's) or the prompt's and the environment's
    prompt_tokens: int
    reward: float = 0.0
    turns: int = 0  # model turns taken
    tool_calls: int = 0
    ended: str = ""  # "" while it goes on, else one of ENDINGS


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(name: str, function: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema a chat template lists a tool by (`tools` of `apply_chat_template`): its name, its
    docstring's first paragraph, and its parameters with their JSON types (from the annotations: str, int, float,
    bool, list, dict; any other: no type) and which have no default."""
    signature = inspect.signature(function)
    try:
        hints = typing.get_type_hints(function)
    except (TypeError, NameError):  # a partial, a callable object, an annotation that names nothing importable
        hints = {}
    properties, required = {}, []
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(typing.get_origin(hints.get(parameter.name)) or hints.get(parameter.name))
        properties[parameter.name] = {"type": kind} if kind else {}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    description = (inspect.getdoc(function) or "").split("\n\n")[0].replace("\n", " ")
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def tool_calls(reply: str) -> list[str]:
    """The JSON texts of the reply's `<tool_call>` blocks, in order."""
    return _TOOL_CALL.findall(reply)


class Episodes:
    """Plays a rollout's episodes (module docstring)."""

    def __init__(self, setting: str, template: ChatTemplate, tokenizer: Any, max_turns: int, max_new_tokens: int,
                 row_tokens: int, refilled: bool = False) -> None:
        """`setting`: grpo_environment's value; `row_tokens`: max_target_length + 1; `refilled`: the sampler
        decodes a fixed number of rows, refilling them (grpo_rollout_rows), so only the episodes going on are
        asked to continue."""
        self.setting, self.factory, self.refilled = setting, load_factory(setting), refilled
        self.template, self.tokenizer = template, tokenizer
        self.max_turns, self.max_new_tokens, self.row_tokens = max_turns, max_new_tokens, row_tokens

    def play(self, prompts: Sequence[Prompt], sample: Sampler, first_length: int) -> tuple[list[Episode],
                                                                                         list[Result]]:
        """Every prompt's episode, and each turn's generation (its timings); `first_length`: the first turn's
        padded prompt length (grpo_max_prompt_length)."""
        episodes = [self._start(i, p, first_length) for i, p in enumerate(prompts)]
        turns: list[Result] = []
        for turn in range(self.max_turns):
            going = [i for i, e in enumerate(episodes) if not e.ended]
            if not going:
                break
            asked = going if self.refilled else range(len(episodes))
            dummy = episodes[going[0]].tokens[:1]
            contexts = [episodes[i].tokens if not episodes[i].ended else dummy for i in asked]
            length = first_length if turn == 0 else context_limit(self.row_tokens - 1, self.max_new_tokens)
            result = sample(contexts, length, turn)
            turns.append(result)
            replies = dict(zip(asked, result.tokens))
            for i in going:
                self._answer(episodes[i], list(replies[i]), i, turn)
        for e in episodes:
            e.ended = e.ended or "turns"
        return episodes, turns

    def _fail(self, index: int, turn: int | None, what: str) -> EnvironmentFailed:
        at = f"record {index}" if turn is None else f"record {index}, turn {turn + 1}"
        return EnvironmentFailed(f"grpo_environment={self.setting}: {at}: {what}")

    def _start(self, index: int, prompt: Prompt, first_length: int) -> Episode:
        try:
            environment = self.factory(prompt.record)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's factory may raise anything; one line stops the run
            raise self._fail(index, None, f"making the environment raised {rewards.describe(e)}") from None
        if not callable(getattr(environment, "step", None)):
            raise self._fail(index, None, f"the function returned {type(environment).__name__}, which has no "
                                          "step(reply) method")
        messages = [dict(m) for m in prompt.messages] or [{"role": "user", "content": prompt.text}]
        tools = self._tools(environment, index)
        schemas = [tool_schema(name, function) for name, function in tools.items()] or None
        ids = list(prompt.ids) if schemas is None else self._with_tools(messages, schemas, index, first_length)
        return Episode(environment, tools, schemas, messages, ids, [False] * len(ids), len(ids))

    def _with_tools(self, messages: list[dict[str, Any]], schemas: list[dict[str, Any]], index: int,
                    first_length: int) -> list[int]:
        """The prompt's ids rendered again with its tools listed, as the template lists them."""
        try:
            text = self.template.render(messages, add_generation_prompt=True, tools=schemas)
        except TemplateError as e:
            raise self._fail(index, None, f"chat_template {self.template.name} refused the tools "
                                          f"({str(e)[:80]})") from None
        ids = encode_rendered(text, self.tokenizer).tolist()
        if len(ids) > first_length:
            raise self._fail(index, None, f"the prompt with its tools listed is {len(ids)} tokens, more than "
                                          f"grpo_max_prompt_length={first_length}")
        return ids

    def _tools(self, environment: Any, index: int) -> dict[str, Callable[..., Any]]:
        tools = getattr(environment, "tools", None) or {}
        if isinstance(tools, dict) and all(isinstance(k, str) and callable(v) for k, v in tools.items()):
            return dict(tools)
        if isinstance(tools, (list, tuple)) and all(callable(t) for t in tools):
            return {t.__name__: t for t in tools}
        raise self._fail(index, None, f"tools is {type(tools).__name__}: a dict of name -> function or a list of "
                                      "functions")

    def _answer(self, episode: Episode, reply_ids: list[int], index: int, turn: int) -> None:
        """The model's reply of `turn` into the episode, and the environment's answer to it."""
        stops = set(self.tokenizer.stop_ids)
        stopped = bool(reply_ids) and reply_ids[-1] in stops
        reply = self.tokenizer.decode([t for t in reply_ids if t not in stops])
        episode.tokens += reply_ids
        episode.sampled += [True] * len(reply_ids)
        episode.turns += 1
        calls = tool_calls(reply) if episode.tools else []
        if calls:
            episode.tool_calls += len(calls)
            answers, done = [self._call(episode.tools, call) for call in calls], False
        else:
            observation, reward, done = self._step(episode.environment, reply, index, turn)
            episode.reward += reward
            answers = [] if done else [{"role": "user", "content": observation}]
        if done or episode.turns >= self.max_turns:
            episode.ended = "done" if done else "turns"
            return
        assistant = {"role": "assistant", "content": reply}
        closing = [] if stopped else [self.tokenizer.stop_ids[0]]  # a reply cut at grpo_max_new_tokens
        glue = closing + self._glue(episode.messages + [assistant], answers, episode.schemas, index, turn)
        if len(episode.tokens) + len(glue) + self.max_new_tokens > self.row_tokens:
            episode.ended = "length"
            return
        episode.messages += [assistant, *answers]
        episode.tokens += glue
        episode.sampled += [False] * len(glue)

    def _step(self, environment: Any, reply: str, index: int, turn: int) -> tuple[str, float, bool]:
        try:
            value = environment.step(reply)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - as in _start
            raise self._fail(index, turn, f"step raised {rewards.describe(e)}") from None
        if not (isinstance(value, tuple) and len(value) == 3):
            raise self._fail(index, turn, f"step returned {type(value).__name__}, not (observation, reward, done)")
        observation, reward, done = value
        if not isinstance(done, (bool, np.bool_)):
            raise self._fail(index, turn, f"step's done is {type(done).__name__}, not a bool")
        if not isinstance(reward, (numbers.Real, np.bool_)) or not math.isfinite(float(reward)):
            raise self._fail(index, turn, f"step's reward is {reward!r}, not a finite number")
        if not done and not isinstance(observation, str):
            raise self._fail(index, turn, f"step's observation is {type(observation).__name__}: while the episode "
                                          "goes on it is the next user turn's text")
        return observation, float(reward), bool(done)

    def _call(self, tools: dict[str, Callable[..., Any]], call: str) -> dict[str, str]:
        """One tool call's `tool` message: the tool's result, or what was wrong with the call."""
        try:
            parsed = json.loads(call)
        except ValueError as e:
            return {"role": "tool", "content": f"error: the tool call is not JSON ({e})"}
        name = parsed.get("name") if isinstance(parsed, dict) else None
        arguments = parsed.get("arguments", {}) if isinstance(parsed, dict) else None
        if name not in tools:
            return {"role": "tool", "content": f"error: no tool {name!r} (tools: {', '.join(tools)})"}
        if not isinstance(arguments, dict):
            return {"role": "tool", "name": name, "content": "error: arguments must be a JSON object"}
        try:
            result = tools[name](**arguments)
        except Exception as e:  # noqa: BLE001 - a call the tool refuses is the model's mistake: it reads why
            return {"role": "tool", "name": name, "content": f"error: {rewards.describe(e)}"}
        return {"role": "tool", "name": name, "content": str(result)}

    def _glue(self, conversation: list[dict[str, Any]], answers: list[dict[str, Any]],
              schemas: list[dict[str, Any]] | None, index: int, turn: int) -> list[int]:
        """The tokens the chat template writes between the model's turn and its next one (module docstring)."""
        try:
            upto = self.template.render(conversation, tools=schemas)
            after = self.template.render(conversation + answers, add_generation_prompt=True, tools=schemas)
        except TemplateError as e:
            raise self._fail(index, turn, f"chat_template {self.template.name} refused the conversation "
                                          f"({str(e)[:80]})") from None
        if not after.startswith(upto):
            raise self._fail(index, turn, f"chat_template {self.template.name} renders the conversation anew once "
                                          "it goes on (not prefix-stable), so an episode cannot continue it")
        closing = upto[len(upto.rstrip()):]
        return encode_rendered(closing + after[len(upto):], self.tokenizer).tolist()
