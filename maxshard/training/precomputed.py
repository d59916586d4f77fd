"""The `precomputed` reference (DPO's `dpo_reference`, KTO's `kto_reference`): the reference log-probabilities of
every train batch, computed in a first pass.

With `<objective>_reference: precomputed` the run keeps no reference model at all (no second copy of the parameters, no
second forward pass per step): before the first step, the starting parameters score the train batches of steps
0 .. steps - 1, and their per-token log-probabilities are written to `run_dir/reference_logps/`, one float32 file
[global batch, length] per step, plus `complete.json` once all are written. Training reads step i's file beside the
data pipeline's batch i (`WithReference`), as the batch's `reference_logps` field. The data stream is a pure
function of the config (data/pipeline.py), so batch i of the pass is batch i of training. Per-token
log-probabilities cover whatever a row holds: DPO's pairs, KTO's completions and the KL completions beside them.

A resumed run finds the files and goes on; a run whose files are incomplete (a pass that was killed) computes them
again only at step 0, while the starting parameters still exist: later it stops with one line. A changed global
batch (elastic) or step count would misalign batches and files, so the pass records both and a mismatch is refused.
Eval batches have no stored reference: a precomputed run skips eval (`train.py`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from maxshard import data
from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.objectives.kinds import FIELDS, kind
from maxshard.objectives.kinds import REFERENCE_FIELD as FIELD
from maxshard.parallel import xla_options
from maxshard.training.step import Trainer, mesh_context

__all__ = ["FIELD", "store_dir", "ensure", "WithReference"]

_DONE = "complete.json"


def store_dir(cfg: Config) -> str:
    return os.path.join(cfg.run_dir, "reference_logps")


def _identity(cfg: Config) -> dict[str, Any]:
    return {"steps": cfg.steps, "global_batch_size": cfg.global_batch_size, "max_target_length": cfg.max_target_length}


def _key(cfg: Config) -> str:
    """The config key that asked for the store (the objective's reference key), for messages."""
    return kind(cfg.objective).reference_key


def ensure(cfg: Config, trainer: Trainer, params: Any, step: int) -> None:
    """The store complete for this run: found, or written now from `params` (the starting parameters, step 0)."""
    directory = store_dir(cfg)
    done = os.path.join(directory, _DONE)
    if os.path.exists(done):
        with open(done, encoding="utf-8") as f:
            saved = json.load(f)
        if saved != _identity(cfg):
            raise ConfigError(f"{_key(cfg)}=precomputed: {directory} was computed for {saved}, this run has "
                              f"{_identity(cfg)}; start a new run_name")
        return
    if step > 0:
        raise ConfigError(f"{_key(cfg)}=precomputed: {directory} is incomplete and the run is at step {step}, "
                          "past its starting parameters; start a new run_name")
    _write(cfg, trainer, params, directory)


def _write(cfg: Config, trainer: Trainer, params: Any, directory: str) -> None:
    """The first pass: the reference log-probabilities of the train batches of every step, one file per step."""
    os.makedirs(directory, exist_ok=True)
    sharding = data.batch_sharding(cfg, trainer.mesh)
    score = jax.jit(lambda p, b: trainer._token_logps(p, b)[0],
                    in_shardings=(trainer.state_shardings.params, dict.fromkeys(FIELDS, sharding)),
                    out_shardings=sharding, compiler_options=xla_options.for_mesh(trainer.mesh))
    batches, started = data.make_input(cfg, trainer.mesh, "train"), time.perf_counter()
    print(f"{_key(cfg)}=precomputed: scoring the train batches of {cfg.steps} steps with the starting parameters "
          f"into {directory}", flush=True)
    for step in range(cfg.steps):
        with mesh_context(trainer.mesh, trainer.rules):
            logps = multihost_utils.process_allgather(score(params, next(batches)), tiled=True)
        if jax.process_index() == 0:
            np.save(os.path.join(directory, f"{step:08d}.npy"), np.asarray(logps, np.float32))
        if (step + 1) % max(cfg.log_period, 1) == 0 or step + 1 == cfg.steps:
            rate = (step + 1) / max(time.perf_counter() - started, 1e-9)
            print(f"reference: {step + 1}/{cfg.steps} batches ({rate:.1f} batches/s)", flush=True)
    if jax.process_index() == 0:
        with open(os.path.join(directory, _DONE), "w", encoding="utf-8") as f:
            json.dump(_identity(cfg), f)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("maxshard reference log-probs written")


class WithReference:
    """The data pipeline's train batches, each with its stored reference log-probabilities (module docstring)."""

    def __init__(self, cfg: Config, batches: Any, sharding: jax.sharding.NamedSharding) -> None:
        self.batches, self.sharding, self.directory, self.index = batches, sharding, store_dir(cfg), 0

    def __next__(self) -> dict[str, jax.Array]:
        rows = np.load(os.path.join(self.directory, f"{self.index:08d}.npy"), mmap_mode="r")
        batch = dict(next(self.batches))
        batch[FIELD] = jax.make_array_from_callback(rows.shape, self.sharding, lambda index: np.array(rows[index]))
        self.index += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"data": self.batches.get_state(), "reference_batch": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        self.batches.set_state(state["data"])
        self.index = int(state["reference_batch"])

    def stats(self) -> dict[str, int]:
        return self.batches.stats()
