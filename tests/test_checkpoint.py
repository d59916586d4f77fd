"""Checkpoints lose nothing: exact resume, SIGKILL and SIGTERM mid-run, damaged files, resharding, mismatches.

The training runs are subprocesses (`python -m maxshard.train`, tests/training_runs.py) on the real text corpus, so
the data iterator state is part of every resume. Losses are compared bit for bit through each run's metrics.jsonl.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from helpers import mesh_for, tiny_config
from training_runs import (BASE, RUN, STEPS, argv, assert_same_tree, losses, read_until, resumed_step, saved_state,
                           started, started_from, step_dir, train)

from benchmarks import crash_resume
from maxshard import config
from maxshard.checkpoint import manager as checkpoint
from maxshard.errors import ConfigError
from maxshard.run import loading
from maxshard.training.step import Trainer

# --------------------------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_stop_and_resume_is_exact(env, reference, tmp_path):
    train(env, tmp_path, "steps=4")
    output = train(env, tmp_path)
    assert resumed_step(output) == 4
    assert losses(tmp_path) == losses(reference)  # steps 1-4 from the first run, 5-8 from the resumed one
    assert_same_tree(saved_state(tmp_path, STEPS), saved_state(reference, STEPS))
    assert "run already complete" in train(env, tmp_path)


@pytest.mark.slow
def test_sigkill_at_five_seeded_points_and_a_half_written_save_then_resume_is_exact(env, reference, tmp_path):
    """benchmarks/crash_resume.py's chain: each start is SIGKILLed past where it resumed, some kills mid-save."""
    command = argv(tmp_path, "checkpoint_period=1")
    chain = crash_resume.kill_chain(command, env, kills=1, steps=STEPS, seed=3)
    unfinished = tmp_path / "default" / "checkpoints" / f"{STEPS - 1}.orbax-checkpoint-tmp" / "state"
    unfinished.mkdir(parents=True)  # what a save killed halfway leaves, at a step later than any complete one
    (unfinished / "_METADATA").write_text('{"tree_metadata": {')
    chain += crash_resume.kill_chain(command, env, kills=4, steps=STEPS, seed=4)
    last = started_from(train(env, tmp_path, "checkpoint_period=1"))
    resumed = [r for _, r in chain[1:]] + [last]
    for (kill, _), after in zip(chain, resumed):
        assert after >= kill.step - 1, chain  # a kill loses at most the save in flight, never the one before it
    assert resumed[0] < STEPS - 1  # never the half-written step, which that start removed
    assert not list(unfinished.parent.parent.glob("*.orbax-checkpoint-tmp*"))
    logged = crash_resume.logged_losses(tmp_path / "default")  # every start's records, each compared on its own
    assert crash_resume.differences(losses(reference), logged, STEPS) == []
    assert_same_tree(saved_state(tmp_path, STEPS), saved_state(reference, STEPS))


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resume_loses_no_step(env, reference, tmp_path):
    with started(env, tmp_path) as proc:
        read_until(proc, r"starting from step 0")  # the handler is installed from here on
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    assert time.monotonic() - sent < 60
    stopped = int(re.search(r"preempted: stopping after step (\d+), checkpoint saved", output).group(1))
    assert stopped < STEPS
    assert (tmp_path / "default" / "checkpoints" / str(stopped) / "state").is_dir()
    assert resumed_step(train(env, tmp_path)) == stopped
    assert losses(tmp_path) == losses(reference)


