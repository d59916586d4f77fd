"""Checkpoints that lose nothing: async saves, exact resume, preemption saves, resharding on restore.

A checkpoint is `checkpoint_dir/<step>/` with three orbax items:

    state   the TrainState's trained part (step, params, opt_state) as sharded arrays: every parameter, or with
            LoRA only the adapters (`saved_part`); the frozen base is read from `load_parameters_path` each start
    data    the input iterator state of every process, {"process_<i>": state} (JSON): the batch stream resumes exactly
    config  the Config that wrote it (JSON), for people and tools; never read back
    batch   only when the input hands one over: the batch the next step trains on again (GRPO between the updates
            of one rollout: sampled from parameters no checkpoint keeps), as sharded arrays

There is no other random state: parameters are initialised from `seed` once, the train step draws no randomness,
and the data order lives in the iterator state.

An input's state is JSON, except under the key `batch` (checkpoint_format.BATCH): a {field: jax.Array} batch that
is saved as its own item, each process writing its shards (JSON would hold the whole batch on every process, and
gather it), and restored onto this run's batch sharding, then handed back under the same key.

Why it is shaped this way:
- Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it when every item is written (on GCS a
  commit_success.txt marks it instead), and deletes old steps only after that. A save killed halfway leaves a tmp
  directory that `all_steps` never lists (and the next run's manager removes), so a good checkpoint is never
  replaced by a bad one.
- A committed checkpoint can still be damaged later (a file truncated or deleted). Resuming walks back from the
  latest step; a step whose bytes are missing or corrupt is renamed `<step>.damaged` (kept for inspection, out of
  the next save's way) and the one before it is tried. Any other read error (permissions, I/O, memory) stops the run
  and touches nothing (`checkpoint/health.py`). A run directory with checkpoints never silently starts from scratch.
- Each process reads a step with orbax's handlers directly, outside the barriers of `CheckpointManager.restore`,
  then all agree: damage only some processes see makes all fall back together instead of deadlocking.
- A save's background commit can fail: the loop asks at every step boundary (`raise_if_save_failed`, never
  blocking) and stops with one line naming the step, instead of training on believing it saved.
- Shapes are compared with the checkpoint's metadata before reading any array, so a changed model is one
  ConfigError naming the first differing parameter, never mistaken for damage.
- The restore target carries this run's shardings: a checkpoint saved on one mesh loads onto any other layout.
- The data states of all processes are gathered into one JSON item written by the primary process. They are one
  position in one global stream (`data/pipeline.py`), the same in every process, and a save checks that they are:
  any process count resumes from them (elastic restarts, `elastic.py`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from maxshard import data as input_data
from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint import layout as checkpoint_layout
from maxshard.checkpoint.health import (CheckpointError, Damaged, Outcome, QuietBackground, SaveFailed, agree,
                                        outcome_of, reason)
from maxshard.checkpoint.layout import check_matches
from maxshard.checkpoint.params import (check_same_base, read_base, read_params, read_start_adapters, require_base,
                                        saved_part, step_state_dir, target_state, with_base)
from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.model import trainable
from maxshard.training.step import Trainer, TrainState

__all__ = ["Checkpoints", "CheckpointError", "SaveFailed", "target_state", "check_matches", "preemption_reached",
           "DAMAGED_SUFFIX", "gather_data_states", "allgather_json", "this_process"]

DAMAGED_SUFFIX = ".damaged"
_PREEMPTION_SERVICE_OFF = "Preemption sync manager has not been initialized"  # jax's RuntimeError when it is off


def gather_data_states(local: dict[str, Any]) -> dict[str, Any]:
    """{"process_<i>": state} of every process, as JSON bytes through one allgather; they must agree (one global
    stream), else a resume on another process count could not pick one."""
    if jax.process_count() == 1:
        return {"process_0": local}
    gathered = allgather_json(local)
    first = gathered["process_0"]
    if any(state != first for state in gathered.values()):
        raise RuntimeError("the processes' data iterator states differ; they must be one position of the global "
                           "stream (maxshard/data/pipeline.py)")
    return gathered


def allgather_json(local: dict[str, Any]) -> dict[str, Any]:
    encoded = np.frombuffer(json.dumps(local).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(encoded.size))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: encoded.size] = encoded
    rows = multihost_utils.process_allgather(padded)
    return {f"process_{i}": json.loads(bytes(row[:n]).decode()) for i, (row, n) in enumerate(zip(rows, sizes))}


def this_process(saved: dict[str, Any], where: str) -> dict[str, Any]:
    """This process's iterator state; another process count is fine only if all saved states are the same."""
    mine = saved.get(f"process_{jax.process_index()}")
    if len(saved) == jax.process_count() and mine is not None:
        return mine
    states = list(saved.values())
    if states and all(s == states[0] for s in states):
        return states[0]
    raise ConfigError(f"{where} holds the data iterator states of {len(saved)} processes; this run has "
                      f"{jax.process_count()} (resume with the same process count)")


