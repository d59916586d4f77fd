"""GRPO's data and rewards: `dataset_type: prompts` (data/prompts.py) and `reward` (maxshard/rewards.py).

Prompts: text and conversations become the ids generation starts from (byte-level and the Qwen3 tokenizer.json),
every field of a record is kept, bad records are skipped and counted, the stream is deterministic, resumes exactly
and splits train from eval. Rewards: exact_match with and without a regex, a reward file, and every failure as one
line naming the key or the record. No training, nothing compiled.

Byte-level ids (ByteTokenizer): PAD 0, BOS 1, EOS 2, a byte b is b + 3 ('a' = 100).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from maxshard import config
from maxshard.config import ranges
from maxshard.data import make_input, prompts
from maxshard.data.chat_template import ChatTemplate
from maxshard.data.prompts import Prompt, make_prompts
from maxshard.data.sources import BadRecord, ReadOptions
from maxshard.data.tokenizer import ByteTokenizer, load_hf_tokenizer
from maxshard.errors import ConfigError
from maxshard.rewards import ExactMatch, RewardError, load_reward, score

REPO = Path(__file__).resolve().parent.parent
BASE = str(REPO / "configs" / "base.yml")
QWEN = REPO / "tests" / "fixtures" / "hf" / "qwen3" / "tokenizer.json"
CHATML = REPO / "tests" / "fixtures" / "chat" / "chatml.jinja"
OPTIONS = ReadOptions("", "text", "messages", "train", "", "never")


def load(*overrides: str) -> config.Config:
    return config.load([BASE, *overrides], num_devices=8)


def prompts_cfg(path: Path | str, *overrides: str) -> config.Config:
    """base.yml reading prompts from `path`, every record in train unless eval_fraction says otherwise.

    Loaded as jsonl and then switched to prompts: the config admits prompts only with objective grpo, whose row
    (objectives/kinds.py) is another change's."""
    values = {"eval_fraction": "0"}
    values.update(o.split("=", 1) for o in overrides)
    cfg = load(f"dataset_path={path}", *(f"{k}={v}" for k, v in values.items()))
    return dataclasses.replace(cfg, dataset_type="prompts")


def write_jsonl(path: Path, records: list, raw: tuple[bytes, ...] = ()) -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + b"".join(raw))
    return path


def records(count: int) -> list[dict]:
    return [{"prompt": f"q{i}", "answer": str(i), "id": i} for i in range(count)]


def byte_ids(text: str) -> tuple[int, ...]:
    return (1, *ByteTokenizer().encode(text))


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------------------------- records -> ids


def test_text_records_keep_every_field(tmp_path):
    """Byte-level: BOS + the prompt's bytes, the rendered text is the prompt, the record is the whole object."""
    data = records(6)
    it = make_prompts(prompts_cfg(write_jsonl(tmp_path / "p.jsonl", data)), "train", 64)
    got = it.next_prompts(6)
    assert sorted(p.record["id"] for p in got) == list(range(6))  # one epoch: each record once
    for p in got:
        assert isinstance(p, Prompt) and p.record == data[p.record["id"]]
        assert p.text == p.record["prompt"] and p.ids == byte_ids(p.text)
    assert it.stats() == {"data/prompts": 6, "data/skipped_records": 0, "data/records_read": 6}


