"""Preference pairs (`dataset_type: preference`, data/preference.py): the row layout the preference losses read
(pair p of a row: segment 2p-1 chosen, 2p rejected; positions from 0 at each half; weights on completion targets),
whole pairs packed first-fit, bad and long records skipped and counted, conversations weighted on their last
assistant turn, Hugging Face rows, exact resume, and TRL's own ids for the same records.

Byte-level ids (ByteTokenizer): PAD 0, BOS 1, EOS 2, a byte b is b + 3 ('a' = 100).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import grain
import numpy as np
import pytest

from maxshard import config
from maxshard.data import make_input, packing, pipeline, preference
from maxshard.data.chat import WEIGHT
from maxshard.data.chat_template import ChatTemplate
from maxshard.data.mixture import SKIPPED
from maxshard.data.sources import BadRecord, ReadOptions
from maxshard.data.tokenizer import ByteTokenizer, load_hf_tokenizer
from maxshard.errors import ConfigError
from maxshard.parallel import mesh as mesh_lib
from tests.test_data import BASE, assert_same, take

REPO = Path(__file__).resolve().parent.parent
QWEN = REPO / "tests" / "fixtures" / "hf" / "qwen3" / "tokenizer.json"
CHATML = REPO / "tests" / "fixtures" / "chat" / "chatml.jinja"
TRL_CASES = REPO / "tests" / "fixtures" / "preference" / "cases.json"
OPTIONS = ReadOptions("", "text", "messages", "train", "", "never")


def pref_cfg(path: Path, *overrides: str) -> config.Config:
    """base.yml reading preference pairs from `path`: 8 rows of 32 tokens, every record in train."""
    values = {"per_device_batch_size": "1", "max_target_length": "32", "eval_fraction": "0"}
    values.update(o.split("=", 1) for o in overrides)
    return config.load([BASE, "dataset_type=preference", "objective=dpo", f"dataset_path={path}",
                        *(f"{k}={v}" for k, v in values.items())])


def write_jsonl(path: Path, records: list, raw: tuple[bytes, ...] = ()) -> Path:
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + b"".join(raw))
    return path


def text_records(count: int) -> list[dict[str, str]]:
    """Pairs of different lengths, each record's text its own (so a row's halves name their record)."""
    return [{"prompt": f"q{i}" + "." * (i % 4), "chosen": f"c{i}" + "+" * (i % 3), "rejected": f"r{i}" + "-" * (i % 5)}
            for i in range(count)]


def half(prompt: str, completion: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
    """One half with byte ids: (inputs, targets, weights) of BOS prompt completion EOS, weighted on the completion."""
    tok = ByteTokenizer()
    tokens = [tok.bos_id, *tok.encode(prompt), *tok.encode(completion), tok.eos_id]
    weights = [0.0] * len(prompt) + [1.0] * (len(completion) + 1)
    return tuple(tokens[:-1]), tuple(tokens[1:]), tuple(weights)


def pairs_of(row: dict[str, np.ndarray]) -> list[tuple[tuple, tuple]]:
    """A row's pairs as ((inputs, targets, weights) chosen, (...) rejected), checking segments and positions."""
    segments = row["segment_ids"]
    real = segments[segments > 0]
    count = int(real.max()) // 2 if len(real) else 0
    assert (segments[: len(real)] == real).all() and (segments[len(real):] == 0).all()  # padding only at the end
    assert sorted(set(real.tolist())) == list(range(1, 2 * count + 1)) and (np.diff(real) >= 0).all()
    pairs = []
    for p in range(1, count + 1):
        halves = []
        for segment in (2 * p - 1, 2 * p):
            where = segments == segment
            assert row["positions"][where].tolist() == list(range(where.sum()))
            halves.append(tuple(tuple(row[k][where].tolist()) for k in ("inputs", "targets", "loss_weights")))
        pairs.append(tuple(halves))
    return pairs


def expected_pair(record: dict[str, str]) -> tuple[tuple, tuple]:
    return half(record["prompt"], record["chosen"]), half(record["prompt"], record["rejected"])


