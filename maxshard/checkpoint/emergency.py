"""Local checkpoints with replicas across slices: orbax's emergency CheckpointManager behind `checkpoint_local_dir`.

At thousands of hosts a save to object storage takes minutes and restarts are frequent. Orbax's emergency manager
(`orbax.checkpoint.experimental.emergency.checkpoint_manager`, the one MaxText's `enable_emergency_checkpoint`
uses) keeps two tiers:

- local: every `checkpoint_local_period` steps each host of a non-primary slice writes its shards to
  `checkpoint_local_dir` (a RAM disk, say). Each data-parallel replica (slice) holds the whole state, so every
  non-primary slice holds a full copy: the replicas live on the other slices.
- persistent: every `checkpoint_period` steps (and at the last step and on a preemption notice) the primary slice
  (replica 0 of the `data` axis) writes `checkpoint_dir` as usual.

On start, orbax lists the steps of every slice's local copy (one allgather) and of persistent storage. The newest
step wins; if some slice holds it complete, that slice reads it and broadcasts it over the `data` axis to the
others (a host whose local directory was wiped gets it from a peer slice), else the primary slice reads it from
persistent storage and broadcasts it. So a restart loses at most `checkpoint_local_period` steps while any slice's
copy survives, and `checkpoint_period` steps when none does.

What this module adds around orbax's manager, and why:
- The data position. Orbax's emergency manager stores the train state only (MaxText resumes its input elsewhere).
  Ours is one JSON position of the global stream, the same in every process (`data/pipeline.py`): beside each
  local step every host writes it to `<local>/positions/<step>.json`, and process 0 beside each persistent step to
  `checkpoint_dir/positions/<step>.json`. On restore every process reads what it has and all agree through one
  allgather, so a host with a wiped directory takes it from any peer. Written before orbax's save starts, it exists
  for every step orbax commits.
- Per-process directories: `checkpoint_local_dir/process_<i>`, so processes sharing one filesystem (tests, one
  machine) never write into each other's copies; on a real cluster the directory is per host anyway.
- The refusals, as one line each before anything is compiled: orbax needs at least two replicas on the `data`
  axis, each process inside one of them, and a state replicated over it (it broadcasts one replica's copy).

Limits (honest): the persistent steps are written in orbax's single-item layout (`<step>/default`), not as
state/data/config items, so the tools that read `checkpoint_dir` steps (generate, convert, elastic resume on other
device counts) do not read them; damaged steps are not set aside as in `manager.py` (orbax's restore raises); one
slice (no replica to hold a copy) is refused rather than silently writing persistent checkpoints only; so is GRPO
with `grpo_updates_per_rollout` > 1, whose rollout batch (manager.py's `batch` item) these tiers do not keep.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from absl import flags
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.multihost import multihost as orbax_multihost
from orbax.checkpoint._src.multihost import multislice
from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency
from orbax.checkpoint.experimental.emergency import path as emergency_path

from maxshard.checkpoint import manager as checkpoint_manager
from maxshard.checkpoint.health import CheckpointError, reason
from maxshard.checkpoint.params import saved_part, target_state, with_base
from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.objectives import kinds as objective_kinds
from maxshard.training.step import Trainer, TrainState

__all__ = ["EmergencyCheckpoints", "open_checkpoints", "local_root", "REPLICA_AXIS", "POSITIONS"]

REPLICA_AXIS = "data"  # the mesh axis whose replicas hold the copies (each slice is one data-parallel replica)
POSITIONS = "positions"  # the directory of data positions beside the steps, local and persistent


def open_checkpoints(cfg: Config, trainer: Trainer) -> checkpoint_manager.Checkpoints:
    """The run's checkpoints: local + persistent tiers when `checkpoint_local_dir` is set, else today's."""
    if cfg.checkpoint_local_dir:
        if not cfg.enable_checkpointing:
            raise ConfigError("checkpoint_local_dir needs enable_checkpointing=true (local copies are checkpoints)")
        if "://" in cfg.checkpoint_local_dir:
            raise ConfigError(f"checkpoint_local_dir={cfg.checkpoint_local_dir} must be a path on each host (a RAM "
                              "disk, a local SSD), not a URL: persistent storage is checkpoint_dir's")
        if objective_kinds.kind(cfg.objective).samples and cfg.grpo_updates_per_rollout > 1:
            raise ConfigError("checkpoint_local_dir keeps the train state and the data position only, not the rollout "
                              "batch a step inside grpo_updates_per_rollout > 1 trains on again: set "
                              "grpo_updates_per_rollout=1, or leave checkpoint_local_dir empty")
        return EmergencyCheckpoints(cfg, trainer)
    return checkpoint_manager.Checkpoints(cfg, trainer)


def local_root(cfg: Config, process_index: int | None = None) -> epath.Path:
    """This process's local directory: `checkpoint_local_dir/process_<i>`."""
    index = jax.process_index() if process_index is None else process_index
    return epath.Path(cfg.checkpoint_local_dir) / f"process_{index}"