def test_messages_render_with_the_generation_prompt(tmp_path):
    """A conversation ending with a user turn, rendered with the run's template and the assistant's turn opened:
    the Qwen3 tokenizer.json with ChatML (special tokens one id each, no BOS), and byte-level with the default
    template (BOS from its stand-in)."""
    record = {"messages": [{"role": "user", "content": "the lazy dog"}], "answer": "4"}
    path = write_jsonl(tmp_path / "m.jsonl", [record, {"prompt": "a lazy dog", "answer": "4"}])
    it = make_prompts(prompts_cfg(path, f"tokenizer_path={QWEN}", f"chat_template={CHATML}"), "train", 64)
    chat, text = sorted(it.next_prompts(2), key=lambda p: "prompt" in p.record)
    assert chat.text == ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nthe lazy dog<|im_end|>\n"
                         "<|im_start|>assistant\n")
    tok = load_hf_tokenizer(str(QWEN))
    assert chat.ids == tuple(tok.encode(chat.text)) and chat.ids.count(tok._tok.token_to_id("<|im_start|>")) == 3
    assert chat.record == record
    assert text.ids == tuple(tok.encode_prompt("a lazy dog")) and text.text == "a lazy dog" and text.ids
    assert it.stats()["data/skipped_records"] == 0

    byte = next(p for p in make_prompts(prompts_cfg(path), "train", 64).next_prompts(2) if "messages" in p.record)
    assert byte.text == "<|bos|><|user|>\nthe lazy dog\n<|assistant|>\n"
    assert byte.ids == byte_ids("<|user|>\nthe lazy dog\n<|assistant|>\n")


def test_compressed_and_hf_sources_give_the_same_prompts(tmp_path):
    """.jsonl.gz, .jsonl.zst and a Hugging Face save_to_disk directory read the records of the plain file; a null
    prompt in a dataset row is a bad record naming its row."""
    import datasets
    import zstandard

    data = records(5)
    plain = write_jsonl(tmp_path / "p.jsonl", data)
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (tmp_path / "p.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    datasets.Dataset.from_list(data).save_to_disk(str(tmp_path / "saved"))
    expected = make_prompts(prompts_cfg(plain, f"data_cache_dir={tmp_path}/cache"), "train", 64).next_prompts(12)
    for source in ("p.jsonl.gz", "p.jsonl.zst", "saved"):
        cfg = prompts_cfg(tmp_path / source, f"data_cache_dir={tmp_path}/cache")
        got = make_prompts(cfg, "train", 64).next_prompts(12)
        assert [(p.ids, p.record) for p in got] == [(p.ids, p.record) for p in expected], source
    datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}]).save_to_disk(
        str(tmp_path / "nulls"))
    corpus = prompts.open_source(str(tmp_path / "nulls"), "dataset_path", False, OPTIONS)
    assert corpus.documents[1] == BadRecord("missing field", "nulls row 1")


# --------------------------------------------------------------------------------------------- bad records


REFUSING = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}" \
           "{{ m['content'] }}{% endfor %}"
MALFORMED = (b'{"answer": "1"}\n', b'{"prompt": "p", "messages": [{"role": "user", "content": "u"}]}\n',
             b'{"prompt": 3}\n', b'{"prompt": ""}\n', b'{"messages": [{"role": "assistant", "content": "a"}]}\n',
             b'{"messages": "not json"}\n', b"{broken\n", b"[1]\n", b'{"prompt": "' + b"x" * 40 + b'"}\n',
             b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}\n')
REASONS = ["missing field", "both prompt and messages", "not a string", "empty text", "not ending with a user turn",
           "invalid JSON", "invalid JSON", "not an object", "longer than max_prompt_length", "template refused it"]