@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back_to_the_previous(env, reference, tmp_path):
    shutil.copytree(reference / "default" / "checkpoints", tmp_path / "default" / "checkpoints")
    latest = tmp_path / "default" / "checkpoints" / str(STEPS)
    data_files = [p for p in (latest / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data_files
    for path in data_files:  # a copy cut short: every array file loses its second half
        os.truncate(path, path.stat().st_size // 2)
    output = train(env, tmp_path)
    assert re.search(rf"checkpoint step {STEPS} is damaged \(.+\); set aside as {STEPS}.damaged", output), output
    assert resumed_step(output) == 4
    resumed = {step: loss for step, loss in losses(tmp_path).items()}
    assert resumed == {step: loss for step, loss in losses(reference).items() if step > 4}
    assert (latest.parent / f"{STEPS}.damaged").is_dir()
    assert_same_tree(saved_state(tmp_path, STEPS), saved_state(reference, STEPS))


# --------------------------------------------------------------------------------------------- in process


def run_config(base: Path, *extra: str) -> config.Config:
    """The config the subprocess runs use, finalized for the 8 simulated devices of this process."""
    return loading.complete(config.finalize(config.parse([BASE, *RUN, f"base_output_directory={base}", *extra]), 8))


@pytest.mark.slow
def test_deleted_file_is_damage_and_all_damaged_never_starts_from_scratch(reference, tmp_path, capsys):
    shutil.copytree(reference / "default" / "checkpoints", tmp_path / "default" / "checkpoints")
    cfg = run_config(tmp_path)
    trainer = Trainer(cfg, mesh_for(cfg))
    (tmp_path / "default" / "checkpoints" / str(STEPS) / "state" / "_METADATA").unlink()
    with checkpoint.Checkpoints(cfg, trainer) as ckpt:
        state, data_state = ckpt.restore_or_init()
    assert int(state.step) == 4 and data_state["identity"]["split"] == "train"
    assert f"checkpoint step {STEPS} is damaged" in capsys.readouterr().out
    (tmp_path / "default" / "checkpoints" / "4" / "data" / "metadata").unlink()
    with checkpoint.Checkpoints(cfg, trainer) as ckpt, pytest.raises(ConfigError, match="can be read"):
        ckpt.restore_or_init()
    with checkpoint.Checkpoints(cfg, trainer) as ckpt, pytest.raises(ConfigError, match="only damaged checkpoints"):
        ckpt.restore_or_init()  # the next start too: the steps set aside are still this run's history


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A checkpoint at step 5 of the tiny model on fsdp=8, with optimizer moments that a fresh state lacks."""
    base = tmp_path_factory.mktemp("saved")
    cfg = tiny_config(f"base_output_directory={base}")
    trainer = Trainer(cfg, mesh_for(cfg))
    fresh = trainer.init_state()
    plus_one = lambda tree: jax.tree.map(lambda x: x + 1, tree)  # noqa: E731 - no init ever gives these values
    state = fresh.replace(step=fresh.step + 5, params=plus_one(fresh.params), opt_state=plus_one(fresh.opt_state))
    host = jax.device_get(state)
    with checkpoint.Checkpoints(cfg, trainer) as ckpt:
        ckpt.save(5, state, {"step": 5})
    return base, host, trainer.state_shardings


@pytest.mark.parametrize(
    ("layout", "num_devices"),
    [(("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"), 8), (("ici_fsdp_parallelism=4",), 4)],
    ids=["fsdp4xtensor2", "4devices"],
)
def test_restore_reshards_onto_another_layout(saved, layout, num_devices, capsys):
    base, host, saved_shardings = saved
    cfg = tiny_config(f"base_output_directory={base}", *layout, num_devices=num_devices)
    trainer = Trainer(cfg, mesh_for(cfg))
    with checkpoint.Checkpoints(cfg, trainer) as ckpt:
        state, data_state = ckpt.restore_or_init()
    assert "resuming from step 5" in capsys.readouterr().out
    assert data_state == {"step": 5}
    assert_same_tree(jax.device_get(state), host)
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings)):
        assert leaf.sharding == want
    kernel = state.params["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
    assert len(kernel.sharding.device_set) == num_devices
    assert kernel.sharding != saved_shardings.params["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]


def test_model_mismatch_is_one_line_naming_the_parameter(saved):
    base, _, _ = saved
    cfg = tiny_config(f"base_output_directory={base}", "emb_dim=32")
    with checkpoint.Checkpoints(cfg, Trainer(cfg, mesh_for(cfg))) as ckpt, pytest.raises(ConfigError) as error:
        ckpt.restore_or_init()
    message = str(error.value)
    assert "\n" not in message
    assert re.search(r"params/decoder/\S+ has shape \(\d+, 64, .*\) in the checkpoint, \(\d+, 32, .*\) in the model",
                     message), message
    assert (base / "default" / "checkpoints" / "5").is_dir()  # a mismatch is not damage: nothing set aside


def test_load_parameters_path_seeds_params_only(saved, tmp_path):
    base, host, _ = saved
    cfg = tiny_config(f"base_output_directory={tmp_path}", f"load_parameters_path={step_dir(base, 5)}")
    trainer = Trainer(cfg, mesh_for(cfg))
    with checkpoint.Checkpoints(cfg, trainer) as ckpt:
        state, data_state = ckpt.restore_or_init()
    assert data_state is None and int(state.step) == 0
    assert_same_tree(jax.device_get(state.params), host.params)
    assert all(not np.any(leaf) for leaf in jax.tree.leaves(jax.device_get(state.opt_state)))  # fresh: zeros
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(host.opt_state)
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings)):
        assert leaf.sharding == want


def test_load_full_state_path_takes_step_and_optimizer(saved, tmp_path):
    base, host, _ = saved
    cfg = tiny_config(f"base_output_directory={tmp_path}", f"load_full_state_path={step_dir(base, 5)}")
    with checkpoint.Checkpoints(cfg, Trainer(cfg, mesh_for(cfg))) as ckpt:
        state, data_state = ckpt.restore_or_init()
    assert data_state is None
    assert_same_tree(jax.device_get(state), host)


def test_data_state_of_another_process_count():
    same = {"process_0": {"step": 3}, "process_1": {"step": 3}}
    assert checkpoint.this_process(same, "here") == {"step": 3}
    with pytest.raises(ConfigError, match="2 processes; this run has 1"):
        checkpoint.this_process({"process_0": {"a": 1}, "process_1": {"a": 2}}, "here")


def test_sigterm_sets_the_flag_and_the_previous_handler_comes_back():
    from maxshard import train

    before = signal.getsignal(signal.SIGTERM)
    with train.catch_sigterm() as sigterm:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not sigterm.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sigterm.is_set()
        assert checkpoint.preemption_reached(3, sigterm)
    assert signal.getsignal(signal.SIGTERM) is before
