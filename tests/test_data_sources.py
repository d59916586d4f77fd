"""Real corpora: JSONL (.gz/.zst), Parquet and Hugging Face sources (also streamed), token-weighted mixtures, bad
records.

Every file is generated here, in tmp directories. Each document starts with its own tag ("a17 ..."), so rows can be
traced back to the document they came from.
"""

from __future__ import annotations

import gzip
import json
import os
import re

import numpy as np
import pytest

from maxshard import config
from maxshard.data import catalog, hf, jsonl, make_input, pipeline, shuffle
from maxshard.data.mixture import SKIPPED, SOURCE
from maxshard.data.sources import BadRecord
from maxshard.data.tokenizer import ByteTokenizer
from maxshard.errors import ConfigError
from maxshard.parallel import mesh as mesh_lib
from tests.test_data import BASE, assert_same, load_tool, take

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")


def make_cfg(*overrides: str) -> config.Config:
    values = {"per_device_batch_size": "1", "max_target_length": "32"}
    values.update(o.split("=", 1) for o in overrides)
    return config.load([BASE, *(f"{k}={v}" for k, v in values.items())])


def documents(prefix: str, count: int, words: tuple[int, int] = (1, 12), seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"{prefix}{i} " + " ".join(f"w{j}ü" for j in range(rng.integers(*words))) for i in range(count)]


def write_jsonl(path, texts: list[str], extra_lines: tuple[bytes, ...] = ()) -> str:
    data = b"".join(json.dumps({"id": i, "text": t}).encode() + b"\n" for i, t in enumerate(texts))
    data += b"".join(extra_lines)
    path = str(path)
    if path.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    elif path.endswith(".gz"):
        data = gzip.compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return path


def write_parquet(path, texts: list, row_group_size: int = 16, column_type=None) -> str:
    table = pa.table({"text": pa.array(texts, type=column_type or pa.string()), "id": list(range(len(texts)))})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """The same 60 documents as JSONL, JSONL.gz, JSONL.zst (two files each), Parquet (two files) and a saved HF set."""
    root = tmp_path_factory.mktemp("corpora")
    texts = documents("d", 60)
    halves = (texts[:30], texts[30:])
    paths = {}
    for suffix in ("jsonl", "jsonl.gz", "jsonl.zst", "parquet"):
        directory = root / suffix.replace(".", "_")
        directory.mkdir()
        for i, half in enumerate(halves):
            target = directory / f"part{i}.{suffix}"
            write_parquet(target, half, 8) if suffix == "parquet" else write_jsonl(target, half)
        paths[suffix] = str(directory)
    datasets = pytest.importorskip("datasets")
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts}),
                                  "test": datasets.Dataset.from_dict({"text": texts[:5]})})
    saved.save_to_disk(str(root / "hf"))
    paths["hf"] = str(root / "hf")
    paths["texts"] = texts
    return paths


def type_overrides(kind: str, corpora: dict) -> tuple[str, ...]:
    if kind == "mixture":
        mix = f"[[{corpora['parquet']}/*.parquet, 0.6], [{corpora['jsonl.zst']}/*.jsonl.zst, 0.4]]"
        return (f"dataset_mixture={mix}",)
    dataset_type = "jsonl" if kind.startswith("jsonl") else kind
    return f"dataset_type={dataset_type}", f"dataset_path={corpora[kind]}"


def open_first(cfg: config.Config):
    """The corpus of the config's (first) source, as make_input opens it."""
    return catalog.open_corpus(catalog.source_specs(cfg)[0], ByteTokenizer().fingerprint(), cfg.text_field,
                               cfg.hf_split, cfg.data_cache_dir)