def test_bad_records_are_skipped_and_counted(tmp_path):
    """Each kind of bad record is a BadRecord naming its line; the stream skips them, counts each once an epoch,
    and goes on with the good ones."""
    path = write_jsonl(tmp_path / "bad.jsonl", [], MALFORMED)
    with open(path, "ab") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in records(3)))
    corpus = prompts.open_source(str(path), "dataset_path", False, OPTIONS)
    encoder = prompts.PromptEncoder(ByteTokenizer(), ChatTemplate(REFUSING, "refusing", {}), 32)
    results = [corpus.documents[i] if isinstance(corpus.documents[i], BadRecord) else encoder(corpus.documents[i])
               for i in range(len(MALFORMED))]
    assert [r.reason for r in results] == REASONS
    assert [r.where.split(" (")[0] for r in results] == [f"bad.jsonl:{i}" for i in range(1, 11)]
    assert "no system turns" in results[-1].where  # the template's own words
    ordered = prompts.PromptIterator(corpus.documents, np.arange(len(corpus)), encoder, None,
                                     {"where": "x", "split": "eval"})
    assert [p.record["id"] for p in ordered.next_prompts(4)] == [0, 1, 2, 0]
    assert ordered.stats() == {"data/prompts": 4, "data/skipped_records": 2 * len(MALFORMED),
                              "data/records_read": 4 + 2 * len(MALFORMED)}
    template = tmp_path / "refusing.jinja"
    template.write_text(REFUSING)
    it = make_prompts(prompts_cfg(path, f"chat_template={template}"), "train", 32)
    it.next_prompts(6)  # two epochs of the good records: all bad ones of the first epoch were passed
    assert len(MALFORMED) <= it.stats()["data/skipped_records"] <= 2 * len(MALFORMED)


def test_a_split_of_bad_records_is_one_config_error(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "a long prompt"}] * 3)
    with pytest.raises(ConfigError) as error:
        make_prompts(prompts_cfg(path), "train", 4).next_prompts(1)
    assert one_line(error).startswith(f"dataset_path={path}: no usable prompt in the train split, all 3 records")
    assert "longer than max_prompt_length" in str(error.value)


# --------------------------------------------------------------------------------------------- order and resume


def test_the_stream_is_deterministic_and_reshuffled_each_epoch(tmp_path):
    cfg = prompts_cfg(write_jsonl(tmp_path / "p.jsonl", records(10)))
    first = [p.record["id"] for p in make_prompts(cfg, "train", 64).next_prompts(30)]
    again = make_prompts(cfg, "train", 64)
    assert [p.record["id"] for n in (7, 0, 13, 10) for p in again.next_prompts(n)] == first  # any request sizes
    epochs = [first[i:i + 10] for i in (0, 10, 20)]
    assert all(sorted(e) == list(range(10)) for e in epochs) and epochs[0] != epochs[1] != epochs[2]
    other = make_prompts(dataclasses.replace(cfg, data_shuffle_seed=1), "train", 64)
    assert [p.record["id"] for p in other.next_prompts(30)] != first


def test_resume_continues_the_uninterrupted_stream(tmp_path):
    """A state taken mid-epoch (and in a later epoch), through JSON, in a fresh iterator: the same next prompts and
    counters as the iterator that went on; another seed's state is refused in one line."""
    path = write_jsonl(tmp_path / "p.jsonl", records(9), (b"{broken\n",))
    cfg = prompts_cfg(path)
    it = make_prompts(cfg, "train", 64)
    for before in (4, 11):
        it.next_prompts(before)
        state = json.loads(json.dumps(it.get_state()))
        after = it.next_prompts(12)
        resumed = make_prompts(cfg, "train", 64)
        resumed.set_state(state)
        assert resumed.next_prompts(12) == after
        assert resumed.stats() == it.stats() and resumed.get_state() == it.get_state()
    assert it.stats()["data/skipped_records"] >= 3  # the broken line, once an epoch
    other = make_prompts(dataclasses.replace(cfg, data_shuffle_seed=5), "train", 64)
    with pytest.raises(ConfigError, match="^cannot resume the prompts") as error:
        other.set_state(state)
    one_line(error)


def test_eval_split_differs_from_train(tmp_path):
    cfg = prompts_cfg(write_jsonl(tmp_path / "p.jsonl", records(40)), "eval_fraction=0.3")
    train = {p.record["id"] for p in make_prompts(cfg, "train", 64).next_prompts(40)}
    eval_ = [p.record["id"] for p in make_prompts(cfg, "eval", 64).next_prompts(40)]
    assert train and eval_ and not train & set(eval_) and train | set(eval_) == set(range(40))
    n = len(set(eval_))
    assert eval_[:n] == sorted(set(eval_)) and eval_[n:2 * n] == eval_[:n]  # corpus order, every epoch
    assert [p.record["id"] for p in make_prompts(cfg, "eval", 64).next_prompts(40)] == eval_


