"""Elastic restarts: a run resumed on fewer (or more) devices or processes trains as if it had never moved.

The runs go through the real entry point: the uninterrupted run on the 8 devices of this process
(`maxshard.train.main`) saves at step 3; a run holding only that checkpoint (as if it had stopped there) is resumed
by the same command on 4 devices to step 6 and on 2 devices to step 9 (subprocesses: a process's device count is
fixed once JAX starts). Their losses, read back from metrics.jsonl, must equal those of
the uninterrupted 8-device run within 1e-5 (float32: the devices sum in another order), for a text corpus and for a
mixture of two. The multi-process test does the same as an XPK restart on fewer slices sees it: the trainer's
arguments come from the launcher for 2 slices (2 processes x 4 devices), then 1 slice, then 2 again. A data-level
test reads the documents back out of the batches across three layouts and counts them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from maxshard import config, train
from maxshard.data import make_input, pipeline, sources
from maxshard.data.tokenizer import make_tokenizer
from maxshard.errors import ConfigError
from maxshard.launch import topologies, xpk
from maxshard.parallel import mesh
from maxshard.planning import fit
from maxshard.run import elastic, loading
from tests.helpers import finished, process_env
import cli_processes

REPO = Path(__file__).resolve().parent.parent
BASE = str(REPO / "configs" / "base.yml")
RUN = ("model_name=tiny", "learning_rate_schedule_steps=9", "eval_period=0", "log_period=1",
       "enable_tensorboard=false")


def _corpus(root: Path, name: str, count: int, max_words: int = 31) -> str:
    """`count` text documents of different lengths, each starting with its own tag."""
    folder = root / name
    folder.mkdir()
    for i in range(count):
        words = " ".join(f"{name}{i}w{j}" for j in range(1 + (i * 7) % max_words))
        (folder / f"{i:03d}.txt").write_text(f"{name}{i:03d} {words}\n", encoding="utf-8")
    return str(folder)


def _trainer(env: dict[str, str], args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "maxshard.train", BASE, *args]
    env = process_env(env)
    return cli_processes.popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def _losses(run_dir: Path) -> list[float]:
    records = _records(run_dir)
    assert sorted(records) == list(range(1, 10)), sorted(records)
    return [records[s]["loss"] for s in range(1, 10)]


def _stopped_at(straight: Path, run: Path, step: int) -> None:
    """`run` as if it had stopped after `step`: the uninterrupted run's checkpoint of that step (a periodic save,
    bit for bit what a run stopped there saves) and its metrics up to it."""
    shutil.copytree(straight / "checkpoints" / str(step), run / "checkpoints" / str(step))
    lines = (straight / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(line for line in lines if json.loads(line)["step"] <= step))


def _holds_half_the_rows(finalized: config.Config) -> int:
    """Device bytes that hold the 16 rows on 2 devices as 2 accumulated microbatches of 4 rows per device but not as
    one of 8: between the planned peaks (under the remat policy with the least memory for each)."""
    def least(accumulation: int) -> int:
        split = dataclasses.replace(finalized, per_device_batch_size=8, global_batch_size=16,
                                    gradient_accumulation_steps=accumulation)
        return min(fit.peaks_by_policy(loading.complete(split)).values())

    whole, halves = least(1), least(2)
    assert halves < whole
    usable = halves + 3 * (whole - halves) // 4  # room for the compiled peak of 2 microbatches above the plan's
    return int(usable / (1 - finalized.memory_headroom)) + 1


@pytest.fixture(scope="module")
def runs(env, tmp_path_factory):
    """For text and a mixture: the uninterrupted 8-device run ("straight-KIND") and the one stopped after 3 steps
    and resumed on 4 devices to step 6, then on 2 to step 9 ("KIND"). The outputs of the resumed commands.

    The mixture's 2 devices are given too little memory for 8 rows each (`device_memory_gb`), so that resume also
    takes the accumulation path."""
    base = tmp_path_factory.mktemp("elastic")
    web, code = _corpus(base, "web", 60), _corpus(base, "code", 30)
    data = {"text": f"dataset_path={web}", "mixture": f"dataset_mixture=[[{web}, 0.7], [{code}, 0.3]]"}
    args = {kind: [*RUN, source, f"base_output_directory={base}"] for kind, source in data.items()}
    for kind in data:
        straight = [BASE, *args[kind], "cpu_device_count=8", f"run_name=straight-{kind}", "steps=9"]
        assert train.main([*straight, "checkpoint_period=3"]) == 0
        _stopped_at(base / f"straight-{kind}", base / kind, 3)
    small = _holds_half_the_rows(config.load([BASE, *args["mixture"], "run_name=mixture"], num_devices=2))
    memory = {("text", 4): [], ("text", 2): [], ("mixture", 4): [], ("mixture", 2): [f"device_memory_gb={small / 1e9}"]}
    outputs = {}
    for devices, steps in ((4, 6), (2, 9)):  # both kinds side by side
        procs = [_trainer(env, [*args[kind], f"cpu_device_count={devices}", f"run_name={kind}", f"steps={steps}",
                                *memory[kind, devices]]) for kind in data]
        outputs.update(zip([(kind, devices) for kind in data], finished(procs)))
    return base, args, outputs


@pytest.mark.parametrize("kind, accumulation", [("text", 1), ("mixture", 2)])
def test_resumed_on_fewer_devices_logs_the_uninterrupted_losses(runs, kind, accumulation):
    base, _, outputs = runs
    assert "resuming step 3 on 4 devices (was 8): per-device batch 4, accumulation 1" in outputs[kind, 4]
    line = f"resuming step 6 on 2 devices (was 4): per-device batch 8, accumulation {accumulation}"
    assert line in outputs[kind, 2]
    assert re.search(r"mesh: fsdp=2 \(2 devices\)", outputs[kind, 2])  # the -1 knob filled for the new count
    np.testing.assert_allclose(_losses(base / kind), _losses(base / f"straight-{kind}"), rtol=0, atol=1e-5)
    # The data counters went on from the checkpoint: the same tokens per source as the uninterrupted run.
    resumed, straight = _records(base / kind)[9], _records(base / f"straight-{kind}")[9]
    tokens = {k: v for k, v in straight.items() if k.startswith("data/tokens/")}
    assert len(tokens) == (2 if kind == "mixture" else 1) and all(v > 0 for v in tokens.values())
    assert {k: resumed[k] for k in tokens} == tokens


def test_a_resume_that_would_change_the_global_batch_is_refused(runs, capsys):
    """The checkpoint (step 9, 2 devices, 16 rows) against other device counts and explicit batch keys."""
    base, args, _ = runs
    argv = [BASE, *args["text"], "run_name=text"]

    def load(*extra: str, devices: int = 4) -> config.Config:
        return loading.load_run([*argv, *extra], num_devices=devices, check_fit=False, resume=True)

    with pytest.raises(ConfigError, match=r"^checkpoint step 9 was trained on 2 devices in 1 process, this run has "
                                          r"4 devices in 1 process and elastic=false"):
        load("elastic=false")
    with pytest.raises(ConfigError, match=r"^per_device_batch_size=1 makes a global batch of 4, but checkpoint step "
                                          r"9 was trained with 16; .* elastic_allow_batch_change=true$"):
        load("per_device_batch_size=1")
    assert load("per_device_batch_size=4").gradient_accumulation_steps == 1  # the same 16 rows: no change
    changed = load("per_device_batch_size=1", "elastic_allow_batch_change=true")
    assert changed.global_batch_size == 4
    assert "global batch 4 (was 16, elastic_allow_batch_change)" in capsys.readouterr().out
    # Through the CLI: one line, exit 2, before anything compiles.
    assert train.main([*argv, "cpu_device_count=8", "steps=12", "per_device_batch_size=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["maxshard: error: per_device_batch_size=1 makes a global batch of 8, but checkpoint step 9 was "
                   "trained with 16; drop it (the batch is derived again) or set elastic_allow_batch_change=true"]


def test_accumulation_steps_grow_where_the_devices_cannot_hold_the_batch(runs, capsys):
    """On 2 devices the 16 rows are 8 per device; a device that holds 4 but not 8 (planned peaks) gets them as 2
    accumulated microbatches, and the global batch stays 16. (The mixture run above does it through the CLI.)"""
    base, args, _ = runs
    finalized = config.load([BASE, *args["text"], "run_name=text"], num_devices=2)
    saved = elastic.saved_layout(finalized.checkpoint_dir)
    assert saved == elastic.SavedLayout(step=9, global_batch=16, devices=2, processes=1, accumulation=1)
    capacity = fit.Capacity(_holds_half_the_rows(finalized), "test")
    cfg = loading.resume_layout(finalized, capacity)
    assert (cfg.global_batch_size, cfg.per_device_batch_size, cfg.gradient_accumulation_steps) == (16, 8, 2)
    assert cfg.memory_fit.fits
    assert capsys.readouterr().out.strip() == "resuming step 9 on 2 devices (was 2): per-device batch 8, accumulation 2"


def _documents(batches: list[dict], bos: int) -> list[str]:
    """The tags of the documents that start in `batches`, in stream order: packed rows concatenated are the
    documents' inputs (BOS t1 ... tn) back to back; byte tokens are the byte + 3."""
    stream = np.concatenate([np.asarray(b["inputs"]).reshape(-1) for b in batches])
    starts = np.flatnonzero(stream == bos)
    pieces = np.split(stream, starts)[1:-1]  # the last may run on past the batches read
    return [bytes((piece[1:] - 3).tolist()).decode().split(" ")[0] for piece in pieces]