# --------------------------------------------------------------------------------------------- layout and packing


def test_row_layout_of_hand_made_pairs(tmp_path):
    """prompt "ab", chosen "cd", rejected "e", rows of 24: two pairs a row, exactly as the contract says."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab", "chosen": "cd", "rejected": "e"}] * 4)
    cfg = pref_cfg(path, "max_target_length=24")
    batch = take(make_input(cfg, mesh_lib.build(cfg)), 1)[0]
    assert batch["inputs"].shape == (8, 24)
    a, b, c, d, e = 100, 101, 102, 103, 104
    pair_inputs = [1, a, b, c, d, 1, a, b, e]
    pair_targets = [a, b, c, d, 2, a, b, e, 2]
    for row in range(8):
        assert batch["inputs"][row].tolist() == pair_inputs * 2 + [0] * 6
        assert batch["targets"][row].tolist() == pair_targets * 2 + [0] * 6
        assert batch["segment_ids"][row].tolist() == [1] * 5 + [2] * 4 + [3] * 5 + [4] * 4 + [0] * 6
        assert batch["positions"][row].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3] * 2 + [0] * 6
        assert batch["loss_weights"][row].tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1] * 2 + [0] * 6
    assert batch["loss_weights"].dtype == np.float32 and batch["segment_ids"].dtype == np.int32


def test_first_fit_packs_whole_pairs():
    """Pairs of 9, 9 and 4 tokens into rows of 16: the third goes back to the first row, which has room."""
    def example(chosen: int, rejected: int, first: int) -> dict[str, np.ndarray]:
        halves = [(np.arange(first, first + n, dtype=np.int32), np.ones(n, np.int8)) for n in (chosen, rejected)]
        return preference.pair_example(halves)

    pairs = [example(6, 5, 10), example(5, 6, 30), example(3, 3, 50)]
    rows = list(packing.pack_pairs(grain.MapDataset.source(pairs).to_iter_dataset(), 16, extra=(WEIGHT,)))
    assert len(rows) == 2
    assert rows[0]["inputs"].tolist() == [10, 11, 12, 13, 14, 10, 11, 12, 13, 50, 51, 50, 51, 0, 0, 0]
    assert rows[0]["segment_ids"].tolist() == [1] * 5 + [2] * 4 + [3] * 2 + [4] * 2 + [0] * 3
    assert rows[0]["positions"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 0, 1, 0, 0, 0]
    assert rows[0]["loss_weights"].tolist() == [1] * 13 + [0] * 3
    assert rows[1]["segment_ids"].tolist() == [1] * 4 + [2] * 5 + [0] * 7
    unpacked = list(packing.pack_pairs(grain.MapDataset.source(pairs).to_iter_dataset(), 16, False, (WEIGHT,)))
    assert [int(r["segment_ids"].max()) for r in unpacked] == [2, 2, 2]


@pytest.mark.parametrize("packed", [True, False])
def test_rows_hold_whole_pairs_of_the_records(tmp_path, packed):
    """Through make_input: every pair in a row is a whole record, chosen then rejected, laid out exactly; packed
    rows hold several, unpacked rows one (padded)."""
    records = text_records(24)
    expected = {expected_pair(r) for r in records}
    cfg = pref_cfg(write_jsonl(tmp_path / "p.jsonl", records), f"packing={str(packed).lower()}", "max_target_length=64")
    seen = []
    for batch in take(make_input(cfg, mesh_lib.build(cfg)), 3):
        for row in range(batch["inputs"].shape[0]):
            pairs = pairs_of({k: v[row] for k, v in batch.items()})
            assert pairs and all(p in expected for p in pairs)
            assert len(pairs) >= 2 if packed else len(pairs) == 1
            seen += pairs
    assert len(set(seen)) == len(records)  # more than an epoch: every record came


# --------------------------------------------------------------------------------------------- bad records


MALFORMED = (b'{"prompt": "p", "chosen": "c"}\n', b'{"prompt": 3, "chosen": "c", "rejected": "r"}\n',
             b'{"prompt": "p", "chosen": [{"role": "assistant", "content": "c"}], "rejected": "r"}\n',
             b'{"chosen": [1], "rejected": [2]}\n', b'{"chosen": "c", "rejected": "r"}\n', b"{broken\n", b"[1]\n")
REASONS = ["missing field", "not a string", "text mixed with messages", "not a list of messages", "missing field",
           "invalid JSON", "not an object"]


def test_malformed_records_are_bad_records_naming_their_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", text_records(2), MALFORMED)
    documents = preference.open_source(str(path), "dataset_path", False, OPTIONS).documents
    assert isinstance(documents[0], preference.Preference) and documents[0].prompt == "q0"
    bad = [documents[i] for i in range(2, 2 + len(MALFORMED))]
    assert [b.reason for b in bad] == REASONS and all(isinstance(b, BadRecord) for b in bad)
    assert [b.where for b in bad] == [f"bad.jsonl:{i}" for i in range(3, 3 + len(MALFORMED))]
    encoder = preference.PreferenceEncoder(ByteTokenizer(), None, 16)
    long = encoder(preference.Preference("prompt", "chosen", "rejected"), "bad.jsonl line 9")
    assert long == BadRecord("longer than max_target_length", "bad.jsonl line 9")
    assert encoder(preference.Preference("p", "c", "r"), "x")["inputs"].shape == (6,)
    gz = tmp_path / "bad.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))  # compressed JSONL: the same records
    again = preference.open_source(str(gz), "dataset_path", False, OPTIONS).documents
    assert [again[i] for i in range(2)] == [documents[i] for i in range(2)] and again[2].where == "bad.jsonl.gz:3"


def test_bad_and_long_records_are_skipped_and_counted_exactly(tmp_path):
    """Corpus order, one pair a row: the malformed lines and a too-long pair are counted once, at the next pair;
    in a run they show in data/skipped_records, never as an error."""
    records = text_records(6)
    long = {"prompt": "x" * 20, "chosen": "y", "rejected": "z"}
    path = write_jsonl(tmp_path / "bad.jsonl", records[:3] + [long], MALFORMED)
    with open(path, "ab") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in records[3:]))
    corpus = preference.open_source(str(path), "dataset_path", False, OPTIONS)
    encoder = preference.PreferenceEncoder(ByteTokenizer(), None, 32)
    opts = pipeline.PipelineOptions(length=32, batch=1, packing=False, shuffle_seed=None, prefetch=0, pairs=True)
    stream = pipeline.SourceStream(corpus.documents, np.arange(len(corpus)), encoder=encoder)
    it = iter(pipeline.mixed_batches([stream], ByteTokenizer(), opts))
    rows = [next(it) for _ in range(6)]
    assert [pairs_of({k: v[0] for k, v in r.items()}) for r in rows] == [[expected_pair(r)] for r in records]
    assert [int(r[SKIPPED].sum()) for r in rows] == [0, 0, 0, 1 + len(MALFORMED), 0, 0]
    cfg = pref_cfg(path)
    run = make_input(cfg, mesh_lib.build(cfg))
    take(run, 2)  # 16 rows of at least one pair: more than an epoch of 6
    assert run.stats()["data/skipped_records"] >= 1 + len(MALFORMED)


# --------------------------------------------------------------------------------------------- conversations


def chat_record(reply: str, rejected: str) -> dict:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "the lazy dog"}]
    return {"chosen": [*turns, {"role": "assistant", "content": reply}],
            "rejected": [*turns, {"role": "assistant", "content": rejected}]}


def test_chat_records_weigh_the_last_assistant_turn(tmp_path):
    """Shared conversations and TRL's prompt/chosen/rejected messages, rendered with the run's template: both halves
    start with the same prompt tokens and only the last assistant turn (its <|im_end|> included) weighs."""
    trl_form = {"prompt": [{"role": "user", "content": "the lazy dog"}],
                "chosen": [{"role": "assistant", "content": "reads"}],
                "rejected": [{"role": "assistant", "content": "jumps a fox"}]}
    differ = {"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
              "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [chat_record("reads a book", "jumps"), trl_form, differ])
    cfg = pref_cfg(path, "packing=false", "max_target_length=160", f"tokenizer_path={QWEN}",
                   f"chat_template={CHATML}")
    tok = load_hf_tokenizer(str(QWEN))
    replies = {tuple(tok.encode(t + "<|im_end|>")) for t in ("reads a book", "jumps", "reads", "jumps a fox")}
    it = make_input(cfg, mesh_lib.build(cfg))
    for batch in take(it, 2):
        for row in range(8):
            (chosen, rejected), = pairs_of({k: v[row] for k, v in batch.items()})
            for inputs, targets, weights in (chosen, rejected):
                weighted = [t for t, w in zip(targets, weights) if w]
                assert tuple(weighted) in replies
                assert weights[weights.index(1):][: len(weighted)] == (1,) * len(weighted)  # one run
            prompt = chosen[2].index(1)
            assert prompt == rejected[2].index(1) and chosen[0][:prompt + 1] == rejected[0][:prompt + 1]
    assert it.stats()["data/skipped_records"] >= 7  # the record whose prompts differ, once an epoch
    encoder = preference.PreferenceEncoder(tok, ChatTemplate(CHATML.read_text(), "chatml", {}), 160)
    assert encoder(preference.as_preference(differ, "x"), "c.jsonl line 3") == BadRecord("prompts differ",
                                                                                         "c.jsonl line 3")


def test_hf_dataset_rows(tmp_path):
    """A Hugging Face save_to_disk directory: the prompt/chosen/rejected columns make the same pairs; a null is a
    bad record naming its row."""
    import datasets

    records = text_records(8)
    datasets.Dataset.from_list(records + [{"prompt": "p", "chosen": "c", "rejected": None}]).save_to_disk(
        str(tmp_path / "saved"))
    corpus = preference.open_source(str(tmp_path / "saved"), "dataset_path", False, OPTIONS)
    assert corpus.documents[8] == BadRecord("missing field", "saved row 8")
    cfg = pref_cfg(tmp_path / "saved", "packing=false")
    batch = take(make_input(cfg, mesh_lib.build(cfg)), 1)[0]
    expected = {expected_pair(r) for r in records}
    assert all(pairs_of({k: v[row] for k, v in batch.items()})[0] in expected for row in range(8))


# --------------------------------------------------------------------------------------------- resume, config


def test_resume_gives_the_same_next_batches(tmp_path):
    """A state taken inside a packed group of rows (8 of PAIR_BINS=16 delivered) and after it resumes exactly."""
    cfg = pref_cfg(write_jsonl(tmp_path / "p.jsonl", text_records(40)))
    it = make_input(cfg, mesh_lib.build(cfg))
    for before in (1, 2):
        take(it, before)
        state = json.loads(json.dumps(it.get_state()))
        after = take(it, 2)
        resumed = make_input(cfg, mesh_lib.build(cfg))
        resumed.set_state(state)
        assert_same(take(resumed, 2), after)
        assert resumed.stats() == it.stats()


def test_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="^dataset_mixture mixes documents, not preference pairs"):
        config.load([BASE, "dataset_type=preference", "objective=dpo", f"dataset_mixture=[[{tmp_path}/a.jsonl, 1]]"])
    path = write_jsonl(tmp_path / "p.jsonl", [{"text": "no pair"}])
    with pytest.raises(ConfigError, match="^record field=chosen: no record of dataset_path="):
        cfg = pref_cfg(path)
        make_input(cfg, mesh_lib.build(cfg))
    with pytest.raises(ConfigError, match="the eval split is empty"):
        cfg = pref_cfg(write_jsonl(tmp_path / "q.jsonl", text_records(4)))
        make_input(cfg, mesh_lib.build(cfg), "eval")


# --------------------------------------------------------------------------------------------- TRL's ids


@pytest.mark.skipif(not TRL_CASES.exists(), reason="tests/fixtures/preference/cases.json (made with TRL) not here")
def test_halves_are_trl_dpo_ids():
    """The records of the TRL fixture give, with the same tokenizer, exactly the ids TRL's DPOTrainer made:
    a half is prompt_ids + chosen_ids (EOS included), weighted on the completion's ids."""
    cases = json.loads(TRL_CASES.read_text())
    tok = load_hf_tokenizer(str(QWEN))
    encoder = preference.PreferenceEncoder(tok, None, 4096)
    conversational = cases["conversational"]
    template = ChatTemplate(conversational["chat_template"], "fixture", {})
    for records, ids, enc in ((cases["records"], cases["pairs"], encoder),
                              (conversational["records"], conversational["pairs"],
                               preference.PreferenceEncoder(tok, template, 4096))):
        for record, trl in zip(records, ids, strict=True):
            example = enc(preference.as_preference(record, "fixture"), "fixture")
            for half_id, completion in ((1, trl["chosen_ids"]), (2, trl["rejected_ids"])):
                mine = example[packing.HALF] == half_id
                tokens = [*example["inputs"][mine].tolist(), int(example["targets"][mine][-1])]
                assert tokens == trl["prompt_ids"] + completion, (record, half_id)
                assert example["targets"][mine][example[WEIGHT][mine] > 0].tolist() == completion