def preemption_reached(step: int, sigterm: threading.Event) -> bool:
    """True at the step boundary where every process stops to save for a preemption.

    One process: the SIGTERM flag. Several: JAX's preemption sync point, which its coordination service agrees on
    (it catches SIGTERM itself and picks the first step every process can still reach); it must be asked every step.
    """
    if jax.process_count() == 1:
        return sigterm.is_set()
    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError as e:
        # Only "jax_enable_preemption_service is off" (SIGTERM kills; resume from the last periodic save) is expected.
        # Any other failure of the sync point would silently turn off saving on SIGTERM: let it stop the run.
        if _PREEMPTION_SERVICE_OFF in str(e):
            return False
        raise


def restore(state_dir: epath.Path, target: Any, saved: Any) -> Any:
    """`target` (abstract arrays with this run's shardings) read from a state directory whose metadata tree is
    `saved`: directly when both have the same layout, else through `checkpoint/layout.py` (pipelined <-> scanned)."""
    handler = ocp.StandardCheckpointHandler()
    if not checkpoint_layout.needs_relayout(saved, target):
        return handler.restore(state_dir, args=ocp.args.StandardRestore(target))
    read = checkpoint_layout.read_target(saved, target)
    return checkpoint_layout.relayout(handler.restore(state_dir, args=ocp.args.StandardRestore(read)), target)


def load_full_state(path: str, trainer: Trainer) -> TrainState:
    """Step, params and optimizer state of another run's checkpoint, on this run's mesh and layout."""
    state_dir, target = step_state_dir(path, "load_full_state_path"), target_state(trainer)
    saved = ocp.PyTreeCheckpointHandler().metadata(state_dir).tree
    check_matches(saved, target, f"load_full_state_path={path}")
    return restore(state_dir, target, saved)


def load_parameters(path: str, trainer: Trainer) -> TrainState:
    """A fresh state (step 0, new optimizer moments) whose params come from a checkpoint: fine-tuning. With LoRA
    the checkpoint gives the frozen base and the adapters start fresh, or from a LoRA step's (its adapters on
    its base: another run's, or PEFT's that `from_hf --adapters` imported)."""
    if trainable.trains_everything(trainer.cfg.model):
        state_dir = step_state_dir(path, "load_parameters_path")
        params = read_params(state_dir, target_state(trainer).params, f"load_parameters_path={path}")
    else:
        target = target_state(trainer).params
        adapters = read_start_adapters(trainer.cfg, target)
        params = trainable.merge(adapters, read_base(path, target, trainer.cfg.model))
    # No full init: it would hold a second, random copy of every parameter (`Trainer.state_from`).
    return trainer.state_from(params)



def _close(manager: ocp.CheckpointManager, step: int | None) -> None:
    """Closes orbax's manager; a background commit that failed after the last wait surfaces here, as SaveFailed."""
    try:
        manager.close()
    except Exception as e:  # noqa: BLE001 - whatever broke the save, the run must stop naming it
        raise SaveFailed(step if step is not None else -1, e) from e


def _manager(cfg: Config) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.max_checkpoints_to_keep or None,
        enable_async_checkpointing=cfg.async_checkpointing,
        cleanup_tmp_directories=True,  # leftovers of saves that were killed halfway
    )
    # Handlers named up front: without them a fresh manager cannot read an item's metadata before its first save.
    handlers = {checkpoint_format.STATE: ocp.StandardCheckpointHandler(),
                checkpoint_format.DATA: ocp.JsonCheckpointHandler(),
                checkpoint_format.CONFIG: ocp.JsonCheckpointHandler(),
                checkpoint_format.BATCH: ocp.StandardCheckpointHandler()}
    return ocp.CheckpointManager(epath.Path(cfg.checkpoint_dir), item_handlers=handlers, options=options)