def check_topology(mesh: jax.sharding.Mesh, abstract_state: Any) -> int:
    """The replica axis index, or one ConfigError line on what orbax's emergency manager cannot work with."""
    key = "checkpoint_local_dir"
    axis = mesh.axis_names.index(REPLICA_AXIS)
    replicas = multislice.replica_count(mesh, replica_axis_index=axis)
    if replicas < 2:
        raise ConfigError(f"{key} needs at least 2 data-parallel replicas (slices) to hold the copies; the "
                          f"'{REPLICA_AXIS}' axis has {replicas} (set dcn_data_parallelism >= 2 over several slices)")
    devices = np.moveaxis(mesh.devices, axis, 0).reshape(replicas, -1)
    for process in {d.process_index for d in mesh.devices.flat}:
        holding = [r for r in range(replicas) if any(d.process_index == process for d in devices[r])]
        if len(holding) != 1:
            raise ConfigError(f"{key}: process {process} holds devices of {len(holding)} replicas of the "
                              f"'{REPLICA_AXIS}' axis; each process must lie in one slice (one process per slice "
                              "at least: dcn_data_parallelism = number of slices)")
    for leaf in jax.tree.leaves(abstract_state):
        spec = getattr(leaf.sharding, "spec", ())
        used = {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}
        if REPLICA_AXIS in used:
            raise ConfigError(f"{key}: the train state is sharded over the '{REPLICA_AXIS}' axis; each slice must "
                              "hold a whole copy (keep parameters off the data axis in logical_axis_rules)")
    return axis


def _join_orbax_ids() -> None:
    """Orbax's maps from runtime process index to distributed id and to device ids (its local steps record which
    devices wrote them, so a host restarted under another index still reads its copy); once per process.

    Orbax's emergency restore also reads absl flags of its own (their defaults here): maxshard does not run under
    absl's app, so the flags are marked parsed, with nothing on the command line for absl to read."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    if jax.process_count() == 1:
        return
    if not orbax_multihost.is_runtime_to_distributed_ids_initialized():
        orbax_multihost.initialize_runtime_to_distributed_ids()
    orbax_multihost.initialize_distributed_to_device_ids()


def _options(cfg: Config, axis: int) -> emergency.CheckpointManagerOptions:
    """Each tier saves on its own period when asked at a step; a forced save (last step, preemption) writes both."""
    policy = ocp.checkpoint_managers
    return emergency.CheckpointManagerOptions(
        local=emergency.LocalCheckpointOptions(
            save_decision_policy=policy.FixedIntervalPolicy(cfg.checkpoint_local_period)),
        persistent=emergency.PersistentCheckpointOptions(
            save_decision_policy=policy.FixedIntervalPolicy(cfg.checkpoint_period),
            max_to_keep=cfg.max_checkpoints_to_keep or None),
        replica_axis_index=axis,
        enable_async_checkpointing=cfg.async_checkpointing,
        cleanup_tmp_directories=True,
    )


def _write_json(path: epath.Path, value: Any) -> None:
    """Written whole or not at all: a reader never sees half a position."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _prune(directory: epath.Path, keep: set[int]) -> None:
    for path in directory.glob("*.json") if directory.exists() else []:
        if path.stem.isdigit() and int(path.stem) not in keep:
            path.unlink(missing_ok=True)


