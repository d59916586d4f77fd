"""The token store (`dataset_type: store`): written by tools/prepare_data.py --store, read by global row number.

The multi-process test is the acceptance of "tokenize once, read only your rows": 4 processes x 2 CPU devices on
loopback each build exactly a quarter of every global batch (their read counters), the batches equal one process's
with 8 devices bit for bit, and a resume on 2 processes x 4 devices from the 4 processes' saved state goes on with
the same rows.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxshard import config
from maxshard.data import make_input, store
from maxshard.data.tokenizer import ByteTokenizer
from maxshard.errors import ConfigError
from maxshard.parallel import mesh as mesh_lib
from maxshard.run import loading
from test_data import load_tool
from tests.helpers import finished, process_env

REPO = Path(__file__).resolve().parent.parent
BATCH, LENGTH, CHUNK = 16, 64, 8  # global rows (8 devices x 2), tokens a row, ids a store record
KEYS = ["dataset_type=store", f"max_target_length={LENGTH}", "per_device_batch_size=2", "grain_prefetch=1",
        "emb_dim=32", "num_layers=1", "num_heads=2", "num_kv_heads=2", "head_dim=16", "mlp_dim=64",
        "eval_fraction=0.1", "distributed_timeout=120", "remat_policy=full", "loss_chunks=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[bytes]]:
    """60 text files of 1 to 300 printable characters (a few longer than a row, most shorter): directory, texts."""
    rng = np.random.default_rng(7)
    root = tmp_path_factory.mktemp("corpus")
    texts = [bytes(rng.integers(32, 127, int(n)).astype(np.uint8)) for n in rng.integers(1, 300, 60)]
    for i, text in enumerate(texts):
        (root / f"doc{i:03d}.txt").write_bytes(text)
    return root, texts


@pytest.fixture(scope="module")
def store_dir(corpus, tmp_path_factory) -> Path:
    """The store as users write it: 3 shards of records of CHUNK ids shared by 2 hosts at once, the first (the CLI)
    writing its shards 0 and 2 with 2 worker processes, the second (this process) its shard 1 itself."""
    out = tmp_path_factory.mktemp("store")
    args = [str(out), "--store", "--dataset_path", str(corpus[0]), "--shards", "3", "--chunk_tokens", str(CHUNK),
            "--process_count", "2"]
    first = subprocess.Popen([sys.executable, "tools/prepare_data.py", *args, "--process_index", "0", "--workers", "2"],
                             cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert load_tool("prepare_data").main([*args, "--process_index", "1", "--workers", "1"]) == 0
        stdout, stderr = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr
    last = stderr.splitlines()[-1]  # the progress line's final state (earlier ones end in \r)
    assert re.fullmatch(r"\[prepare_data\] 40/40 documents, [\d,]+ tokens, [\d,]+ tokens/s", last), stderr
    assert "wrote 40 documents" in stdout  # shards 0 and 2 of 60 documents
    return out


def test_rows_are_the_documents_cut_in_order(corpus, store_dir):
    """Sequence j holds pair-stream positions [j L, (j + 1) L) of all documents in store (= corpus) order."""
    tok = ByteTokenizer()
    rows = store.StoreRows.of_split(store.open_store(str(store_dir), tok.fingerprint()), "train", 0.0, LENGTH)
    fulls = [np.concatenate([[tok.bos_id], tok.encode_array(t.decode()), [tok.eos_id]]) for t in corpus[1]]
    inputs = np.concatenate([f[:-1] for f in fulls])
    targets = np.concatenate([f[1:] for f in fulls])
    assert rows.sequences == len(inputs) // LENGTH
    built = [rows(j) for j in range(rows.sequences)]
    n = rows.sequences * LENGTH
    np.testing.assert_array_equal(np.concatenate([r["inputs"] for r in built]), inputs[:n])
    np.testing.assert_array_equal(np.concatenate([r["targets"] for r in built]), targets[:n])
    # segments number the pieces of a row from 1; positions restart at each piece, also for a cut document's rest
    doc = np.repeat(np.arange(len(fulls)), [len(f) - 1 for f in fulls])[:n].reshape(-1, LENGTH)
    for r, d in zip(built, doc):
        np.testing.assert_array_equal(r["segment_ids"], d - d[0] + 1)
        starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
        np.testing.assert_array_equal(r["positions"], np.arange(LENGTH) - starts[np.searchsorted(starts, np.arange(
            LENGTH), side="right") - 1])
        assert r["loss_weights"].min() == 1.0 and int(r["_read"]) <= LENGTH + 2 * CHUNK + len(starts) * CHUNK


def _workers(env: dict[str, str], tmp_path: Path, name: str, processes: int, steps: int, keys: list[str],
             state: Path | None = None) -> list[Path]:
    from test_distributed import free_ports

    port = free_ports()[0]
    env = process_env(env)
    outs = [tmp_path / f"{name}{i}" for i in range(processes)]
    procs = [subprocess.Popen(
        [sys.executable, "tests/store_worker.py", str(out), str(steps), *([str(state)] if state else []), *keys,
         f"cpu_device_count={8 // processes}", f"coordinator_address=127.0.0.1:{port}",
         f"process_count={processes}", f"process_id={i}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i, out in enumerate(outs)]
    finished(procs, timeout=180)
    return outs


@pytest.mark.slow
def test_four_processes_read_a_quarter_each_equal_one_process_and_two_resume_exactly(env, tmp_path, store_dir):
    keys = [*KEYS, f"dataset_path={store_dir}"]
    cfg = loading.load_run(["configs/base.yml", *keys], check_fit=False)  # this process: 8 devices
    assert cfg.global_batch_size == BATCH
    single = make_input(cfg, mesh_lib.build(cfg))
    reference = [{k: np.asarray(v) for k, v in next(single).items()} for _ in range(5)]
    single.close()

    four = _workers(env, tmp_path, "four", 4, 3, keys)
    states = [json.loads(out.with_suffix(".json").read_text()) for out in four]
    assert all(s == states[0] for s in states) and states[0]["row"] == 3 * BATCH  # one global position
    two = _workers(env, tmp_path, "two", 2, 2, keys, state=four[0].with_suffix(".json"))

    for outs, steps, first in ((four, 3, 0), (two, 2, 3)):
        got = [np.load(out.with_suffix(".npz")) for out in outs]
        for step in range(steps):
            held = np.concatenate([g[f"{step}/rows"] for g in got])
            assert sorted(held) == list(range(BATCH))  # the processes' rows are disjoint and cover the batch
            for g in got:
                rows, tokens, store_tokens = g[f"{step}/reads"]
                assert (rows, tokens) == (BATCH // len(outs), BATCH * LENGTH // len(outs))  # 1/P of the batch
                assert store_tokens < 1.5 * tokens  # ids read from the store: its rows and the chunks' ends
                for field, want in reference[first + step].items():
                    np.testing.assert_array_equal(g[f"{step}/{field}"], want[g[f"{step}/rows"]])


def test_store_config_errors_are_one_line_naming_the_key(store_dir, tmp_path):
    mesh = mesh_lib.build(config.load(["configs/base.yml", "per_device_batch_size=1"]))

    def first_error(*keys: str) -> str:
        with pytest.raises(ConfigError) as e:
            make_input(config.load(["configs/base.yml", "per_device_batch_size=1", *keys]), mesh)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert first_error("dataset_type=store", f"dataset_path={tmp_path}").startswith(
        f"dataset_path={tmp_path}: no token store here")
    assert first_error("dataset_type=store", f"dataset_path={store_dir}", "packing=false").startswith("packing=false")
    assert first_error("dataset_type=store").startswith("dataset_path is empty; dataset_type=store reads")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in store_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "data-00001-of-00003.json").unlink()
    assert "data-00001-of-00003 is incomplete" in first_error("dataset_type=store", f"dataset_path={broken}")
    state = {"identity": {"format": 3}, "grain": {}}
    it = make_input(config.load(["configs/base.yml", "per_device_batch_size=1", "dataset_type=store",
                                 f"dataset_path={store_dir}", "max_target_length=32"]), mesh)
    with pytest.raises(ConfigError, match="saved by a different input pipeline"):
        it.set_state(state)  # a document pipeline's state is another stream
    it.close()


def test_without_a_store_several_processes_are_told_of_the_repeated_work(monkeypatch, capsys):
    from maxshard.data import pipeline

    monkeypatch.setattr(pipeline.jax, "process_count", lambda: 4)
    cfg = config.load(["configs/base.yml", "per_device_batch_size=1", "max_target_length=32"])
    make_input(cfg, mesh_lib.build(cfg)).close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert lines == ["note: each of the 4 processes reads and tokenizes the whole global batch (4x the input work); "
                     "a token store reads only each process's rows (tools/prepare_data.py --store, dataset_type=store)"]
