"""The real-data input pipeline: packing, determinism, resume, process sharding, tokenizers, bad input, tools."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
from pathlib import Path

import grain
import jax
import numpy as np
import pytest

from maxshard import config
from maxshard.data import batch_sharding, make_input, packing, pipeline, sources
from maxshard.data.tokenizer import ByteTokenizer, load_sentencepiece, make_tokenizer, resolve_vocab
from maxshard.errors import ConfigError
from maxshard.parallel import mesh as mesh_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "configs", "base.yml")
BOS, EOS = 1, 2


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_cfg(*overrides: str) -> config.Config:
    """base.yml with 8-row batches of 32 tokens, then `key=value` overrides (later ones win)."""
    values = {"per_device_batch_size": "1", "max_target_length": "32"}
    values.update(o.split("=", 1) for o in overrides)
    return config.load([BASE, *(f"{k}={v}" for k, v in values.items())])


def take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(n)]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in packing.FIELDS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> str:
    """40 small text documents of different lengths (some longer than a row), each with its own words."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        sub = root / f"part{i % 3}"
        sub.mkdir(exist_ok=True)
        words = " ".join(f"doc{i}w{j}" for j in range(1 + (i * 7) % 23))
        (sub / f"doc{i:02d}.txt").write_text(f"# document {i}\n{words}\n", encoding="utf-8")
    return str(root)


# --------------------------------------------------------------------------------------------- packing


def pack_rows(docs: list[list[int]], length: int) -> list[dict[str, np.ndarray]]:
    ds = grain.MapDataset.source([np.asarray(d, np.int32) for d in docs])
    pairs = ds.map(lambda t: packing.document_pair(t, BOS, EOS)).to_iter_dataset()
    return list(packing.pack(pairs, length))