def test_a_streamed_hf_source_splits_encodes_skips_and_resumes_exactly(tmp_path, monkeypatch):
    """Parquet files read as a stream (`hf_streaming=always`: `load_dataset(..., streaming=True)`, offline): the
    prompts are the JSONL reader's (same ids, every field kept), train and eval (a hash of each record) partition
    the records, train follows the seed's window shuffle, a null and a too-long prompt are skipped and counted, a
    state taken mid-window (through JSON) resumes exactly; a stream of only too-long prompts is one ConfigError."""
    import datasets

    from maxshard.data import hf_stream

    monkeypatch.setattr(hf_stream, "SHUFFLE_WINDOW", 7)
    data = records(30)
    bad = [{"prompt": None, "answer": "x", "id": 98}, {"prompt": "x" * 80, "answer": "y", "id": 99}]
    (tmp_path / "p").mkdir()
    datasets.Dataset.from_list(data[:15] + bad).to_parquet(str(tmp_path / "p" / "a.parquet"))
    datasets.Dataset.from_list(data[15:]).to_parquet(str(tmp_path / "p" / "b.parquet"))
    cfg = prompts_cfg(f"{tmp_path}/p/*.parquet", "hf_streaming=always", "eval_fraction=0.3")
    by_id = {p.record["id"]: p for p in make_prompts(prompts_cfg(write_jsonl(tmp_path / "p.jsonl", data)), "train",
                                                      64).next_prompts(30)}
    it = make_prompts(cfg, "train", 64)
    assert isinstance(it, prompts.StreamedPromptIterator)
    first = it.next_prompts(5)
    state = json.loads(json.dumps(it.get_state()))
    after = it.next_prompts(40)  # over an epoch of the train split
    assert all(p.ids == by_id[p.record["id"]].ids and p.record == by_id[p.record["id"]].record for p in first + after)
    train = {p.record["id"] for p in first + after}
    eval_ = {p.record["id"] for p in make_prompts(cfg, "eval", 64).next_prompts(20)}
    assert train and eval_ and not train & eval_ and train | eval_ == set(range(30))
    assert [p.record["id"] for p in first] != sorted(p.record["id"] for p in first)  # shuffled in windows
    assert it.stats()["data/skipped_records"] >= 1 and it.stats()["data/prompts"] == 45
    resumed = make_prompts(cfg, "train", 64)
    resumed.set_state(state)
    assert resumed.next_prompts(40) == after and resumed.stats() == it.stats()
    reseeded = make_prompts(dataclasses.replace(cfg, data_shuffle_seed=7), "train", 64)
    assert [p.record["id"] for p in reseeded.next_prompts(5)] != [p.record["id"] for p in first]
    with pytest.raises(ConfigError, match="^cannot resume the prompts"):
        reseeded.set_state(state)
    with pytest.raises(ConfigError, match="held no usable document"):
        make_prompts(cfg, "train", 2).next_prompts(1)


# --------------------------------------------------------------------------------------------- rewards


def prompt(record: dict) -> Prompt:
    return Prompt((1,), "q", record)


def test_exact_match_with_and_without_a_regex():
    plain = load_reward(load())
    assert score(plain, [prompt({"answer": 42})] * 3, [" 42\n", "41", "the answer is 42"]).tolist() == [1, 0, 0]
    grouped = load_reward(load(r"reward_answer_regex=answer: *(\d+)", "reward_answer_field=target"))
    got = score(grouped, [prompt({"target": " 7 "})] * 4, ["so answer: 7.", "answer:7 or answer: 8", "answer: 8",
                                                            "no answer"])
    assert got.dtype == np.float32 and got.tolist() == [1, 1, 0, 0]  # the first match counts
    whole = ExactMatch("answer", r"-?\d+")  # no group: the whole match
    assert [whole("", c, {"answer": "-3"}) for c in ("x = -3", "x = 3", "")] == [1.0, 0.0, 0.0]
    with pytest.raises(RewardError) as error:
        score(plain, [prompt({"answer": "1"}), prompt({"id": 2})], ["1", "1"])
    assert one_line(error).startswith("reward=exact_match: record 1: reward_answer_field=answer: the record has no")


