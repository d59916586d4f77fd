"""What a maxshard checkpoint step directory holds, in one place: its item names and its config item.

A step directory `<checkpoint_dir>/<step>/` has three orbax items: `state` (the train state, or a LoRA run's
adapters and their moments), `data` (every process's input position) and `config` (the run's Config as JSON, so
generation, conversion and an elastic resume read the model keys and the layout that trained it). A fourth, `batch`,
is there only when the next step trains on the batch the last one did (GRPO between the updates of one rollout):
that batch's arrays, sharded as the train batch, since nothing else could make it again. The trainer,
the converter (`from_hf` writes a step of its own) and every reader go through here, so the names and the JSON
form cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from etils import epath

from maxshard.errors import ConfigError

__all__ = ["STATE", "DATA", "CONFIG", "BATCH", "ITEMS", "config_json", "write_config", "saved_config", "read_config",
           "read_config_or_none", "whole_model_under"]

STATE, DATA, CONFIG = "state", "data", "config"
ITEMS = (STATE, DATA, CONFIG)
BATCH = "batch"  # optional item; also the input state's key that holds it (manager.py)


def config_json(cfg: Any) -> dict[str, Any]:
    """A Config as the JSON a step stores (values JSON lacks, such as dtypes, as text)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def write_config(step_dir: epath.PathLike, cfg: Any) -> None:
    """The config item of a step written outside a CheckpointManager (a converted model's step)."""
    import orbax.checkpoint as ocp  # deferred: loading a run's config must not import orbax

    item = epath.Path(step_dir) / CONFIG
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(item, args=ocp.args.JsonSave(config_json(cfg)))


def saved_config(step_dir: epath.PathLike) -> dict[str, Any]:
    """The saved Config (as JSON) of a step, {} when the step has no config item; one ConfigError line when it has
    one that does not read (a damaged step must not pass for one without a config: LoRA's base checks read it). The
    error keeps its cause, so a resume still tells damage (`health.outcome_of`) and sets the step aside."""
    import orbax.checkpoint as ocp  # deferred: loading a run's config must not import orbax

    item = epath.Path(step_dir) / CONFIG
    if not item.exists():
        return {}
    try:
        return ocp.JsonCheckpointHandler().restore(item)
    except (OSError, ValueError) as e:
        cause = (str(e).splitlines() or [""])[0]
        raise ConfigError(f"{step_dir}: its {CONFIG} item does not read ({type(e).__name__}: {cause})") from e


def read_config(step_dir: epath.PathLike) -> dict[str, Any]:
    """The saved Config (as JSON) of a step directory; ConfigError (one line) when it is not a maxshard step or its
    config item does not read."""
    saved = saved_config(step_dir)
    if not saved or not (epath.Path(step_dir) / STATE).exists():
        raise ConfigError(f"{step_dir} is not a maxshard checkpoint step directory (it needs {STATE}/ and {CONFIG}/)")
    return saved


def read_config_or_none(step_dir: epath.PathLike) -> dict[str, Any] | None:
    """The saved Config of a step, or None where the step has no readable config item (a step saved halfway, a
    damaged one): for the elastic resume, which walks back past such a step."""
    if not (epath.Path(step_dir) / CONFIG / "metadata").exists():
        return None
    try:
        return saved_config(step_dir)
    except ConfigError:
        return None


def whole_model_under(step_dir: str) -> str:
    """The step holding a whole model under `step_dir`: itself, or for a LoRA step (lora_rank > 0: adapters only)
    the base its config names, followed while that is a LoRA step too (a run that started from another run's
    adapters, or from PEFT adapters `from_hf --adapters` imported). One line when the chain breaks or loops."""
    seen = [step_dir]
    saved = saved_config(step_dir)
    while saved.get("lora_rank"):
        base = saved.get("load_parameters_path") or ""
        if not base or base in seen or len(seen) > 64 or not (epath.Path(base) / STATE).exists():
            raise ConfigError(f"{seen[-1]} holds LoRA adapters whose base load_parameters_path={base!r} is not a "
                              "checkpoint step directory here")
        seen.append(base)
        saved = saved_config(base)
    return seen[-1]