class Checkpoints:
    """The run's CheckpointManager (none when `enable_checkpointing` is off) and the policy around it."""

    def __init__(self, cfg: Config, trainer: Trainer) -> None:
        self.cfg, self.trainer = cfg, trainer
        self.manager = _manager(cfg) if cfg.enable_checkpointing else None
        self._pending: int | None = None  # the step of the last save not yet known to be committed
        self._last_save: int | None = None  # the step of the last save begun, for a failure only close reports
        self._quiet = QuietBackground().__enter__()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - see below
            # The error on its way out (a failed save's one line, say) is the story: orbax's close may raise that
            # save's background failure a second time, in its own words, which would only hide it
            if exc_type is None:
                raise

    def close(self) -> None:
        """Waits for a save in flight: a run never exits with its last checkpoint half written (raises SaveFailed,
        also where orbax's own close is what reports the failed commit)."""
        try:
            self.wait()
        finally:
            manager, self.manager = self.manager, None
            try:
                if manager is not None:
                    _close(manager, self._last_save)
            finally:
                self._quiet.__exit__()

    # ------------------------------------------------------------------ restore

    def restore_or_init(self) -> tuple[TrainState, dict[str, Any] | None]:
        """(state, this process's data iterator state or None): own checkpoints first, then the load_* keys."""
        cfg = self.cfg
        require_base(cfg)
        if cfg.load_parameters_path and cfg.load_full_state_path:
            raise ConfigError("set at most one of load_parameters_path and load_full_state_path")
        if self.manager is not None and self.manager.all_steps():
            return self._resume()
        self._refuse_if_only_damaged()
        if cfg.load_full_state_path:
            state = load_full_state(cfg.load_full_state_path, self.trainer)
            print(f"starting from step {int(state.step)}: full state of {cfg.load_full_state_path}", flush=True)
            return state, None
        if cfg.load_parameters_path:
            print(f"starting from step 0 with the parameters of {cfg.load_parameters_path}", flush=True)
            return load_parameters(cfg.load_parameters_path, self.trainer), None
        where = f"no checkpoint in {cfg.checkpoint_dir}" if self.manager is not None else "enable_checkpointing is off"
        print(f"starting from step 0 ({where})", flush=True)
        return self.trainer.init_state(), None

    def _refuse_if_only_damaged(self) -> None:
        """Checkpoints set aside by an earlier start still mean this run has a history: never start it over silently."""
        directory = epath.Path(self.cfg.checkpoint_dir)
        damaged = sorted(p.name for p in directory.glob(f"*{DAMAGED_SUFFIX}*")) if self.manager is not None else []
        if damaged:
            raise ConfigError(f"{directory} holds only damaged checkpoints ({', '.join(damaged)}); "
                              "move them away to start this run from scratch")

    def _resume(self) -> tuple[TrainState, dict[str, Any]]:
        target = saved_part(target_state(self.trainer), self.trainer)
        for step in sorted(self.manager.all_steps(), reverse=True):
            restored = self._try_restore(step, target)
            if restored is not None:
                print(f"resuming from step {step} ({self.cfg.checkpoint_dir})", flush=True)
                state, data_state = restored
                return with_base(state, self.trainer), data_state
        raise ConfigError(f"no checkpoint in {self.cfg.checkpoint_dir} can be read (all set aside as *"
                          f"{DAMAGED_SUFFIX}); move them away to start this run from scratch")

    def _try_restore(self, step: int, target: TrainState) -> tuple[TrainState, dict[str, Any]] | None:
        """The restored step, or None after all processes set a damaged step aside; any other failure raises."""
        where = f"checkpoint step {step} in {self.cfg.checkpoint_dir}"
        aside = self._aside_name(step)  # chosen before the agreement: after it, process 0 may have renamed already
        restored, problem = None, None
        try:
            restored = self._read(step, target, where)
        except Exception as e:  # noqa: BLE001 - classified below, after every process has tried
            problem = e
        mine = outcome_of(problem)  # a ConfigError is a failure unless damage caused it (an unreadable config item)
        mine = Outcome.FAILED if isinstance(problem, ConfigError) and mine is not Outcome.DAMAGED else mine
        agreed = agree(mine)
        if agreed is Outcome.FAILED:
            if isinstance(problem, ConfigError):
                raise problem
            cause = reason(problem) if mine is Outcome.FAILED else "it failed to read on another process"
            raise CheckpointError(f"{where} could not be read ({cause}); that is not damage, so nothing was set "
                                  "aside: fix the cause and start the run again") from problem
        if agreed is Outcome.DAMAGED:
            self._set_aside(step, aside, problem)
            return None
        return restored

    def _read(self, step: int, target: TrainState, where: str) -> tuple[TrainState, dict[str, Any]]:
        """This process's own read of one step: orbax's handlers, unlike the manager's restore, hold no barrier."""
        step_dir = epath.Path(self.cfg.checkpoint_dir) / str(step)
        saved = ocp.PyTreeCheckpointHandler().metadata(step_dir / checkpoint_format.STATE).tree
        if saved is None or not jax.tree.leaves(saved):
            raise Damaged("the state metadata is empty")
        check_matches(saved, target, where)
        check_same_base(self.cfg, step_dir)
        state = restore(step_dir / checkpoint_format.STATE, target, saved)
        data = this_process(ocp.JsonCheckpointHandler().restore(step_dir / checkpoint_format.DATA),
                            f"checkpoint step {step}")
        if (step_dir / checkpoint_format.BATCH).exists():
            data = {**data, checkpoint_format.BATCH: self._read_batch(step_dir / checkpoint_format.BATCH)}
        return jax.block_until_ready(state), data

    def _read_batch(self, item: epath.Path) -> dict[str, jax.Array] | None:
        """The saved batch laid out as this run's train batch (any mesh); None when its rows are not this run's
        batch shape (an elastic restart that changed the global batch): the input makes a new one."""
        saved = ocp.PyTreeCheckpointHandler().metadata(item).tree
        if not saved:
            raise Damaged("the batch metadata is empty")
        shape = (self.cfg.global_batch_size, self.cfg.max_target_length)
        if any(tuple(m.shape) != shape for m in saved.values()):
            return None
        sharding = input_data.batch_sharding(self.cfg, self.trainer.mesh)
        target = {k: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding) for k, m in saved.items()}
        return ocp.StandardCheckpointHandler().restore(item, args=ocp.args.StandardRestore(target))

    def _aside_name(self, step: int) -> str:
        aside = epath.Path(self.cfg.checkpoint_dir) / f"{step}{DAMAGED_SUFFIX}"
        while aside.exists():
            aside = aside.with_name(aside.name + "_")
        return aside.name

    def _set_aside(self, step: int, aside: str, problem: BaseException | None) -> None:
        """Renames a damaged step out of the manager's sight, so that the step can be saved again later."""
        path = epath.Path(self.cfg.checkpoint_dir) / str(step)
        why = reason(problem) if problem is not None else "unreadable on another process"
        print(f"checkpoint step {step} is damaged ({why}); set aside as {aside}, trying the previous one",
              flush=True)
        if jax.process_index() == 0:
            path.rename(path.with_name(aside))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"maxshard set aside checkpoint {step}")
        self.manager.reload()

    # ------------------------------------------------------------------ save

    def due(self, step: int, preempted: bool) -> bool:
        """Every `checkpoint_period` steps, at the last step, and when a preemption notice arrived."""
        if self.manager is None:
            return False
        return preempted or step % self.cfg.checkpoint_period == 0 or step == self.cfg.steps

    def save(self, step: int, state: TrainState, data_state: dict[str, Any]) -> None:
        """Returns once the state is copied to host memory (the next step may donate it); writing goes on behind."""
        self.wait()  # orbax would wait for the previous save anyway; this names its step if it failed
        print(f"saving checkpoint at step {step}", flush=True)
        position = {k: v for k, v in data_state.items() if k != checkpoint_format.BATCH}
        items = {
            checkpoint_format.STATE: ocp.args.StandardSave(saved_part(state, self.trainer)),
            checkpoint_format.DATA: ocp.args.JsonSave(gather_data_states(position)),
            checkpoint_format.CONFIG: ocp.args.JsonSave(checkpoint_format.config_json(self.cfg)),
        }
        if data_state.get(checkpoint_format.BATCH) is not None:
            items[checkpoint_format.BATCH] = ocp.args.StandardSave(data_state[checkpoint_format.BATCH])
        args = ocp.args.Composite(**items)
        self._pending = self._last_save = step
        self._finish(lambda: self.manager.save(step, args=args, force=True))

    def raise_if_save_failed(self) -> None:
        """Raises SaveFailed once the last save's background commit has failed; never waits for one still writing.

        Called at every step boundary, so a failed save stops the run within a step of failing.
        """
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self.wait()  # the commit is over: this returns at once, or raises its error

    def wait(self) -> None:
        """Blocks until the last save is committed; raises SaveFailed naming its step if writing it failed."""
        if self.manager is not None and self._pending is not None:
            self._finish(self.manager.wait_until_finished)

    def _finish(self, call: Callable[[], object]) -> None:
        """Runs a manager call that may surface a save's failure; clears the pending step once it is settled."""
        step = self._pending
        try:
            call()
        except Exception as e:  # noqa: BLE001 - whatever broke the save, the run must stop naming it
            self._pending = None
            raise SaveFailed(step, e) from e
        if not self.manager.is_saving_in_progress():
            self._pending = None