def test_a_reward_file_is_loaded_relative_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "mine.py").write_text(
        "import dataclasses\n\n@dataclasses.dataclass\nclass Seen:\n    n: int = 0\n\n"
        "def length(prompt, completion, record):\n    return len(completion) + record['bonus'] + len(prompt)\n\n"
        "def flag(prompt, completion, record):\n    return completion == 'yes'\n")
    monkeypatch.chdir(tmp_path)
    cfg = load("reward=rewards/mine.py:length")
    assert cfg.reward == f"{tmp_path}/rewards/mine.py:length"  # resolved when the config is loaded
    monkeypatch.chdir(REPO)
    got = score(load_reward(cfg), [Prompt((1,), "ab", {"bonus": 0.5})] * 2, ["xyz", ""])
    assert got.dtype == np.float32 and got.tolist() == [5.5, 2.5]
    flag = load_reward(dataclasses.replace(cfg, reward=f"{tmp_path}/rewards/mine.py:flag"))
    assert score(flag, [prompt({})] * 2, ["yes", "no"]).tolist() == [1.0, 0.0]  # a bool is a number


@pytest.mark.parametrize("body, message", [
    ("score = 3\n", r"reward=.*bad\.py:score: score in .*bad\.py is not callable \(an int\)$"),
    ("def other(p, c, r):\n    return 0\n", r"reward=.*: .*bad\.py has no function score \(it defines: other\)$"),
    ("def score(p, c, r)\n    return 0\n", r"reward=.*: .*bad\.py line 1: SyntaxError: expected ':'$"),
    ("import no_such_module_here\n", r"reward=.*: importing .*bad\.py failed: ModuleNotFoundError: No module named"),
    ("raise ValueError('setup\\nfailed')\n", r"reward=.*: importing .*bad\.py failed: ValueError: setup$"),
])
def test_a_bad_reward_file_is_one_line_naming_the_key(tmp_path, body, message):
    (tmp_path / "bad.py").write_text(body)
    with pytest.raises(ConfigError, match=message) as error:
        load_reward(load(f"reward={tmp_path}/bad.py:score"))
    one_line(error)
    with pytest.raises(ConfigError, match=r"^reward=.*missing\.py:score: no such file .*missing\.py$"):
        load_reward(load(f"reward={tmp_path}/missing.py:score"))


