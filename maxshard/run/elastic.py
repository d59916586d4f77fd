"""Elastic restarts: a resumed run keeps its checkpoint's global batch on whatever devices it comes back on.

The global batch fixes what a step computes (the rows it averages over, so the loss, the gradients and the
learning-rate schedule per step); the per-device batch and the gradient accumulation steps only say how the devices
share it. So a run that resumes on another device or process count keeps the checkpoint's global batch and derives
the rest again:

    checkpoint: 16 rows on 8 devices (per-device batch 2)  ->  resumed on 4 devices: per-device batch 4
                                                           ->  resumed on 2 devices: per-device batch 8, and where
                                                               8 rows do not fit a device, accumulation 2, 4, ...

The mesh's `-1` knobs fill for the new count as at any start (`mesh.py`), and the input stream is one global stream
whose position any process count resumes (`data/pipeline.py`), so the steps that follow are the steps the run would
have taken on its old devices (to float rounding: the sums run in another order).

What the checkpoint was trained with is read from its `config` item (the Config that wrote it) before anything is
compiled. `elastic: false` refuses another device or process count instead. A `per_device_batch_size` given on the
command line that would change the global batch is refused unless `elastic_allow_batch_change: true` (then the run
goes on from the next row of the stream with the new batch, and its schedule changes meaning). An explicit
`gradient_accumulation_steps` is kept as given: accumulation splits the global batch, it never changes it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

from etils import epath

from maxshard.checkpoint import format as checkpoint_format
from maxshard.config import Config
from maxshard.errors import ConfigError

__all__ = ["SavedLayout", "saved_layout", "keep_global_batch", "accumulation_choices", "changed", "describe"]

_STEP_NAME = re.compile(r"\d+")


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """How the latest checkpoint of a run was trained."""

    step: int
    global_batch: int
    devices: int
    processes: int
    accumulation: int


def saved_layout(checkpoint_dir: str) -> SavedLayout | None:
    """The layout of the newest step in `checkpoint_dir` whose config item reads, or None (no checkpoint).

    Steps saved halfway are named `<step>.orbax-checkpoint-tmp-*` and damaged ones `<step>.damaged`: neither is a
    step name. Every step of a run has the same global batch unless it was changed on purpose, so the newest wins."""
    directory = epath.Path(checkpoint_dir)
    if not directory.is_dir():
        return None
    steps = sorted((int(p.name) for p in directory.iterdir() if _STEP_NAME.fullmatch(p.name)), reverse=True)
    for step in steps:
        saved = checkpoint_format.read_config_or_none(directory / str(step))
        if saved is not None:
            return SavedLayout(step, int(saved["global_batch_size"]), int(saved["num_devices"]),
                               int(saved.get("num_processes", 1)), int(saved.get("gradient_accumulation_steps", 1)))
    return None


def keep_global_batch(cfg: Config, saved: SavedLayout) -> Config | None:
    """`cfg` with the checkpoint's global batch (per-device batch derived again), None when nothing must change;
    ConfigError (one line) where the run must not resume as asked."""
    moved = (saved.devices, saved.processes) != (cfg.num_devices, cfg.num_processes)
    if moved and not cfg.elastic:
        raise ConfigError(f"checkpoint step {saved.step} was trained on {_layout(saved.devices, saved.processes)}, "
                          f"this run has {_layout(cfg.num_devices, cfg.num_processes)} and elastic=false; set "
                          "elastic=true to resume with the same global batch")
    if cfg.global_batch_size == saved.global_batch:
        return None
    explicit = "per_device_batch_size" in cfg.explicit_keys
    if explicit or not cfg.elastic:  # the user asked for this batch: change it only when told it may change
        if cfg.elastic_allow_batch_change:
            return None
        hint = "drop it (the batch is derived again)" if explicit else "set elastic=true to keep the checkpoint's"
        raise ConfigError(
            f"per_device_batch_size={cfg.per_device_batch_size:g} makes a global batch of {cfg.global_batch_size}, "
            f"but checkpoint step {saved.step} was trained with {saved.global_batch}; {hint} or set "
            "elastic_allow_batch_change=true")
    return dataclasses.replace(cfg, per_device_batch_size=saved.global_batch / cfg.num_devices,
                               global_batch_size=saved.global_batch)


def accumulation_choices(cfg: Config) -> Iterator[Config]:
    """`cfg` with the accumulation steps to try, fewest first: the configured count, then doubled while it divides
    the global batch (the caller keeps the first whose planned peak fits the devices). An explicit
    `gradient_accumulation_steps` is the only choice."""
    steps = cfg.gradient_accumulation_steps
    yield cfg
    if "gradient_accumulation_steps" in cfg.explicit_keys:
        return
    while cfg.global_batch_size % (steps * 2) == 0:
        steps *= 2
        yield dataclasses.replace(cfg, gradient_accumulation_steps=steps)


def changed(cfg: Config, saved: SavedLayout) -> bool:
    """Whether `cfg` runs the checkpoint's steps on another layout or batch split (then `describe` says how)."""
    now = (cfg.num_devices, cfg.num_processes, cfg.global_batch_size, cfg.gradient_accumulation_steps)
    return now != (saved.devices, saved.processes, saved.global_batch, saved.accumulation)


def describe(cfg: Config, saved: SavedLayout) -> str:
    """The one line a resumed run prints when its layout or batch split differs from its checkpoint's."""
    was = f"{saved.devices}" if saved.processes == cfg.num_processes else _layout(saved.devices, saved.processes)
    now = f"{cfg.num_devices} devices" if saved.processes == cfg.num_processes else _layout(cfg.num_devices,
                                                                                          cfg.num_processes)
    line = (f"resuming step {saved.step} on {now} (was {was}): per-device batch {cfg.per_device_batch_size:g}, "
            f"accumulation {cfg.gradient_accumulation_steps}")
    if cfg.global_batch_size != saved.global_batch:
        line += f"; global batch {cfg.global_batch_size} (was {saved.global_batch}, elastic_allow_batch_change)"
    return line


def _layout(devices: int, processes: int) -> str:
    return f"{devices} devices in {processes} process{'es' if processes > 1 else ''}"