def test_documents_are_neither_repeated_nor_skipped_across_layouts(tmp_path):
    """Three batches each on 8, 4 and 2 devices (the iterator state carried over, JSON in between, as a checkpoint
    does), 8 rows a batch: every train document once per epoch, in the uninterrupted order."""
    folder = _corpus(tmp_path, "doc", 40, max_words=6)  # 13 to 70 tokens: some longer than a row of 32

    def cfg_for(devices: int) -> config.Config:
        return config.load([BASE, f"dataset_path={folder}", "max_target_length=32",
                            f"per_device_batch_size={8 // devices}"], num_devices=devices)

    def iterator(devices: int):
        cfg = cfg_for(devices)
        return make_input(cfg, mesh.build(cfg, jax.devices()[:devices]))

    straight = iterator(8)
    expected = [next(straight) for _ in range(9)]
    moved, state = [], None
    for devices in (8, 4, 2):
        batches = iterator(devices)
        if state is not None:
            batches.set_state(json.loads(json.dumps(state)))
        for _ in range(3):
            batch = next(batches)
            assert len(batch["inputs"].sharding.device_set) == devices
            moved.append(batch)
        state = batches.get_state()
    cfg = cfg_for(8)
    seen = _documents(moved, make_tokenizer(cfg).bos_id)
    assert seen == _documents(expected, make_tokenizer(cfg).bos_id)
    corpus = sources.text_corpus(folder)
    train_tags = {f"doc{int(i):03d}" for i in pipeline.split_documents(corpus, cfg, "train")}
    n = len(train_tags)
    assert len(seen) > n + 10, "the batches cover more than one epoch"
    assert len(seen[:n]) == len(set(seen[:n])) and set(seen[:n]) == train_tags  # epoch 1: each document once
    assert len(seen[n:]) == len(set(seen[n:])) and set(seen[n:]) <= train_tags  # epoch 2 so far: none twice
    assert state["stats"]["tokens"] == straight.get_state()["stats"]["tokens"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_xpk_restart_on_fewer_slices_two_processes_one_then_two(runs, env):
    """As XPK would restart the workload: the launcher's trainer arguments for 2 slices of v5p-8 (one process of 4
    devices each), then for 1 slice, then 2 again; the losses are the uninterrupted 8-device run's."""
    base, args, _ = runs
    user_argv = [BASE, *args["text"], "distributed_timeout=120"]

    def trainer_args(slices: int, steps: int) -> list[str]:
        target = topologies.parse("v5p-8", slices)
        argv = xpk.prepare_trainer_argv(user_argv, config.parse(user_argv), target, "elastic-xpk")
        assert f"num_slices={slices}" in argv and "run_name=elastic-xpk" in argv
        return [*argv[1:], "cpu_device_count=4", f"steps={steps}"]

    def two_processes(steps: int) -> list[str]:
        common = [*trainer_args(2, steps), f"coordinator_address=127.0.0.1:{_free_port()}", "process_count=2"]
        return finished([_trainer(env, [*common, f"process_id={i}"]) for i in range(2)])

    first = two_processes(3)
    assert all(re.search(r"mesh: data=2 fsdp=4 \(8 devices\)", out) for out in first), first[0][-2000:]
    (one,) = finished([_trainer(env, trainer_args(1, 6))])
    assert "resuming step 3 on 4 devices in 1 process (was 8 devices in 2 processes): per-device batch 4, " \
           "accumulation 1" in one
    assert re.search(r"mesh: fsdp=4 \(4 devices\)", one)
    last = two_processes(9)
    line = ("resuming step 6 on 8 devices in 2 processes (was 4 devices in 1 process): per-device batch 2, "
            "accumulation 1")
    assert all(line in out for out in last)  # every process derived the same
    np.testing.assert_allclose(_losses(base / "elastic-xpk"), _losses(base / "straight-text"), rtol=0, atol=1e-5)