@pytest.mark.parametrize("returned, message", [
    ("'1.0'", "the reward returned str '1.0', not a number"),
    ("None", "the reward returned NoneType None, not a number"),
    ("float('nan')", "the reward returned nan, not a finite (float32) number"),
    ("-float('inf')", "the reward returned -inf, not a finite (float32) number"),
    ("1e300", "the reward returned 1e+300, not a finite (float32) number"),
    ("record['missing']", "the reward raised KeyError: 'missing'"),
])
def test_a_failing_reward_stops_with_one_line_naming_the_record(tmp_path, returned, message):
    (tmp_path / "r.py").write_text(f"def score(prompt, completion, record):\n"
                                   f"    return 1 if completion == 'ok' else {returned}\n")
    reward = load_reward(load(f"reward={tmp_path}/r.py:score"))
    with pytest.raises(RewardError) as error:
        score(reward, [prompt({})] * 3, ["ok", "ok", "bad"])
    assert isinstance(error.value, ConfigError)
    assert one_line(error) == f"reward={tmp_path}/r.py:score: record 2: {message}"


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, message", [
    (("reward=exact",), "reward=exact: exact_match, model:STEP_DIR"),
    (("reward=x.py:not-a-name",), "reward=x.py:not-a-name: exact_match, model:STEP_DIR"),
    (("reward_answer_regex=(",), "reward_answer_regex='(' is not a regular expression: missing ), unterminated"),
    (("reward_answer_field=",), "reward_answer_field must name a record field"),
    (("grpo_group_size=1",), "grpo_group_size must be >= 2, got 1"),
    (("grpo_updates_per_rollout=0",), "grpo_updates_per_rollout must be >= 1, got 0"),
    (("grpo_max_new_tokens=0",), "grpo_max_new_tokens must be >= 1, got 0"),
    (("grpo_max_prompt_length=0",), "grpo_max_prompt_length must be >= 1, got 0"),
    (("grpo_kl_beta=-0.1",), "grpo_kl_beta must be >= 0 (0: no reference kept), got -0.1"),
    (("grpo_epsilon=0",), "grpo_epsilon must be > 0, got 0.0"),
    (("grpo_temperature=0",), "grpo_temperature must be > 0, got 0.0"),
    (("grpo_top_p=0",), "grpo_top_p must be in (0, 1] (1: off), got 0.0"),
    (("grpo_top_p=1.5",), "grpo_top_p must be in (0, 1] (1: off), got 1.5"),
    (("dataset_type=prompts",), "dataset_type=prompts holds prompts to sample completions from: set objective to "
                                "grpo (objective=lm)"),
    (("dataset_type=prompts", "dataset_mixture=[[a.jsonl, 1]]"), "dataset_mixture mixes documents, not prompts"),
])
def test_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load(*overrides)
    assert one_line(error).startswith(message)


def test_grpo_keys_defaults_and_the_group_batch():
    cfg = load()
    assert (cfg.grpo_group_size, cfg.grpo_kl_beta, cfg.reward, cfg.reward_answer_field) == (4, 0.04, "exact_match",
                                                                                          "answer")
    assert ranges.check_group_batch(dataclasses.replace(cfg, global_batch_size=6, grpo_group_size=4)) is not None
    grpo = dataclasses.replace(cfg, objective="grpo", global_batch_size=6, grpo_group_size=4)  # only the string
    with pytest.raises(ConfigError) as error:
        ranges.check_group_batch(grpo)
    assert one_line(error).startswith("global_batch_size=6 (per_device_batch_size x devices) must be a multiple of "
                                      "grpo_group_size=4")
    assert ranges.check_group_batch(dataclasses.replace(grpo, global_batch_size=8)).global_batch_size == 8


def test_prompts_are_not_training_rows(tmp_path):
    """make_input refuses prompts (GRPO calls make_prompts); make_prompts wants them, and an empty split or a file
    without prompt fields is one line naming dataset_path."""
    path = write_jsonl(tmp_path / "p.jsonl", records(2))
    with pytest.raises(ConfigError, match="^dataset_type=prompts holds prompts, not training rows") as error:
        make_input(prompts_cfg(path), None)
    one_line(error)
    with pytest.raises(ConfigError, match="^dataset_type=jsonl: GRPO samples from dataset_type=prompts"):
        make_prompts(dataclasses.replace(prompts_cfg(path), dataset_type="jsonl"), "train", 8)
    with pytest.raises(ConfigError, match=f"^dataset_path={path}: the eval split is empty"):
        make_prompts(prompts_cfg(path), "eval", 8)
    other = write_jsonl(tmp_path / "q.jsonl", [{"text": "no prompt"}])
    with pytest.raises(ConfigError, match=f"^record field=prompt or messages: no record of dataset_path={other}"):
        make_prompts(prompts_cfg(other), "train", 8)
    with pytest.raises(ConfigError, match="^dataset_path is empty; dataset_type=prompts reads"):
        make_prompts(prompts_cfg(""), "train", 8)