# --------------------------------------------------------------------------------------------- readers


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf"])
def test_every_reader_yields_the_same_documents(corpora, kind, tmp_path):
    cfg = make_cfg(*type_overrides(kind, corpora), f"data_cache_dir={tmp_path}")
    corpus = open_first(cfg)
    assert [corpus.documents[i] for i in range(len(corpus))] == corpora["texts"]
    assert corpus.keys.dtype == np.uint64 and len(set(corpus.keys.tolist())) == 60
    if kind == "parquet":  # two files of 30 rows in row groups of 8: 4 + 4 groups
        assert corpus.blocks.tolist() == [i // 8 for i in range(30)] + [4 + i // 8 for i in range(30)]
    if kind.endswith((".gz", ".zst")):  # decompressed once into the cache, then read from there
        assert sorted(os.listdir(tmp_path)) == sorted(f for f in os.listdir(tmp_path) if f.endswith(".jsonl"))
        assert len(os.listdir(tmp_path)) == 2


def test_bad_jsonl_records_are_named_by_kind():
    cases = {
        b"\n": "empty line", b"{nope\n": "invalid JSON", b"[1, 2]\n": "not an object",
        b'{"body": "x"}\n': "missing field", b'{"text": 3}\n': "not a string", b'{"text": ""}\n': "empty text",
        b'{"text": "caf\xe9"}\n': "invalid UTF-8",
    }
    for line, reason in cases.items():
        got = jsonl.parse_record(line, "text", "f line 1")
        assert isinstance(got, BadRecord) and got.reason == reason, line
    assert jsonl.parse_record(b'{"text": "ok \\u00fc"}\r\n', "text", "") == "ok ü"


def test_jsonl_line_bounds_with_and_without_final_newline(tmp_path):
    (tmp_path / "a").write_bytes(b'{"text": "x"}\n\n{"text": "yz"}\n')
    (tmp_path / "b").write_bytes(b'{"text": "x"}\n{"text": "yz"}')
    assert jsonl.line_bounds(str(tmp_path / "a")).tolist() == [0, 14, 15, 30]
    assert jsonl.line_bounds(str(tmp_path / "b")).tolist() == [0, 14, 28]


# --------------------------------------------------------------------------------------------- determinism, resume


@pytest.mark.parametrize("kind", ["parquet", "jsonl.zst", "hf", "mixture"])
def test_same_seed_same_batches_and_resume_is_exact(corpora, kind, tmp_path):
    cfg = make_cfg(*type_overrides(kind, corpora), f"data_cache_dir={tmp_path}")
    mesh = mesh_lib.build(cfg)
    it = make_input(cfg, mesh)
    batches, states, stats = [], [], []
    for _ in range(8):  # ~57 train documents of ~40 tokens: 8 batches of 8 x 32 cross an epoch
        states.append(json.loads(json.dumps(it.get_state())))
        stats.append(it.stats())
        batches.append(take(it, 1)[0])
    assert_same(take(make_input(cfg, mesh), 8), batches)
    resumed = make_input(cfg, mesh)
    resumed.set_state(states[5])
    assert resumed.stats() == stats[5] and sum(stats[5].values()) > 0
    assert_same(take(resumed, 3), batches[5:])
    other = take(make_input(make_cfg(*type_overrides(kind, corpora), "data_shuffle_seed=9",
                                     f"data_cache_dir={tmp_path}"), mesh), 8)
    assert any(not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(batches, other))
    evals = make_cfg(*type_overrides(kind, corpora), "eval_fraction=0.2", f"data_cache_dir={tmp_path}")
    assert_same(take(make_input(evals, mesh, "eval"), 2), take(make_input(evals, mesh, "eval"), 2))


def row_tags(rows: np.ndarray) -> list[str]:
    """The tag ("d17") of the document each unpacked row holds."""
    return [bytes(t - 3 for t in row.tolist() if t >= 3).decode(errors="ignore").split(" ")[0] for row in rows]


@pytest.mark.parametrize("kind", ["parquet", "jsonl.zst"])
def test_one_epoch_reads_every_train_document_once(corpora, kind, tmp_path):
    """One epoch of the global stream (unpacked rows: one document each) reads the train split, each document once,
    block-shuffled or not."""
    cfg = make_cfg(*type_overrides(kind, corpora), f"data_cache_dir={tmp_path}", "eval_fraction=0.1")
    corpus = open_first(cfg)
    train = pipeline.split_documents(corpus, cfg, "train")
    blocks = None if corpus.blocks is None else corpus.blocks[train]
    stream = pipeline.SourceStream(corpus.documents, train, blocks=blocks)
    opts = pipeline.PipelineOptions(length=64, batch=1, packing=False, shuffle_seed=5, prefetch=0)
    it = iter(pipeline.mixed_batches([stream], ByteTokenizer(), opts))
    seen = row_tags(np.concatenate([next(it)["inputs"][:, 1:] for _ in range(len(train))]))
    assert len(set(seen)) == len(train) < len(corpus)


def test_block_shuffle_keeps_windows_of_blocks_together():
    indices = np.arange(100, 160)
    blocks = np.repeat(np.arange(6), 10)
    ds = shuffle.BlockShuffleMapDataset(indices, blocks, seed=1, window_blocks=2)
    first, second = ds.epoch_order(0), ds.epoch_order(1)
    assert sorted(first.tolist()) == indices.tolist() and not np.array_equal(first, second)
    for window in range(3):  # each run of 20 positions holds exactly two whole blocks
        chunk = first[window * 20:(window + 1) * 20]
        assert len(set(((chunk - 100) // 10).tolist())) == 2
    assert [ds[i] for i in range(60, 63)] == second[:3].tolist()  # index 60 = epoch 1
    assert np.array_equal(shuffle.BlockShuffleMapDataset(indices, blocks, seed=1).epoch_order(0), first)


# --------------------------------------------------------------------------------------------- mixtures


def test_mixture_token_shares_follow_weights_over_10k_documents(tmp_path):
    """Short documents (~45 tokens) at weight 0.7, long ones (~200) at 0.3: token shares match the weights; a
    per-document mix would have given the short source ~91% of the tokens' documents instead."""
    write_parquet(tmp_path / "short.parquet", documents("s", 4000, (3, 12), seed=1), row_group_size=500)
    write_jsonl(tmp_path / "long.jsonl.zst", documents("l", 1500, (30, 50), seed=2))
    mix = f"[[{tmp_path}/short.parquet, 0.7], [{tmp_path}/long.jsonl.zst, 0.3]]"
    cfg = make_cfg(f"dataset_mixture={mix}", "max_target_length=1024", "eval_fraction=0",
                   f"data_cache_dir={tmp_path / 'cache'}")
    it = make_input(cfg, mesh_lib.build(cfg))
    starts = 0
    while starts < 10_000:
        batch = take(it, 1)[0]
        starts += int(((batch["positions"] == 0) & (batch["segment_ids"] > 0)).sum())
    stats = it.stats()
    tokens = {k: v for k, v in stats.items() if k.startswith("data/tokens/")}
    names = list(tokens)  # in mixture order
    assert re.fullmatch(r"data/tokens/0_.*short\.parquet", names[0]), names
    assert re.fullmatch(r"data/tokens/1_.*long\.jsonl\.zst", names[1]), names
    shares = np.array(list(tokens.values())) / sum(tokens.values())
    assert abs(shares[0] - 0.7) < 0.02 and abs(shares[1] - 0.3) < 0.02, shares
    assert stats["data/skipped_records"] == 0
    assert sum(tokens.values()) == it.get_state()["stats"]["tokens"][0] + it.get_state()["stats"]["tokens"][1]


def test_mixture_spec_errors_name_the_key(tmp_path):
    def error(mixture: str) -> str:
        with pytest.raises(ConfigError) as info:
            make_cfg(f"dataset_mixture={mixture}")
        return str(info.value)

    assert "dataset_mixture must be a list" in error("a.parquet")
    assert "dataset_mixture[1] (b.jsonl): the weight must be a number > 0, got 0" in error(
        "[[a.parquet, 1], [b.jsonl, 0]]")
    assert "must be a number > 0, got -1" in error("[[a.parquet, -1]]")
    with pytest.raises(ConfigError, match=r"dataset_mixture\[0\]: cannot tell the type of '\S*data.csv'; use a path"):
        catalog.source_specs(make_cfg("dataset_mixture=[[data.csv, 1]]"))  # when the input is built, before compile
    with pytest.raises(ConfigError, match="dataset_path and dataset_mixture are both set"):
        make_cfg("dataset_mixture=[[a.parquet, 1]]", "dataset_path=x")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.parquet").write_bytes(b"")
    (tmp_path / "mixed" / "b.jsonl").write_bytes(b"")
    cfg = make_cfg(f"dataset_mixture=[[{tmp_path}/mixed, 1]]")
    with pytest.raises(ConfigError, match=r"dataset_mixture\[0\]: the directory .* must hold one type of file"):
        catalog.source_specs(cfg)
    assert [s.kind for s in catalog.source_specs(make_cfg("dataset_mixture=[[x/*.jsonl.zst, 2], [hf:d, 1]]"))] == [
        "jsonl", "hf"]


def test_dataset_types_is_the_one_list_of_readers():
    """The schema admits exactly the rows of dataset_types.py; each opener is a function of the data package, each
    key a config key; a mixture source's extension or prefix names the row that lists it; the path keeps no prefix."""
    import dataclasses
    import importlib
    import typing

    from maxshard import dataset_types

    assert typing.get_args(typing.get_type_hints(config.Config)["dataset_type"]) == dataset_types.NAMES
    fields = {f.name for f in dataclasses.fields(config.Config)}
    for row in dataset_types.READERS:
        assert set(row.keys) <= fields, row.name
        if row.opener:
            module, function = row.opener.split(":")
            assert callable(getattr(importlib.import_module(module), function)), row.name
        assert all(catalog.kind_of(f"x/*{suffix}") == row.name for suffix in row.suffixes)
        if row.prefix:
            assert catalog.kind_of(f"{row.prefix}:d") == row.name
    assert [s.path for s in catalog.source_specs(make_cfg("dataset_mixture=[[hf:owner/d, 1]]"))] == ["owner/d"]
    with pytest.raises(ConfigError, match="dataset_type='synthetic' has no document reader"):
        catalog.open_corpus(catalog.SourceSpec("synthetic", "", 1.0, "dataset_path", "x"), "")


# --------------------------------------------------------------------------------------------- bad input


BAD_LINES = (b"\n", b"{broken\n", b"[1]\n", b'{"body": "x"}\n', b'{"text": 7}\n', b'{"text": ""}\n',
             b'{"text": "\xff\xfe"}\n', b'{"text": "\\ud800"}\n')


def test_bad_records_are_skipped_and_counted_exactly(tmp_path):
    """Corpus order (no shuffle): after one epoch of rows every bad record has been counted, once."""
    good = documents("g", 10)
    path = write_jsonl(tmp_path / "bad.jsonl", good[:6], BAD_LINES)
    with open(path, "ab") as f:
        f.write(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in good[6:]))
    corpus = jsonl.jsonl_corpus(path, "text", str(tmp_path))
    assert len(corpus) == 10 + len(BAD_LINES)
    opts = pipeline.PipelineOptions(length=64, batch=1, packing=False, shuffle_seed=None, prefetch=0)
    it = iter(pipeline.mixed_batches([pipeline.SourceStream(corpus.documents, np.arange(len(corpus)))],
                                     ByteTokenizer(), opts))
    rows = [next(it) for _ in range(10)]
    assert row_tags(np.concatenate([r["inputs"][:, 1:] for r in rows])) == [f"g{i}" for i in range(10)]
    assert [int(r[SKIPPED].sum()) for r in rows] == [0] * 6 + [len(BAD_LINES)] + [0] * 3
    assert all((r[SOURCE] == 0).all() for r in rows)


def test_bad_records_in_a_run_show_in_stats(tmp_path):
    write_jsonl(tmp_path / "bad.jsonl", documents("g", 16), BAD_LINES)
    write_parquet(tmp_path / "bad.parquet", [b"ok one", b"\xff\xfe", None, b"", b"ok two"], column_type=pa.binary())
    mix = f"[[{tmp_path}/bad.jsonl, 1], [{tmp_path}/bad.parquet, 1]]"
    cfg = make_cfg(f"dataset_mixture={mix}", "eval_fraction=0", "packing=false")
    it = make_input(cfg, mesh_lib.build(cfg))
    tags = row_tags(np.concatenate([b["inputs"][:, 1:] for b in take(it, 5)]))
    stats = it.stats()
    parquet_rows = sum(t == "ok" for t in tags)  # 2 good rows an epoch: k rows pass at least k // 2 - 1 epochs
    assert parquet_rows >= 8 and stats["data/skipped_records"] >= 3 * (parquet_rows // 2 - 1), (tags, stats)
    assert all(v > 0 for k, v in stats.items() if k.startswith("data/tokens/"))


def test_a_source_of_only_bad_records_is_an_error_not_a_hang(tmp_path):
    write_jsonl(tmp_path / "all_bad.jsonl", [], (b'{"text": 1}\n',) * 5 + (b'{"body": "x"}\n',))
    cfg = make_cfg("dataset_type=jsonl", f"dataset_path={tmp_path}/all_bad.jsonl", "eval_fraction=0")
    with pytest.raises(ConfigError) as info:
        next(make_input(cfg, mesh_lib.build(cfg)))
    assert re.fullmatch(r"dataset_path=.*all_bad\.jsonl: every document of a whole epoch is a bad record \(e\.g\. "
                        r"all_bad\.jsonl:\d: (not a string|missing field)\); check text_field and the files",
                        str(info.value)), str(info.value)


def first_batch(*overrides: str) -> None:
    cfg = make_cfg(*overrides)
    next(make_input(cfg, mesh_lib.build(cfg)))


def test_bad_paths_and_fields_are_config_errors(corpora, tmp_path):
    with pytest.raises(ConfigError, match=f"dataset_path={tmp_path}/none.jsonl: no such file"):
        first_batch("dataset_type=jsonl", f"dataset_path={tmp_path}/none.jsonl")
    with pytest.raises(ConfigError, match=r"dataset_path=.*\*\.parquet matches no files"):
        first_batch("dataset_type=parquet", f"dataset_path={tmp_path}/*.parquet")
    with pytest.raises(ConfigError, match=r"dataset_mixture\[1\]=.*nope\.jsonl\.zst: no such file"):
        first_batch(f"dataset_mixture=[[{corpora['parquet']}, 1], [{tmp_path}/nope.jsonl.zst, 1]]")
    for kind in ("jsonl.zst", "parquet", "hf"):
        with pytest.raises(ConfigError, match=r"text_field=body: .*(no record|no file|no such column)"):
            first_batch(*type_overrides(kind, corpora), "text_field=body", f"data_cache_dir={tmp_path}")
    with pytest.raises(ConfigError, match="text_field=id: the column is int64"):
        first_batch("dataset_type=parquet", f"dataset_path={corpora['parquet']}", "text_field=id")
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"dataset_path: .*fake\.parquet is not a readable Parquet file"):
        first_batch("dataset_type=parquet", f"dataset_path={tmp_path}/fake.parquet")
    (tmp_path / "fake.jsonl.zst").write_bytes(b"not zstd")
    with pytest.raises(ConfigError, match=r"dataset_path: cannot read .*fake\.jsonl\.zst"):
        first_batch("dataset_type=jsonl", f"dataset_path={tmp_path}/fake.jsonl.zst", f"data_cache_dir={tmp_path}")
    with pytest.raises(ConfigError, match="hf_split=validation: .* has the splits train, test"):
        first_batch("dataset_type=hf", f"dataset_path={corpora['hf']}", "hf_split=validation")
    with pytest.raises(ConfigError, match="text_field must name a field"):
        make_cfg("text_field=")


def test_hf_split_and_data_files(corpora, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    cfg = make_cfg("dataset_type=hf", f"dataset_path={corpora['hf']}", "hf_split=test")
    corpus = open_first(cfg)
    assert [corpus.documents[i] for i in range(len(corpus))] == corpora["texts"][:5]
    files_cfg = make_cfg("dataset_type=hf", f"dataset_path={corpora['jsonl']}/part1.jsonl")
    corpus = open_first(files_cfg)
    assert [corpus.documents[i] for i in range(len(corpus))] == corpora["texts"][30:]


# --------------------------------------------------------------------------------------------- streamed HF datasets


def stream_overrides(kind: str, corpora: dict) -> tuple[str, ...]:
    """The same two JSONL or Parquet files as a streamed hf source (`load_dataset(builder, data_files=...,
    streaming=True)`: the code path of a hub name, offline), or such a stream mixed with a Parquet corpus."""
    if kind == "mixture":
        mix = f"[[{corpora['parquet']}, 0.5], [hf:{corpora['jsonl']}/*.jsonl, 0.5]]"
        return f"dataset_mixture={mix}", "hf_streaming=always"
    suffix = "jsonl" if kind == "jsonl" else "parquet"
    return "dataset_type=hf", f"dataset_path={corpora[suffix]}/*.{suffix}", "hf_streaming=always"


def stream_epoch(documents) -> list:
    """One epoch of a stream's documents: read until the iterator moves to epoch 1."""
    it, seen = iter(documents), []
    while True:
        document = next(it)
        if it.get_state()["epoch"] > 0:
            return seen
        seen.append(document)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "mixture"])
def test_streamed_hf_same_seed_same_batches_and_resume_is_exact(corpora, kind, monkeypatch):
    """Windows of 7 documents start inside files, so a restore needs `datasets`' own position (state_dict)."""
    from maxshard.data import hf_stream

    monkeypatch.setattr(hf_stream, "SHUFFLE_WINDOW", 7)
    cfg = make_cfg(*stream_overrides(kind, corpora), "eval_fraction=0.2")
    mesh = mesh_lib.build(cfg)
    for split in ("train", "eval"):
        it = make_input(cfg, mesh, split)
        batches, states, stats = [], [], []
        for _ in range(6):  # ~48 train documents of ~40 tokens: 6 batches of 8 x 32 reach the second epoch
            states.append(json.loads(json.dumps(it.get_state())))
            stats.append(it.stats())
            batches.append(take(it, 1)[0])
        assert '"shard_example_idx": ' in json.dumps(states[4]), "the state holds datasets' position"
        assert_same(take(make_input(cfg, mesh, split), 6), batches)
        resumed = make_input(cfg, mesh, split)
        resumed.set_state(states[4])
        assert resumed.stats() == stats[4] and sum(stats[4].values()) > 0
        assert_same(take(resumed, 2), batches[4:])
    other = take(make_input(make_cfg(*stream_overrides(kind, corpora), "eval_fraction=0.2", "data_shuffle_seed=9"),
                            mesh), 6)
    assert any(not np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(batches, other))


def test_streamed_hf_splits_and_processes_partition_the_documents(corpora):
    """Train and eval (by a hash of the text) and the shares of 2 processes (whole files), of 3 (every third
    document) and of 2 processes x 2 grain workers are disjoint and together hold every document once."""
    from maxshard.data import hf_stream

    stream = hf_stream.open_stream(f"{corpora['jsonl']}/*.jsonl", "train", "text")
    splits = {}
    for split in ("train", "eval"):
        for count in (1, 2, 3):
            shares = [stream_epoch(stream.documents(split, 0.2, p, count)) for p in range(count)]
            everything = [d for share in shares for d in share]
            assert len(everything) == len(set(everything)) and all(shares), (split, count)
            assert set(everything) == set(splits.setdefault(split, everything)), (split, count)
        workers = []  # 2 processes x 2 grain workers: 4 readers, every second document of each file
        for process, worker in np.ndindex(2, 2):
            workers.append(stream.documents(split, 0.2, process, 2))
            workers[-1].set_slice(slice(worker, None, 2))
        shares = [stream_epoch(w) for w in workers]
        assert sorted(d for share in shares for d in share) == sorted(splits[split]) and all(shares)
    assert sorted(splits["train"] + splits["eval"]) == sorted(corpora["texts"])
    assert 3 <= len(splits["eval"]) <= 24  # ~20% of 60
    train_only = stream_epoch(stream.documents("train", 0.0, 0, 1))
    assert train_only == corpora["texts"]  # no eval: stream order, nothing filtered


def test_streamed_hf_bad_records_are_skipped_and_counted(tmp_path):
    good = documents("g", 10)
    bad = (b'{"text": ""}\n', b'{"body": "x"}\n', b'{"text": null}\n')
    path = write_jsonl(tmp_path / "bad.jsonl", good[:6], bad)
    with open(path, "ab") as f:
        f.write(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in good[6:]))
    from maxshard.data import hf_stream

    documents_ = hf_stream.open_stream(path, "train", "text").documents("train", 0.0, 0, 1)
    opts = pipeline.PipelineOptions(length=64, batch=1, packing=False, shuffle_seed=None, prefetch=0)
    it = iter(pipeline.mixed_batches([pipeline.StreamedSource(documents_)], ByteTokenizer(), opts))
    rows = [next(it) for _ in range(10)]
    assert row_tags(np.concatenate([r["inputs"][:, 1:] for r in rows])) == [f"g{i}" for i in range(10)]
    assert [int(r[SKIPPED].sum()) for r in rows] == [0] * 6 + [3] + [0] * 3
    binary = write_parquet(tmp_path / "bad.parquet", [b"ok one", b"\xff\xfe", None, b"", b"ok two"],
                           column_type=pa.binary())
    reasons = [d.reason for d in stream_epoch(hf_stream.open_stream(binary, "train", "text").documents(
        "train", 0.0, 0, 1)) if isinstance(d, BadRecord)]
    assert reasons == ["invalid UTF-8", "missing field", "empty text"]


def test_streamed_hf_errors_are_one_line_naming_the_key(corpora, tmp_path):
    only_bad = ("dataset_type=hf", f"dataset_path={corpora['parquet']}/*.parquet", "hf_streaming=always",
                "text_field=id", "eval_fraction=0")
    with pytest.raises(ConfigError) as info:
        first_batch(*only_bad)
    assert re.fullmatch(r"dataset_path=\S+ \(train split, process 0 of 1\): a whole epoch \(60 records\) held no "
                        r"usable document; check text_field, eval_fraction and the data", str(info.value))
    with pytest.raises(ConfigError, match=r"^text_field=body: dataset_path=\S+ has no such column \(columns: id, text\)$"):
        first_batch(*stream_overrides("jsonl", corpora), "text_field=body")
    (tmp_path / "broken.jsonl").write_bytes(b'{"text": "fine"}\n{broken\n')
    with pytest.raises(ConfigError, match=r"^dataset_path=\S+broken.jsonl \(train split, process 0 of 1\): cannot "
                                          r"read record 1 of epoch 0 \(ArrowInvalid: JSON parse error"):
        first_batch("dataset_type=hf", f"dataset_path={tmp_path}/broken.jsonl", "hf_streaming=always")
    with pytest.raises(ConfigError, match="^hf_streaming expects one of 'auto', 'always', 'never', got 'yes'"):
        make_cfg("hf_streaming=yes")
    with pytest.raises(ConfigError, match=f"^dataset_path={tmp_path}/gone: no such file or directory, and not a hub"):
        first_batch("dataset_type=hf", f"dataset_path={tmp_path}/gone")


def test_hub_names_stream_by_default(corpora, monkeypatch):
    """A name that is no local path is a hub name: `hf_streaming=auto` calls load_dataset(NAME, split,
    streaming=True) (offline here: the call is answered with the local files' stream); local data stays map-style."""
    datasets = pytest.importorskip("datasets")
    assert [hf.source_kind(p) for p in ("owner/name", "wikitext", corpora["hf"], f"{corpora['jsonl']}/*.jsonl",
                                        corpora["jsonl"])] == ["hub", "hub", "saved", "files", "directory"]
    for not_hub in ("/no/such/dir", "./rel/x", "a/b/c", "gs://bucket/dir"):
        with pytest.raises(ConfigError, match="dataset_path="):
            hf.source_kind(not_hub)
    assert [hf.read_as_stream(p, m) for p, m in [("owner/name", "auto"), ("owner/name", "never"),
                                                 (corpora["hf"], "auto"), (corpora["hf"], "always")]] == [
        True, False, False, True]
    calls = []
    local = datasets.load_dataset

    def offline_hub(path, *args, **kwargs):
        calls.append((path, kwargs))
        return local("json", data_files=f"{corpora['jsonl']}/*.jsonl", split=kwargs["split"], streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", offline_hub)
    cfg = make_cfg("dataset_mixture=[[hf:someone/corpus, 1]]", "eval_fraction=0", "packing=false")
    tags = row_tags(take(make_input(cfg, mesh_lib.build(cfg)), 1)[0]["inputs"][:, 1:])
    assert calls == [("someone/corpus", {"split": "train", "streaming": True})]
    assert len(tags) == 8 and all(re.fullmatch(r"d\d+", t) for t in tags), tags


# --------------------------------------------------------------------------------------------- tools


def test_prepare_data_reads_jsonl_zst_and_parquet(corpora, tmp_path):
    prepare_data = load_tool("prepare_data")
    rows = {}
    for kind in ("jsonl.zst", "parquet"):
        out = tmp_path / kind.replace(".", "_")
        dataset_type = "jsonl" if kind.startswith("jsonl") else kind
        assert prepare_data.main([str(out), "--dataset_type", dataset_type, "--dataset_path", corpora[kind],
                                  "--shards", "2", "--data_cache_dir", str(tmp_path)]) == 0
        assert json.load(open(out / "maxshard_data.json"))["documents"] == 60
        cfg = make_cfg("dataset_type=array_record", f"dataset_path={out}", "packing=false", "eval_fraction=0",
                       "max_target_length=128")
        batches = take(make_input(cfg, mesh_lib.build(cfg)), 8)  # 64 rows: one epoch of 60 and 4 more
        rows[kind] = set(row_tags(np.concatenate([b["inputs"][:, 1:] for b in batches])))
    assert rows["jsonl.zst"] == rows["parquet"] == {f"d{i}" for i in range(60)}


def test_step_logger_records_the_input_counters_of_the_step(corpora, tmp_path):
    """train.py pushes the iterator's stats() with the step's device metrics, so the record of step k holds the
    counters as step k read them, though it is written a step late, after the next batch was read (GRPO's reward
    figures are such counters: the rollout of the step, not the next one)."""
    import jax.numpy as jnp

    from maxshard.observe import metrics
    from maxshard.observe.console import StepLogger
    from maxshard.run import loading

    cfg = make_cfg(*type_overrides("mixture", corpora), "log_period=1", f"data_cache_dir={tmp_path}")
    it = make_input(cfg, mesh_lib.build(cfg))
    writer = metrics.MetricsWriter(str(tmp_path), str(tmp_path), is_primary=True, enable_tensorboard=False)
    deferred, log = metrics.DeferredMetrics(), StepLogger(loading.complete(cfg), writer)
    read = []
    for step in range(3):
        take(it, 1)
        read.append(it.stats())
        log(deferred.push(step, {"loss": jnp.float32(1.0), **it.stats()}))
    writer.close()
    last = json.loads(open(tmp_path / metrics.METRICS_FILE).read().splitlines()[-1])
    assert last["step"] == 2 and {k: v for k, v in last.items() if k.startswith("data/")} == read[1] != it.stats()
    assert last["data/skipped_records"] == 0 and sum(v for k, v in read[1].items() if "tokens" in k) > 0
