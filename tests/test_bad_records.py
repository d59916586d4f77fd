"""Bad records are visible and bounded (`maxshard/data/bad_records.py`): the console says how many were skipped, their
share of the records read and the first reasons; a share above `max_bad_record_fraction` (judged from 1,000 records
read) stops the run in one line naming the source, the share and the first reasons; counts and reasons resume.
Every reader of `make_input` goes through the same mixture, GRPO's prompts through their own stream."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from maxshard import config, train
from maxshard.data import bad_records, make_input, prompts
from maxshard.errors import ConfigError
from maxshard.observe import console
from maxshard.observe.metrics import MetricsWriter, StepValues
from maxshard.parallel import mesh as mesh_lib
from tests.helpers import tiny_config
from tests.test_data import BASE, take

GOOD, BAD = b'{"text": "ab"}\n', b"{broken\n"


def one_bad_in_three(path, lines: int = 30) -> str:
    """A JSONL file whose every third line (3, 6, ...) is not JSON."""
    path.write_bytes(b"".join(BAD if i % 3 == 2 else GOOD for i in range(lines)))
    return str(path)


def load(tmp_path, *overrides: str) -> config.Config:
    """base.yml, 8 rows of 32 tokens a batch, every record in train, the run directory under `tmp_path` (made, as a
    training makes it, so the first bad records are written there)."""
    values = {"per_device_batch_size": "1", "max_target_length": "32", "eval_fraction": "0",
              "base_output_directory": str(tmp_path / "runs")}
    values.update(o.split("=", 1) for o in overrides)
    cfg = config.load([BASE, *(f"{k}={v}" for k, v in values.items())])
    os.makedirs(cfg.run_dir, exist_ok=True)
    return cfg


def first_written(cfg: config.Config) -> list[str]:
    return bad_records.read_examples(cfg.run_dir)


# --------------------------------------------------------------------------------------------- through the CLI


CLI = ("model_name=tiny", "cpu_device_count=8", "per_device_batch_size=1", "log_period=1", "eval_period=0",
       "eval_fraction=0", "enable_checkpointing=false", "enable_tensorboard=false")


def cli_argv(tmp_path, *extra: str) -> list[str]:
    """The CLI's arguments for a tiny run (rows of the preset's 64 tokens) under `tmp_path`; later keys win."""
    merged = {item.split("=")[0]: item for item in (*CLI, f"base_output_directory={tmp_path}", *extra)}
    return [BASE, *merged.values()]


def test_a_corpus_with_one_bad_line_in_three_says_so_on_the_console(tmp_path, capsys):
    data = one_bad_in_three(tmp_path / "data.jsonl")
    argv = cli_argv(tmp_path, "steps=3", "dataset_type=jsonl", f"dataset_path={data}", "max_bad_record_fraction=0.5",
                    "run_name=visible")
    assert train.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped records: ")]
    assert lines, "no skipped-records line"
    assert re.search(r"first: [^;]*data\.jsonl\D+\d+: invalid JSON", lines[0]), lines
    assert re.search(r"^skipped records: \d+ of \d+ read \(\d+\.\d%; .*max_bad_record_fraction=0\.5", lines[0]), lines
    records = [json.loads(r) for r in (tmp_path / "visible" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "data/skipped_records" in r][-1]
    skipped, read = last["data/skipped_records"], last["data/records_read"]
    assert 0 < skipped < read and abs(skipped / read - 1 / 3) < 0.1, last
    shown = [int(line.split()[2].replace(",", "")) for line in lines]
    assert shown == sorted(set(shown)) and shown[-1] == skipped  # a line where the count grew, never twice the same


def test_a_share_above_the_bound_stops_the_run_in_one_line(tmp_path, capsys):
    """About a thousand records a step (32 rows of 64 tokens, documents of 3 tokens): within two steps more than
    `bad_records.MIN_RECORDS` are read, a third of them bad, above the bound of 10%."""
    data = one_bad_in_three(tmp_path / "data.jsonl", 3000)
    argv = cli_argv(tmp_path, "per_device_batch_size=4", "steps=6", "dataset_type=jsonl", f"dataset_path={data}",
                    "max_bad_record_fraction=0.1", "run_name=bounded")
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"maxshard: error: dataset_path={data}: "), err
    assert "above max_bad_record_fraction=0.1" in err[0] and "invalid JSON" in err[0] and "data.jsonl" in err[0]
    share = float(err[0].split(" are bad (")[1].split("%")[0])
    assert 30 < share < 37, err


def test_a_bad_bound_is_one_line_naming_the_key():
    for value in ("-0.1", "1.5", "nan"):
        with pytest.raises(ConfigError) as e:
            config.load([BASE, f"max_bad_record_fraction={value}"])
        assert "max_bad_record_fraction must be" in str(e.value) and "\n" not in str(e.value)
    assert config.load([BASE, "max_bad_record_fraction=1"]).max_bad_record_fraction == 1.0


# --------------------------------------------------------------------------------------------- every reader


def _text(tmp_path):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text("" if i == 1 else f"text {i}")
    return ("dataset_type=text", f"dataset_path={tmp_path}"), r"doc1\.txt: empty text"


def _jsonl(tmp_path):
    return ("dataset_type=jsonl", f"dataset_path={one_bad_in_three(tmp_path / 'data.jsonl')}"), "invalid JSON"


def _parquet(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    texts = [None if i % 3 == 2 else f"row {i}" for i in range(30)]
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), str(tmp_path / "data.parquet"), row_group_size=8)
    return ("dataset_type=parquet", f"dataset_path={tmp_path / 'data.parquet'}"), "missing field"


def _chat(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    user_only = {"messages": [{"role": "user", "content": "hi"}]}  # found bad by the encoder, after reading
    lines = [json.dumps(user_only if i % 3 == 2 else good) + "\n" for i in range(30)]
    (tmp_path / "chat.jsonl").write_text("".join(lines))
    return ("dataset_type=chat", f"dataset_path={tmp_path / 'chat.jsonl'}"), r"chat\.jsonl\D+\d+: no assistant turn"


def _preference(tmp_path):
    good = {"prompt": "q", "chosen": "c", "rejected": "r"}
    lines = [json.dumps({"prompt": "q", "chosen": "c"} if i % 3 == 2 else good) + "\n" for i in range(30)]
    (tmp_path / "pairs.jsonl").write_text("".join(lines))
    return ("dataset_type=preference", "objective=dpo", f"dataset_path={tmp_path / 'pairs.jsonl'}"), "missing field"


def _hf_stream(tmp_path):
    pytest.importorskip("datasets")
    lines = [b'{"text": ""}\n' if i % 3 == 2 else GOOD for i in range(30)]
    (tmp_path / "data.jsonl").write_bytes(b"".join(lines))
    return ("dataset_type=hf", f"dataset_path={tmp_path / 'data.jsonl'}", "hf_streaming=always"), "empty text"


READERS = {"text": _text, "jsonl": _jsonl, "parquet": _parquet, "chat": _chat, "preference": _preference,
           "hf_stream": _hf_stream}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_counts_shows_and_bounds_its_bad_records(reader, tmp_path):
    """One record in three bad: counted with the records read, the first reasons written for the console, and a
    bound of 5% stops the stream once a thousand records are read, naming the source and the first reasons."""
    keys, reason = READERS[reader](tmp_path)
    cfg = load(tmp_path, *keys, "packing=false", "max_bad_record_fraction=0.05")
    it = make_input(cfg, mesh_lib.build(cfg))
    take(it, 2)
    stats = it.stats()
    assert 0 < stats["data/skipped_records"] < stats["data/records_read"], stats
    assert stats["data/records_read"] - stats["data/skipped_records"] == 16  # unpacked: a document a row
    assert any(re.search(reason, line) for line in first_written(cfg)), first_written(cfg)
    with pytest.raises(ConfigError) as e:
        for _ in range(2 * bad_records.MIN_RECORDS // 8):
            next(it)
    message = str(e.value)
    assert "\n" not in message and "above max_bad_record_fraction=0.05" in message and re.search(reason, message)
    assert it.stats()["data/records_read"] >= bad_records.MIN_RECORDS


def test_the_first_reasons_reach_the_main_process_from_grain_workers(tmp_path):
    cfg = load(tmp_path, "dataset_type=jsonl", f"dataset_path={one_bad_in_three(tmp_path / 'data.jsonl')}",
               "grain_worker_count=1")
    it = make_input(cfg, mesh_lib.build(cfg))
    take(it, 2)
    it.close()
    assert len(first_written(cfg)) == bad_records.SHOWN
    assert all(line.endswith(": invalid JSON") and "data.jsonl" in line for line in first_written(cfg))


# --------------------------------------------------------------------------------------------- resume


def test_counts_and_first_reasons_resume_with_the_state(tmp_path):
    cfg = load(tmp_path, "dataset_type=jsonl", f"dataset_path={one_bad_in_three(tmp_path / 'data.jsonl')}")
    it = make_input(cfg, mesh_lib.build(cfg))
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    take(it, 2)
    written = first_written(cfg)
    os.remove(os.path.join(cfg.run_dir, bad_records.EXAMPLES_FILE))  # a resume in another run directory
    resumed = make_input(cfg, mesh_lib.build(cfg))
    resumed.set_state(state)
    assert first_written(cfg) == written  # written again from the state
    take(resumed, 2)
    assert resumed.stats() == it.stats() and resumed.stats()["data/skipped_records"] > 0


def test_a_state_from_before_records_were_counted_resumes(tmp_path):
    """An older state holds one total of skipped records and no records read: the total goes on, the share (and
    its bound) counts from the resume on."""
    cfg = load(tmp_path, "dataset_type=jsonl", f"dataset_path={one_bad_in_three(tmp_path / 'data.jsonl')}")
    it = make_input(cfg, mesh_lib.build(cfg))
    take(it, 1)
    state = it.get_state()
    state["stats"] = {"tokens": state["stats"]["tokens"], "skipped": 170}
    resumed = make_input(cfg, mesh_lib.build(cfg))
    resumed.set_state(state)
    assert resumed.stats()["data/skipped_records"] == 170 and resumed.stats()["data/records_read"] == 0
    take(resumed, 1)
    stats = resumed.stats()
    assert 170 < stats["data/skipped_records"] and stats["data/records_read"] > stats["data/skipped_records"] - 170


# --------------------------------------------------------------------------------------------- prompts


def prompts_cfg(tmp_path, path, *overrides: str) -> config.Config:
    """As tests/test_prompts.py: loaded as jsonl, then switched to prompts (the config admits them with grpo only)."""
    return dataclasses.replace(load(tmp_path, "dataset_type=jsonl", f"dataset_path={path}", *overrides),
                               dataset_type="prompts")


def write_prompts(path, lines: int) -> str:
    rows = [b"{broken\n" if i % 3 == 2 else json.dumps({"prompt": f"q{i}", "answer": "a"}).encode() + b"\n"
            for i in range(lines)]
    path.write_bytes(b"".join(rows))
    return str(path)


def test_prompts_count_show_resume_and_bound_their_bad_records(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", 30)
    cfg = prompts_cfg(tmp_path, path, "max_bad_record_fraction=0.05")
    it = prompts.make_prompts(cfg, "train", 64)
    it.next_prompts(21)  # the 20 good records of the first epoch and one more: every bad one of it passed
    stats = it.stats()
    assert stats["data/skipped_records"] >= 10 and stats["data/records_read"] == 21 + stats["data/skipped_records"]
    assert len(first_written(cfg)) == bad_records.SHOWN
    assert all(re.fullmatch(r"p\.jsonl\D+\d+: invalid JSON", line) for line in first_written(cfg)), first_written(cfg)
    state = json.loads(json.dumps(it.get_state()))
    resumed = prompts.make_prompts(cfg, "train", 64)
    resumed.set_state(state)
    assert resumed.stats() == stats and resumed.get_state() == state
    with pytest.raises(ConfigError) as e:
        resumed.next_prompts(2 * bad_records.MIN_RECORDS)
    message = str(e.value)
    assert message.startswith(f"dataset_path={path}: ") and "above max_bad_record_fraction=0.05" in message
    assert "p.jsonl" in message and "invalid JSON" in message and "\n" not in message
    assert resumed.stats()["data/records_read"] >= bad_records.MIN_RECORDS


def test_prompts_under_the_bound_go_on(tmp_path):
    cfg = prompts_cfg(tmp_path, write_prompts(tmp_path / "p.jsonl", 30), "max_bad_record_fraction=0.5")
    it = prompts.make_prompts(cfg, "train", 64)
    it.next_prompts(2 * bad_records.MIN_RECORDS)
    stats = it.stats()
    assert abs(stats["data/skipped_records"] / stats["data/records_read"] - 1 / 3) < 0.01, stats


# --------------------------------------------------------------------------------------------- the console


def test_the_console_reports_skipped_records_where_the_count_grew(tmp_path, capsys):
    cfg = tiny_config("steps=5", "log_period=1", f"base_output_directory={tmp_path}")
    os.makedirs(cfg.run_dir, exist_ok=True)
    bad_records.write_examples(os.path.join(cfg.run_dir, bad_records.EXAMPLES_FILE),
                               ["a.jsonl:3: invalid JSON", "a.jsonl:6: missing field"])
    log = console.StepLogger(cfg, MetricsWriter(cfg.run_dir, cfg.tensorboard_dir, is_primary=False))
    for step, (skipped, read) in enumerate([(0, 10), (2, 30), (2, 50), (5, 70), (5, 90)]):
        log(StepValues(step, {"loss": 1.0, "data/skipped_records": skipped, "data/records_read": read}, float(step)))
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped records")]
    assert shown == [
        "skipped records: 2 of 30 read (6.7%; the run stops above max_bad_record_fraction=0.01 from 1,000 read); "
        "first: a.jsonl:3: invalid JSON; a.jsonl:6: missing field",
        "skipped records: 5 of 70 read (7.1%; the run stops above max_bad_record_fraction=0.01 from 1,000 read); "
        "first: a.jsonl:3: invalid JSON; a.jsonl:6: missing field",
    ]
    assert console.format_skipped(3, None, [], 0.01) == "skipped records: 3"  # a reader that counts no reads
