"""Multi-turn GRPO (`grpo_environment`, generation/environments.py): episodes of model turns and environment turns.

The episode tests play the example environment (examples/arithmetic_env.py) and failing ones against a scripted
sampler (the model's replies fixed, the engine's own tests cover sampling), with the byte-level tokenizer and the
default chat template: the row is the whole conversation as the template renders it, only the model's tokens
flagged, tool calls answered by the tools, and every way an environment can fail one line naming it, the record and
the turn. The CLI test trains a tiny model on the example through `maxshard.train`: the reward rises, the rows'
loss weights are exactly the tokens the model sampled, and a run resumed from a checkpoint plays and trains as the
uninterrupted one, bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import tiny_config

from maxshard import train
from maxshard.data.chat import encode_rendered, load_template
from maxshard.data.chat_template import ChatTemplate
from maxshard.data.prompts import Prompt
from maxshard.data.tokenizer import ByteTokenizer
from maxshard.errors import ConfigError
from maxshard.generation import environments, rollouts
from maxshard.generation.decode import Result
from maxshard.generation.environments import Episodes, EnvironmentFailed

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = f"{REPO / 'examples' / 'arithmetic_env.py'}:drill"
TOKENIZER = ByteTokenizer()
TEMPLATE = load_template("", "")
EOS = TOKENIZER.eos_id


def prompt(question: str, answer: str) -> Prompt:
    """A text prompt as the prompt stream encodes it under an environment: one user turn, rendered."""
    messages = ({"role": "user", "content": question},)
    text = TEMPLATE.render(list(messages), add_generation_prompt=True)
    return Prompt(tuple(encode_rendered(text, TOKENIZER).tolist()), text, {"prompt": question, "answer": answer},
                  messages)


def scripted(*turns: list[str | list[int]]):
    """A sampler answering turn t of episode i with turns[t][i] (text, EOS appended; or ids as they are), and the
    contexts it was asked to continue."""
    asked: list[tuple[list[list[int]], int]] = []

    def sample(contexts: list[list[int]], length: int, turn: int) -> Result:
        asked.append(([list(c) for c in contexts], length))
        replies = [r if isinstance(r, list) else [*TOKENIZER.encode(r), EOS] for r in turns[turn]]
        return Result(replies, 0, 0.0, 0, 0.0, 0.0)

    return sample, asked


def episodes(setting: str = EXAMPLE, max_turns: int = 3, max_new_tokens: int = 48, row_tokens: int = 512,
             refilled: bool = False) -> Episodes:
    return Episodes(setting, TEMPLATE, TOKENIZER, max_turns, max_new_tokens, row_tokens, refilled)


def whole(conversation: list[dict]) -> list[int]:
    """The ids of the whole conversation as the template renders it, without the whitespace after the last turn."""
    return encode_rendered(TEMPLATE.render(conversation).rstrip(), TOKENIZER).tolist()


def test_a_tool_call_is_answered_by_the_tool_and_the_row_is_the_rendered_conversation():
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "7+5"}}</tool_call>'
    sample, asked = scripted([call, "3", "9"], ["12", "unused", "no idea"])
    played, timings = episodes().play([prompt("7+5=", "12"), prompt("1+2=", "3"), prompt("1+2=", "3")], sample, 32)
    tool, right, wrong = played
    assert len(timings) == 2 and [length for _, length in asked] == [32, 512 - 48]
    # a tool call, then the right answer: the tool's result is the conversation's tool turn, step never saw it
    assert tool.ended == "done" and tool.reward == 1.0 and tool.turns == 2 and tool.tool_calls == 1
    assert tool.messages[-1] == {"role": "tool", "name": "calculate", "content": "12"}
    assert tool.environment.replies == ["12"]
    # right at once: done after one turn, and the second turn asked only a one-token stand-in of it
    assert right.ended == "done" and right.reward == 1.0 and right.turns == 1
    assert asked[1][0][1] == right.tokens[:1]
    # two wrong attempts, each with half its digit share; the retry is the environment's user turn
    assert wrong.ended == "done" and wrong.reward == pytest.approx(0.5 / 4) and wrong.tool_calls == 0
    assert wrong.environment.replies == ["9", "no idea"] and wrong.messages[-1]["content"] == "no. 1+2="
    for e, replies in ((tool, [call, "12"]), (right, ["3"]), (wrong, ["9", "no idea"])):
        conversation = [*e.messages[:1]]
        for reply, answer in zip(replies, [*e.messages[2::2], None]):
            conversation += [{"role": "assistant", "content": reply}] + ([answer] if answer else [])
        assert e.tokens == whole(conversation)
        sampled = [t for t, s in zip(e.tokens, e.sampled) if s]
        assert sampled == [i for r in replies for i in (*TOKENIZER.encode(r), EOS)]
    # the second turn continued each going episode's context as it stood after the first
    going = asked[1][0]
    assert going[0] == tool.tokens[: len(going[0])] and going[2] == wrong.tokens[: len(going[2])]


def test_with_refilled_rows_only_the_episodes_going_on_are_asked():
    sample, asked = scripted(["3", "9"], ["no idea"])
    played, _ = episodes(refilled=True).play([prompt("1+2=", "3"), prompt("1+2=", "3")], sample, 32)
    assert [len(contexts) for contexts, _ in asked] == [2, 1] and asked[1][0][0] == played[1].tokens[:-8]
    assert [e.reward for e in played] == [1.0, pytest.approx(0.5 / 4)]


def test_tools_are_listed_to_the_model_as_the_template_lists_them():
    """A template that lists `tools` (as Qwen's does, in its system turn): an episode with tools starts from its
    prompt rendered with their JSON schemas, each turn after it renders with them too, and a prompt that no
    longer fits grpo_max_prompt_length with them is one line."""
    schema = environments.tool_schema("calculate", arithmetic().calculate)
    assert schema == {"type": "function", "function": {
        "name": "calculate",
        "description": "The value of an expression of integers with +, - and * (parsed, never evaluated as Python).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}
    listing = "{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    template = ChatTemplate(TEMPLATE.source.replace("{{ bos_token }}", "{{ bos_token }}" + listing), "listing",
                            TEMPLATE.special_tokens)
    sample, asked = scripted(["9"], ["7"])
    player = Episodes(EXAMPLE, template, TOKENIZER, 3, 48, 1024)
    (e,), _ = player.play([prompt("3+4=", "7")], sample, 512)
    conversation = [e.messages[0], {"role": "assistant", "content": "9"}, e.messages[2],
                    {"role": "assistant", "content": "7"}]
    assert TOKENIZER.decode(asked[0][0][0]).startswith('<|system|>\n{"type": "function", "function": {"name": '
                                                        '"calculate"')
    assert e.tokens == encode_rendered(template.render(conversation, tools=[schema]).rstrip(), TOKENIZER).tolist()
    with pytest.raises(EnvironmentFailed, match="record 0: the prompt with its tools listed is 3.. tokens, more "
                                                "than grpo_max_prompt_length=64"):
        player.play([prompt("3+4=", "7")], sample, 64)


def arithmetic():
    """The example environment's module, as the run imports it."""
    import sys

    environments.load_factory(EXAMPLE)
    return next(m for m in sys.modules.values() if getattr(m, "__file__", None) == EXAMPLE.rpartition(":")[0])


def test_a_reply_cut_at_the_token_limit_is_closed_and_the_episode_goes_on():
    sample, _ = scripted([TOKENIZER.encode("99")], ["4"])
    (e,), _ = episodes(max_new_tokens=2).play([prompt("2+2=", "4")], sample, 32)
    cut = len(prompt("2+2=", "4").ids) + 2
    assert e.tokens[cut] == EOS and not e.sampled[cut] and e.ended == "done" and e.reward == 1.0 + 0.25


def test_episodes_end_at_the_turn_limit_and_where_the_row_ends():
    sample, _ = scripted(["x"], ["y"], ["z"])
    (e,), _ = episodes(max_turns=2).play([prompt("2+2=", "4")], sample, 32)
    assert e.ended == "done" and e.turns == 2  # the drill's two attempts
    (e,), _ = episodes(max_turns=1).play([prompt("2+2=", "4")], sample, 32)
    assert e.ended == "turns" and e.turns == 1
    start = len(prompt("2+2=", "4").ids)
    (e,), _ = episodes(max_new_tokens=2, row_tokens=start + 8).play([prompt("2+2=", "4")], sample, 32)
    assert e.ended == "length" and len(e.tokens) == start + 2


def test_a_tool_call_the_model_got_wrong_is_answered_with_what_was_wrong():
    calls = ["<tool_call>not json</tool_call>", '<tool_call>{"name": "sqrt", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "calculate", "arguments": {"expression": "import os"}}</tool_call>']
    sample, _ = scripted(calls[:1], calls[1:2], calls[2:])
    (e,), _ = episodes().play([prompt("2+2=", "4")], sample, 32)
    answers = [m["content"] for m in e.messages if m["role"] == "tool"]
    assert answers[0].startswith("error: the tool call is not JSON")
    assert answers[1] == "error: no tool 'sqrt' (tools: calculate)" and len(answers) == 2  # the third turn ends it
    assert e.ended == "turns" and e.tool_calls == 3 and e.reward == 0.0


ENVIRONMENTS = {
    "raises": ("class E:\n    def step(self, reply):\n        raise KeyError('score')\n",
               "record 0, turn 1: step raised KeyError: 'score'"),
    "pair": ("class E:\n    def step(self, reply):\n        return 'a', 1.0\n",
             r"record 0, turn 1: step returned tuple, not \(observation, reward, done\)"),
    "nan": ("class E:\n    def step(self, reply):\n        return None, float('nan'), True\n",
            "record 0, turn 1: step's reward is nan, not a finite number"),
    "no text": ("class E:\n    def step(self, reply):\n        return None, 0.0, False\n",
                "record 0, turn 1: step's observation is NoneType"),
    "done": ("class E:\n    def step(self, reply):\n        return '', 0.0, 'yes'\n",
             "record 0, turn 1: step's done is str, not a bool"),
    "no step": ("class E:\n    pass\n", "record 0: the function returned E, which has no step"),
    "tools": ("class E:\n    tools = 'calc'\n    def step(self, reply):\n        return None, 0.0, True\n",
              "record 0: tools is str: a dict of name -> function or a list of functions"),
}


@pytest.mark.parametrize("case", ENVIRONMENTS)
def test_an_environment_that_fails_is_one_line_naming_it_the_record_and_the_turn(tmp_path, case):
    source, message = ENVIRONMENTS[case]
    path = tmp_path / "env.py"
    path.write_text(source + "\n\ndef make(record):\n    return E()\n")
    sample, _ = scripted(["x"])
    with pytest.raises(EnvironmentFailed, match=message) as raised:
        episodes(f"{path}:make").play([prompt("2+2=", "4")], sample, 32)
    assert str(raised.value).startswith(f"grpo_environment={path}:make: ") and "\n" not in str(raised.value)


def test_a_factory_that_raises_or_is_missing_is_one_line():
    with pytest.raises(ConfigError, match=r"grpo_environment=.*has no function nope \(it defines: .*drill"):
        episodes(f"{REPO / 'examples' / 'arithmetic_env.py'}:nope")
    sample, _ = scripted(["x"])
    bad = Prompt((1,), "q", {"prompt": "q"}, ())  # the drill reads `answer`
    with pytest.raises(EnvironmentFailed, match="record 0: making the environment raised KeyError: 'answer'"):
        episodes().play([bad], sample, 32)


@pytest.mark.parametrize("keys, message", [
    (("grpo_max_turns=2",), "grpo_max_turns=2 needs grpo_environment"),
    (("grpo_environment=env.txt",), "grpo_environment=.*env.txt: PATH.py:function"),
    ((f"grpo_environment={EXAMPLE}", "reward=r.py:f"), "grpo_environment rewards each episode itself: leave "
                                                       "reward at exact_match"),
])
def test_a_bad_environment_key_is_one_line_naming_it(keys, message):
    with pytest.raises(ConfigError, match=message) as raised:
        tiny_config("objective=grpo", "dataset_type=prompts", *keys)
    assert "\n" not in str(raised.value)


# --------------------------------------------------------------------------------------------- through the CLI


def drill_argv(root: Path, *keys: str) -> list[str]:
    """A tiny byte-level GRPO run on the example drill (two attempts a question) under `root`."""
    rng = np.random.default_rng(0)
    sums = root / "sums.jsonl"
    with sums.open("w") as f:
        for a, b in rng.integers(0, 5, (64, 2)):
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    argv = ["configs/base.yml", "model_name=tiny", "cpu_device_count=8", "dataset_type=prompts",
            f"dataset_path={sums}", "objective=grpo", f"grpo_environment={EXAMPLE}", "grpo_max_turns=2",
            "grpo_group_size=8", "grpo_max_new_tokens=4", "grpo_max_prompt_length=32", "max_target_length=80",
            "override_model_config=true", "per_device_batch_size=4", "learning_rate=1e-2", "warmup_steps_fraction=0",
            "eval_fraction=0", f"base_output_directory={root}", "enable_tensorboard=false", "log_period=1",
            "async_checkpointing=false", *keys]
    return list({item.split("=")[0]: item for item in argv}.values())


def logged(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "reward/mean" in r}


def test_a_multi_turn_run_learns_masks_the_environment_and_resumes_bit_for_bit(tmp_path, monkeypatch, capsys):
    """Acceptance: the untrained model's mean episode reward is below 0.3 and training brings it to at least 0.8
    of the format credit's 1.0 (0.5 an attempt); every episode of the first rollout takes two turns, and its rows'
    loss weights fall exactly on the tokens the model sampled: the replies the environment received, each with its
    stop (or the closing stop id of a cut reply, which takes none). A run resumed from the checkpoint at step 20
    gives steps 21-24 the uninterrupted run's rewards, turns and losses, bit for bit."""
    played: list[list[environments.Episode]] = []
    rows: list[dict[str, np.ndarray]] = []
    play, lay_out = Episodes.play, rollouts.sequence_rows
    monkeypatch.setattr(Episodes, "play", _recording(play, played))
    monkeypatch.setattr(rollouts, "sequence_rows", lambda *a: rows.append(lay_out(*a)) or rows[-1])
    keys = ("steps=24", "checkpoint_period=20")
    assert train.main(drill_argv(tmp_path, "run_name=straight", *keys)) == 0
    straight = logged(tmp_path / "straight")
    assert straight[1]["reward/mean"] < 0.3 and max(straight[s]["reward/mean"] for s in (22, 23, 24)) >= 0.8
    assert straight[1]["rollout/turns"] > 1.5 and straight[24]["rollout/turns"] == 2.0
    assert re.search(r"step 24/24 .* \| reward [\d.]+ \| rollout .* tok/s \| 2\.0 turns 0\.0 tool calls, 0% cut",
                     capsys.readouterr().out)
    first, batch = played[0], rows[0]
    for i, e in enumerate(first):
        weights, targets = batch["loss_weights"][i], batch["targets"][i]
        assert targets[weights > 0].tolist() == [t for t, s in zip(e.tokens[1:], e.sampled[1:]) if s]
        replies = [TOKENIZER.decode(r) for r in _runs(e.tokens, e.sampled)]
        assert replies == e.environment.replies, i
        assert batch["inputs"][i, : len(e.tokens) - 1].tolist() == e.tokens[:-1]
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "20", tmp_path / "resumed" / "checkpoints" / "20")
    assert train.main(drill_argv(tmp_path, "run_name=resumed", *keys)) == 0
    resumed = logged(tmp_path / "resumed")
    assert sorted(resumed) == [21, 22, 23, 24]
    for step in resumed:
        for key in ("loss", "reward/mean", "rollout/turns", "kl", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key)


def _recording(play, played):
    def recorded(self, *args):
        out = play(self, *args)
        played.append(out[0])
        return out
    return recorded


def _runs(tokens: list[int], flags: list[bool]) -> list[list[int]]:
    """The maximal runs of flagged tokens (the model's turns), each without its stop."""
    runs, current = [], []
    for token, flag in zip(tokens, flags):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [[t for t in r if t != EOS] for r in runs]