# --------------------------------------------------------------------------------------------- streamed


def test_streamed_hf_pairs_split_shuffle_count_and_resume_exactly(tmp_path, monkeypatch):
    """Parquet files read as a stream (`hf_streaming=always`: `load_dataset(..., streaming=True)`, the code path of
    a hub name, offline): every row holds whole pairs of the records, train and eval (a hash of each record) do not
    share one, a null and a too-long pair are skipped and counted, and a state taken mid-stream resumes with the
    uninterrupted run's batches; a stream whose every pair is too long is one ConfigError, not an endless search."""
    import datasets

    from maxshard.data import hf_stream

    monkeypatch.setattr(hf_stream, "SHUFFLE_WINDOW", 7)  # several windows in 40 records
    records = text_records(40)
    bad = [{"prompt": "p", "chosen": "c", "rejected": None}, {"prompt": "x" * 40, "chosen": "y", "rejected": "z"}]
    (tmp_path / "pairs").mkdir()
    datasets.Dataset.from_list(records[:20] + bad).to_parquet(str(tmp_path / "pairs" / "a.parquet"))
    datasets.Dataset.from_list(records[20:]).to_parquet(str(tmp_path / "pairs" / "b.parquet"))
    files, keys = f"{tmp_path}/pairs/*.parquet", ("hf_streaming=always", "eval_fraction=0.25")
    cfg = pref_cfg(files, *keys)
    expected = {expected_pair(r) for r in records}

    def seen(batches):
        return {p for b in batches for row in range(b["inputs"].shape[0])
                for p in pairs_of({k: v[row] for k, v in b.items()})}

    it = make_input(cfg, mesh_lib.build(cfg))
    first = take(it, 1)
    state = json.loads(json.dumps(it.get_state()))
    after = take(it, 3)
    train = seen(first + after)
    assert train <= expected and len(train) > 20
    assert it.stats()["data/skipped_records"] >= 2  # over an epoch of the train split
    resumed = make_input(cfg, mesh_lib.build(cfg))
    resumed.set_state(state)
    assert_same(take(resumed, 3), after)
    evaluation = seen(take(make_input(cfg, mesh_lib.build(cfg), "eval"), 2))
    assert evaluation and evaluation <= expected and not evaluation & train
    other = take(make_input(pref_cfg(files, *keys, "data_shuffle_seed=9"), mesh_lib.build(cfg)), 1)
    assert seen(other) != seen(first)  # the window shuffle follows the seed
    with pytest.raises(ConfigError, match="held no usable document"):
        take(make_input(pref_cfg(files, *keys, "max_target_length=8"), mesh_lib.build(cfg)), 1)