def test_packing_worked_example():
    """The module docstring's example: A = a1 a2 a3, B = b1, C = c1 c2 c3 c4, length 6."""
    rows = pack_rows([[11, 12, 13], [21], [31, 32, 33, 34]], 6)
    assert len(rows) == 2
    np.testing.assert_array_equal(rows[0]["inputs"], [BOS, 11, 12, 13, BOS, 21])
    np.testing.assert_array_equal(rows[0]["targets"], [11, 12, 13, EOS, 21, EOS])
    np.testing.assert_array_equal(rows[0]["segment_ids"], [1, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(rows[0]["positions"], [0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(rows[1]["inputs"], [BOS, 31, 32, 33, 34, 0])
    np.testing.assert_array_equal(rows[1]["targets"], [31, 32, 33, 34, EOS, 0])
    np.testing.assert_array_equal(rows[1]["segment_ids"], [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(rows[1]["positions"], [0, 1, 2, 3, 4, 0])
    np.testing.assert_array_equal(rows[1]["loss_weights"], [1, 1, 1, 1, 1, 0])
    assert rows[0]["loss_weights"].dtype == np.float32 and rows[0]["inputs"].dtype == np.int32


def test_packing_keeps_every_target_inside_its_document():
    """Random documents: the weighted (input, target) pairs are exactly each document's own next-token pairs."""
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(3, 200, size=n)) for n in rng.integers(0, 30, size=25)]
    rows = pack_rows(docs, 16)
    got = []
    for row in rows:
        assert all(len(row[k]) == 16 for k in packing.FIELDS)
        np.testing.assert_array_equal(row["loss_weights"], row["segment_ids"] > 0)
        for seg in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
            where = np.flatnonzero(row["segment_ids"] == seg)
            assert np.array_equal(where, np.arange(where[0], where[-1] + 1)), "a segment is contiguous"
            np.testing.assert_array_equal(row["positions"][where], np.arange(len(where)))
            got += list(zip(row["inputs"][where], row["targets"][where]))
    expected = []
    for d in docs:
        full = [BOS, *d, EOS]
        expected += list(zip(full[:-1], full[1:]))
    assert [(int(a), int(b)) for a, b in got] == [(int(a), int(b)) for a, b in expected]


def test_no_packing_truncates_and_pads():
    pair = packing.document_pair(np.array([5, 6, 7]), BOS, EOS)
    short = packing.pad_to_length(pair, 6)
    np.testing.assert_array_equal(short["inputs"], [BOS, 5, 6, 7, 0, 0])
    np.testing.assert_array_equal(short["targets"], [5, 6, 7, EOS, 0, 0])
    np.testing.assert_array_equal(short["segment_ids"], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(short["positions"], [0, 1, 2, 3, 0, 0])
    np.testing.assert_array_equal(short["loss_weights"], [1, 1, 1, 1, 0, 0])
    cut = packing.pad_to_length(pair, 2)
    np.testing.assert_array_equal(cut["inputs"], [BOS, 5])
    np.testing.assert_array_equal(cut["targets"], [5, 6])  # the target of the last kept token is still real


# --------------------------------------------------------------------------------------------- determinism, resume


def test_same_seed_same_batches_other_seed_other_batches(corpus_dir):
    cfg = make_cfg(f"dataset_path={corpus_dir}")
    mesh = mesh_lib.build(cfg)
    first = take(make_input(cfg, mesh), 4)
    assert_same(first, take(make_input(cfg, mesh), 4))
    other = take(make_input(make_cfg(f"dataset_path={corpus_dir}", "data_shuffle_seed=7"), mesh), 4)
    assert any(not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other))


@pytest.mark.parametrize("packed", [True, False])
def test_resume_mid_epoch_and_across_epochs(corpus_dir, packed):
    cfg = make_cfg(f"dataset_path={corpus_dir}", f"packing={str(packed).lower()}")
    mesh = mesh_lib.build(cfg)
    it = make_input(cfg, mesh)
    states, batches = [], []
    for _ in range(12):  # ~39 train documents: unpacked (8 rows a batch) epoch 2 starts in batch 5
        states.append(json.loads(json.dumps(it.get_state())))
        batches.append(take(it, 1)[0])
    for k in (3, 7):
        resumed = make_input(cfg, mesh)
        resumed.set_state(states[k])
        assert_same(take(resumed, 12 - k), batches[k:])


def test_state_from_another_pipeline_is_refused(corpus_dir):
    mesh = mesh_lib.build(make_cfg())
    state = make_input(make_cfg(f"dataset_path={corpus_dir}"), mesh).get_state()
    other = make_input(make_cfg(f"dataset_path={corpus_dir}", "max_target_length=16"), mesh)
    with pytest.raises(ConfigError, match="length: 32 -> 16"):
        other.set_state(state)


def test_state_of_one_process_before_the_global_stream_still_restores(corpus_dir):
    """A format-2 state of a single process is the global stream's position (the same rows, batched alike); one of
    several processes was a stream of its own and stays refused."""
    cfg = make_cfg(f"dataset_path={corpus_dir}")
    mesh = mesh_lib.build(cfg)
    it = make_input(cfg, mesh)
    take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    identity = {**state["identity"], "format": 2, "local_batch": cfg.global_batch_size}
    resumed = make_input(cfg, mesh)
    resumed.set_state({**state, "identity": {**identity, "process": "0/1"}})
    assert_same(take(resumed, 2), take(it, 2))
    with pytest.raises(ConfigError, match="different input pipeline"):
        make_input(cfg, mesh).set_state({**state, "identity": {**identity, "process": "0/2"}})


def test_eval_split_is_fixed_and_disjoint_from_train(corpus_dir):
    corpus = sources.text_corpus(corpus_dir)
    train = sources.split_indices(corpus.keys, "train", 0.2)
    evals = sources.split_indices(corpus.keys, "eval", 0.2)
    assert len(evals) > 0 and set(train).isdisjoint(evals) and set(train) | set(evals) == set(range(40))
    # names, not listing order, decide: a corpus without document 0 keeps every other document on its side
    names = [os.path.relpath(p, corpus_dir) for p in corpus.documents.paths]
    fewer = sources.split_indices(sources.name_keys(names[1:]), "eval", 0.2)
    assert {names[1:][i] for i in fewer} == {names[i] for i in evals} - {names[0]}
    cfg = make_cfg(f"dataset_path={corpus_dir}", "eval_fraction=0.2")
    mesh = mesh_lib.build(cfg)
    assert_same(take(make_input(cfg, mesh, "eval"), 2), take(make_input(cfg, mesh, "eval"), 2))


# --------------------------------------------------------------------------------------------- process sharding


# --------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n\treturn 'ünï✓ 漢字'\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_array(text).tolist() == tok.encode(text)
    assert min(tok.encode(text)) >= 3 and tok.vocab_size == 259


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, corpus_dir) -> str:
    pytest.importorskip("sentencepiece")
    path = str(tmp_path_factory.mktemp("tok") / "tiny.model")
    train_tokenizer = load_tool("train_tokenizer")
    train_tokenizer.train(train_tokenizer.train_lines(corpus_dir, 0.02), path, vocab_size=300)
    return path


def test_sentencepiece_round_trip_and_vocab(sp_model):
    tok = load_sentencepiece(sp_model)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "doc3w1 doc3w2\n    indented\tand ünseen ✓\n\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.encode_array(text).tolist() == ids
    assert pickle.loads(pickle.dumps(tok)).encode(text) == ids  # grain workers get a copy
    cfg = make_cfg(f"tokenizer_path={sp_model}", "vocab_size_multiple=128")
    assert make_tokenizer(cfg).vocab_size == tok.vocab_size
    assert resolve_vocab(cfg).vocab_size == -(-tok.vocab_size // 128) * 128
    with pytest.raises(ConfigError, match="vocab_size=256 is smaller"):
        resolve_vocab(make_cfg(f"tokenizer_path={sp_model}", "vocab_size=256"))


# --------------------------------------------------------------------------------------------- bad input


def first_batch(*overrides: str, split: str = "train") -> None:
    cfg = make_cfg(*overrides)
    next(make_input(cfg, mesh_lib.build(cfg), split))


def test_bad_inputs_name_path_and_key(tmp_path, corpus_dir):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=re.escape(f"dataset_path={missing}: no such file")):
        first_batch(f"dataset_path={missing}")
    with pytest.raises(ConfigError, match=r"dataset_path=.*\*\.md matches no files"):
        first_batch(f"dataset_path={tmp_path}/*.md")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty.* matches no files"):
        first_batch(f"dataset_path={tmp_path / 'empty'}")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "a.bin").write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match=r"dataset_path: .*a\.bin is not a text file"):
        first_batch(f"dataset_path={tmp_path / 'bin'}")
    (tmp_path / "late").mkdir()  # the first 4 KiB are text: found at read time, still one ConfigError
    (tmp_path / "late" / "b.txt").write_bytes(b"x" * 5000 + b"\xff\xfe")
    with pytest.raises(ConfigError, match=r"dataset_path: .*b\.txt is not UTF-8 text"):
        first_batch(f"dataset_path={tmp_path / 'late'}", "eval_fraction=0")
    with pytest.raises(ConfigError, match="eval split is empty.*eval_fraction=0.0"):
        first_batch(f"dataset_path={corpus_dir}", "eval_fraction=0", split="eval")
    with pytest.raises(ConfigError, match="eval_fraction must be in"):
        first_batch(f"dataset_path={corpus_dir}", "eval_fraction=1.5")


def test_bad_array_record_and_tokenizer_paths(tmp_path):
    (tmp_path / "x.arecord").write_text("not an array record\n")
    with pytest.raises(ConfigError, match=r"dataset_path: .*x\.arecord is not an ArrayRecord file"):
        first_batch("dataset_type=array_record", f"dataset_path={tmp_path}/*.arecord")
    with pytest.raises(ConfigError, match=re.escape(f"dataset_path={tmp_path}/none: no such file")):
        first_batch("dataset_type=array_record", f"dataset_path={tmp_path}/none")
    with pytest.raises(ConfigError, match="dataset_path is empty"):
        first_batch("dataset_type=array_record")
    with pytest.raises(ConfigError, match=re.escape(f"tokenizer_path={tmp_path}/none.model: no such file")):
        make_tokenizer(make_cfg(f"tokenizer_path={tmp_path}/none.model"))
    pytest.importorskip("sentencepiece")
    with pytest.raises(ConfigError, match=r"tokenizer_path=.*x\.arecord is not a SentencePiece model"):
        make_tokenizer(make_cfg(f"tokenizer_path={tmp_path}/x.arecord"))


# --------------------------------------------------------------------------------------------- real corpora


def test_default_corpus_yields_global_batches_in_batch_sharding():
    cfg = make_cfg()
    assert cfg.dataset_type == "text" and cfg.dataset_path == "" and cfg.packing
    mesh = mesh_lib.build(cfg)
    batch = next(make_input(cfg, mesh))
    expected = batch_sharding(cfg, mesh)
    for name, array in batch.items():
        assert isinstance(array, jax.Array) and array.shape == (cfg.global_batch_size, 32), name
        assert array.sharding.is_equivalent_to(expected, 2), name
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    segments = np.asarray(batch["segment_ids"])
    same = segments[:, 1:] == segments[:, :-1]
    np.testing.assert_array_equal(targets[:, :-1][same], inputs[:, 1:][same])
    files = [Path(p).read_bytes() for p in sources.default_corpus().documents.paths]
    for seg in set(segments[0][segments[0] > 0].tolist()):
        piece = bytes(t - 3 for t in inputs[0][segments[0] == seg].tolist() if t >= 3)  # byte ids, BOS dropped
        assert any(piece in f for f in files), piece


def test_array_record_round_trip_through_prepare_data(tmp_path, corpus_dir, capsys):
    prepare_data = load_tool("prepare_data")
    out = tmp_path / "shards"
    assert prepare_data.main([str(out), "--dataset_path", corpus_dir, "--shards", "3"]) == 0
    assert "40/40 documents" in capsys.readouterr().err  # the progress line
    assert sorted(os.listdir(out)) == [f"data-0000{i}-of-00003.arecord" for i in range(3)] + ["maxshard_data.json"]
    text_cfg = make_cfg(f"dataset_path={corpus_dir}", "packing=false", "eval_fraction=0")
    record_cfg = make_cfg("dataset_type=array_record", f"dataset_path={out}", "packing=false", "eval_fraction=0")
    mesh = mesh_lib.build(text_cfg)
    rows_of = lambda cfg: {tuple(r) for b in take(make_input(cfg, mesh), 5) for r in b["inputs"].tolist()}
    corpus_rows = set()  # one epoch of 40 documents = 5 batches of 8 rows, each row one (distinct) document
    for path in sources.text_corpus(corpus_dir).documents.paths:
        pair = packing.document_pair(ByteTokenizer().encode_array(sources.read_text(path)), BOS, EOS)
        corpus_rows.add(tuple(packing.pad_to_length(pair, 32)["inputs"].tolist()))
    assert len(corpus_rows) == 40
    assert rows_of(record_cfg) == corpus_rows == rows_of(text_cfg)
    assert prepare_data.main([str(tmp_path / "text"), "--dataset_path", corpus_dir, "--text"]) == 0
    text_records = make_cfg("dataset_type=array_record", f"dataset_path={tmp_path}/text/*.arecord", "packing=false",
                            "eval_fraction=0")
    assert rows_of(text_records) == rows_of(record_cfg)


def test_worker_processes_yield_resumable_batches(corpus_dir):
    cfg = make_cfg(f"dataset_path={corpus_dir}", "grain_worker_count=1")
    mesh = mesh_lib.build(cfg)
    it = make_input(cfg, mesh)
    try:
        take(it, 2)
        state = json.loads(json.dumps(it.get_state()))
        expected = take(it, 3)
    finally:
        it.close()
    resumed = make_input(cfg, mesh)
    try:
        resumed.set_state(state)
        assert_same(take(resumed, 3), expected)
    finally:
        resumed.close()