class EmergencyCheckpoints(checkpoint_manager.Checkpoints):
    """`Checkpoints` whose manager is orbax's emergency manager: same loop interface, two tiers behind it."""

    def __init__(self, cfg: Config, trainer: Trainer) -> None:  # noqa: D107 - see the class
        self._target = saved_part(target_state(trainer), trainer)
        self._axis = check_topology(trainer.mesh, self._target)
        self._local = local_root(cfg)
        self._local.mkdir(parents=True, exist_ok=True)  # orbax requires the caller to create it
        _join_orbax_ids()
        super().__init__(dataclasses.replace(cfg, enable_checkpointing=False), trainer)  # opens no manager
        self.cfg = cfg
        self.manager = emergency.CheckpointManager(
            self._local, epath.Path(cfg.checkpoint_dir), global_mesh=trainer.mesh, abstract_state=self._target,
            options=_options(cfg, self._axis))

    # ------------------------------------------------------------------ restore

    def restore_or_init(self) -> tuple[TrainState, dict[str, Any] | None]:
        steps = self.manager.all_steps()  # every process: one allgather of the slices' local steps
        if not steps:
            return super().restore_or_init()
        step = max(steps)
        where = self._source(step)
        try:
            restored = self.manager.restore(step).state
        except Exception as e:  # noqa: BLE001 - one line naming the step and the tier, the cause chained
            raise CheckpointError(f"checkpoint step {step} ({where}) could not be read: "
                                  f"{reason(e)}") from e
        print(f"resuming from step {step} ({where})", flush=True)
        state = jax.block_until_ready(restored)
        return with_base(state, self.trainer), self._position(step)

    def _source(self, step: int) -> str:
        """Which copy orbax reads `step` from: the lowest slice holding it complete, else persistent storage."""
        per_slice = emergency_path.get_per_replica_local_steps(
            self._local, step_name_format=ocp.step.standard_name_format(), global_mesh=self.trainer.mesh,
            replica_axis_index=self._axis)
        holding = sorted(s for s, held in per_slice.items() if step in held)
        return f"local copy of slice {holding[0]}" if holding else f"persistent, {self.cfg.checkpoint_dir}"

    def _position(self, step: int) -> dict[str, Any]:
        """This process's data iterator state at `step`, from any process that kept it (one allgather)."""
        mine = None
        for directory in (self._local / POSITIONS, epath.Path(self.cfg.checkpoint_dir) / POSITIONS):
            path = directory / f"{step}.json"
            if path.exists():
                mine = json.loads(path.read_text())
                break
        found = checkpoint_manager.allgather_json({"position": mine}) if jax.process_count() > 1 else {
            "process_0": {"position": mine}}
        held = [v["position"] for v in found.values() if v["position"] is not None]
        if not held:
            raise CheckpointError(f"checkpoint step {step} has no data position in any process's "
                                  f"{self._local.parent}/process_*/{POSITIONS} nor in {self.cfg.checkpoint_dir}/"
                                  f"{POSITIONS}; the input stream cannot resume exactly")
        return checkpoint_manager.this_process(held[0], f"the data position of step {step}")

    # ------------------------------------------------------------------ save

    def due(self, step: int, preempted: bool) -> bool:
        return preempted or step == self.cfg.steps or self._local_due(step) or self._persistent_due(step)

    def _local_due(self, step: int) -> bool:
        return step % self.cfg.checkpoint_local_period == 0

    def _persistent_due(self, step: int) -> bool:
        return step % self.cfg.checkpoint_period == 0

    def save(self, step: int, state: TrainState, data_state: dict[str, Any]) -> None:
        """Orbax decides per tier from its periods; the last step and a preemption force both tiers."""
        self.wait()
        forced = step == self.cfg.steps or not (self._local_due(step) or self._persistent_due(step))
        position = checkpoint_manager.gather_data_states(data_state)
        self._keep_position(step, position, persistent=forced or self._persistent_due(step))
        tiers = "local and persistent" if forced else " and ".join(
            t for t, due in (("local", self._local_due(step)), ("persistent", self._persistent_due(step))) if due)
        print(f"saving checkpoint at step {step} ({tiers})", flush=True)
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(saved_part(state, self.trainer)))
        self._pending = step
        self._finish(lambda: self.manager.save(step, args=args, force=forced))

    def _keep_position(self, step: int, position: dict[str, Any], persistent: bool) -> None:
        """The data position beside the step in both tiers; positions of steps no longer kept are dropped."""
        local = self._local / POSITIONS
        _prune(local, {int(p.name) for p in self._local.iterdir() if p.name.isdigit()})
        _write_json(local / f"{step}.json", position)
        if persistent and jax.process_index() == 0:
            directory = epath.Path(self.cfg.checkpoint_dir)
            _prune(directory / POSITIONS, {int(p.name) for p in directory.iterdir() if p.name.isdigit()})
            _write_json(directory / POSITIONS / f"{step}.json", position)

    def raise_if_save_failed(self) -> None:
        """Orbax's check for errors of finished background saves: never waits for one still writing."""
        if self._pending is not None:
            self._finish(self.manager.check_for_errors, settle=False)

    def wait(self) -> None:
        if self.manager is not None and self._pending is not None:
            self._finish(self.manager.wait_until_finished)

    def _finish(self, call: Any, settle: bool = True) -> None:
        step = self._pending
        try:
            call()
        except Exception as e:  # noqa: BLE001 - whatever broke the save, the run must stop naming it
            self._pending = None
            raise checkpoint_manager.SaveFailed(step, e) from e
        if settle:
            self._pending = None

