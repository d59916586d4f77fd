"""Parameters out of checkpoint step directories: whole, or a LoRA run's adapters and the frozen base under them.

A LoRA run's checkpoint holds its trained part only (`saved_part`: adapters, their moments, the step); the base
lives in the checkpoint its `load_parameters_path` names, is read again on every start (`with_base`), and must be
the base the adapters were trained on (`check_same_base`). Training (checkpoint.py), generation (inference.py) read
parameters through here.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import orbax.checkpoint as ocp
from etils import epath

from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint import layout as checkpoint_layout
from maxshard.checkpoint.layout import check_matches
from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.model import trainable
from maxshard.spec.model_config import ModelConfig
from maxshard.training.step import Trainer, TrainState

__all__ = ["target_state", "step_state_dir", "read_params", "saved_part", "with_base", "read_base",
           "read_start_adapters", "check_same_base", "require_base", "LORA_KEYS"]


def target_state(trainer: Trainer) -> TrainState:
    """Shapes and dtypes of this model with the shardings of this mesh: restoring onto it reshards on load."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        nn.unbox(trainer.abstract_state),
        trainer.state_shardings,
    )


def saved_part(state: TrainState, trainer: Trainer) -> TrainState:
    """What a checkpoint holds of `state` (or of its abstract target): all of it, or with LoRA the adapters (and
    what the step moves: MoE selection biases), their optimizer moments and the step; the frozen base would repeat
    `load_parameters_path` at every save."""
    return state.replace(params=trainable.saved_subset(state.params, trainer.cfg.model))


def with_base(state: TrainState, trainer: Trainer) -> TrainState:
    """A state read from a checkpoint (`saved_part`) made whole: with LoRA the frozen base joins it, read from the
    run's `load_parameters_path` onto this mesh (the checkpoint's moved biases win over the base's)."""
    cfg = trainer.cfg
    if trainable.trains_everything(cfg.model):
        return state
    base = read_base(cfg.load_parameters_path, target_state(trainer).params, cfg.model)
    return state.replace(params=trainable.merge(state.params, base))


def read_base(path: str, target_params: Any, model: ModelConfig, where: str = "") -> Any:
    """The frozen parameters of a LoRA model (every parameter of `target_params` but the adapters) from the
    checkpoint `path`, or for a LoRA step (adapters only) from the whole model under it (its base)."""
    where = where or f"load_parameters_path={path}"
    step_state_dir(path, "load_parameters_path")
    base = checkpoint_format.whole_model_under(path)
    if base != path:
        where = f"{where} (the base {base} of its adapters)"
    return read_params(step_state_dir(base, "load_parameters_path"), trainable.frozen_subset(target_params, model),
                       where)


LORA_KEYS = ("lora_rank", "lora_alpha", "lora_targets")


def read_start_adapters(cfg: Config, target_params: Any) -> Any:
    """A fresh LoRA run's starting adapters: those of `load_parameters_path` when it is a LoRA step (another run's,
    or PEFT's imported by `from_hf --adapters`), {} for a whole model (the adapters are then drawn fresh). The run's
    LoRA keys must be the step's: one line naming the first that differs."""
    path = cfg.load_parameters_path
    saved = checkpoint_format.saved_config(path)
    if not saved.get("lora_rank"):
        return {}
    for key in LORA_KEYS:
        mine, theirs = getattr(cfg, key), saved.get(key)
        same = (set(mine) == set(theirs or ())) if key == "lora_targets" else mine == theirs
        if not same:
            shown = list(theirs) if isinstance(theirs, (list, tuple)) else theirs
            raise ConfigError(f"{key}={list(mine) if key == 'lora_targets' else mine}: the adapters of "
                              f"load_parameters_path={path} have {key}={shown}; start from them with their "
                              f"{', '.join(LORA_KEYS)}, or from their base {saved.get('load_parameters_path')} "
                              "with fresh adapters")
    adapters = trainable.saved_subset(target_params, cfg.model)
    return read_params(step_state_dir(path, "load_parameters_path"), adapters, f"load_parameters_path={path}")


def check_same_base(cfg: Config, step_dir: epath.Path) -> None:
    """A LoRA run resumes its adapters on the base they were trained on: the step's config names it."""
    if trainable.trains_everything(cfg.model):
        return
    saved = checkpoint_format.saved_config(step_dir).get("load_parameters_path")
    if saved and saved != cfg.load_parameters_path:
        raise ConfigError(f"load_parameters_path={cfg.load_parameters_path}: the LoRA adapters in {step_dir} were "
                          f"trained on {saved}; resume with that base (or start a new run_name)")


def require_base(cfg: Config) -> None:
    """LoRA trains adapters on a frozen base: without one it would fine-tune random weights. One line, before any
    checkpoint is read or the step compiled."""
    if trainable.trains_everything(cfg.model):
        return
    if not cfg.load_parameters_path:
        raise ConfigError(f"lora_rank={cfg.lora_rank} trains adapters on a frozen base: set load_parameters_path "
                          "to its checkpoint step directory (e.g. the parameters `python -m maxshard.convert "
                          "from_hf` wrote)")
    if cfg.load_full_state_path:
        raise ConfigError("load_full_state_path is not supported with lora_rank > 0: resume a LoRA run from its own "
                          "checkpoint_dir, or start it again from load_parameters_path")


def step_state_dir(path: str, key: str) -> epath.Path:
    found = epath.Path(path) / checkpoint_format.STATE
    if not found.exists():
        raise ConfigError(f"{key}={path} is not a checkpoint step directory (no state/ in it; e.g. "
                          "runs/NAME/checkpoints/100)")
    return found


def read_params(state_dir: epath.Path, target_params: Any, where: str) -> Any:
    """Only the params of a checkpoint's state item (the optimizer moments are never read), onto `target_params`
    (abstract arrays with shardings), whatever layout wrote them."""
    target = {"params": target_params}
    saved = {"params": ocp.PyTreeCheckpointHandler().metadata(state_dir).tree["params"]}
    check_matches(saved, target, where)
    read = checkpoint_layout.read_target(saved, target) if checkpoint_layout.needs_relayout(saved, target) else target
    args = ocp.args.PyTreeRestore(item=read, restore_args=ocp.checkpoint_utils.construct_restore_args(read),
                                  partial_restore=True)
    return checkpoint_layout.relayout(ocp.PyTreeCheckpointer().restore(state_dir, args=args), target)["params"]
