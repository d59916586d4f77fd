"""A run's trained parameters for generation: find the checkpoint, take the model from it, restore params only.

The checkpoint's `config` item is the Config that trained it, so the model keys (dimensions, vocabulary, MoE shape,
scan_layers, ...) and the tokenizer come from there: the command line that trained a run samples from it, and
generation never needs the training command's model flags. A key named on the generation command line wins (say
`dtype=bfloat16`); one that changes a shape fails with the checkpoint's one-line mismatch error.

A LoRA run's checkpoint holds its adapters; the frozen base comes from the `load_parameters_path` its config names.
Only `params` are read from the `state` item (orbax partial restore), directly onto the generation mesh with the
generation layout's shardings: the optimizer moments (twice the parameters' bytes) are never loaded. Generation
runs unpipelined; a checkpoint written by a pipelined run ([repeats, stages, layers per stage, ...] stacks) is
read into the scanned layout, which holds the same weights (`checkpoint/layout.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
from etils import epath
from jax.sharding import Mesh

from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint import params as checkpoint_params
from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.model import trainable
from maxshard.spec.model_config import model_fields
from maxshard.model.transformer import abstract_params
from maxshard.parallel import sharding
from maxshard.run import loading

__all__ = ["find_checkpoint", "with_saved_model", "refuse_pipeline", "restore_params"]

_FROM_CHECKPOINT = (*model_fields(), "tokenizer_path")  # what defines the network and its token ids


def find_checkpoint(cfg: Config) -> str:
    """`load_parameters_path`, else the latest committed step of this run (base_output_directory/run_name). A LoRA
    run's load_parameters_path is its frozen base: its own latest step (the adapters) is what it samples from.
    It may also be a LoRA step the run started from (imported PEFT adapters, another run's): that step, unless
    this run has trained on from it, whose latest step is then what the training command samples."""
    path = cfg.load_parameters_path
    if path:
        checkpoint_params.step_state_dir(path, "load_parameters_path")
        if not cfg.lora_rank:
            return path
        if checkpoint_format.read_config(path).get("lora_rank"):
            own = _latest_step(cfg)
            started_here = own and checkpoint_format.saved_config(own).get("load_parameters_path") == path
            return own if started_here else path
    own = _latest_step(cfg)
    if not own:
        raise ConfigError(f"no checkpoint in {cfg.checkpoint_dir}: train run_name={cfg.run_name} first (python -m "
                          "maxshard.train with the same arguments) or set load_parameters_path to a step")
    return own


def _latest_step(cfg: Config) -> str:
    """The latest step directory of this run's checkpoint_dir, '' when it has none."""
    directory = epath.Path(cfg.checkpoint_dir)
    steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.exists() else []
    return str(directory / str(max(steps))) if steps else ""


def with_saved_model(cfg: Config, saved: dict[str, Any], command_line_wins: bool = True) -> Config:
    """`cfg` with the model keys and tokenizer of the checkpoint's config, except keys given on the command line
    (unless not `command_line_wins`: another model's checkpoint, GRPO's reward model, takes all of its own)."""
    given = cfg.explicit_keys if command_line_wins else ()
    keys = [key for key in _FROM_CHECKPOINT if key in saved and key not in given]
    changes = {key: _from_json(saved[key]) for key in keys}
    return loading.replace(cfg, **changes)


def _from_json(value: Any) -> Any:
    """A config value as JSON stored it, back in the Config's types: JSON has lists where the Config has tuples
    (lora_targets), and a Config must stay hashable."""
    return tuple(value) if isinstance(value, list) else value


def refuse_pipeline(cfg: Config) -> None:
    """Generation runs no pipeline: one line naming the knobs, before anything is built."""
    knobs = {key: getattr(cfg, key) for key in ("ici_pipeline_parallelism", "dcn_pipeline_parallelism")}
    if any(value != 1 for value in knobs.values()):
        shown = " ".join(f"{key}={value}" for key, value in knobs.items())
        raise ConfigError(f"generation runs unpipelined, got {shown}: set both to 1 (a pipelined run's checkpoint "
                          "loads unpipelined)")


def restore_params(step_dir: str, cfg: Config, mesh: Mesh, rules: sharding.FlaxRules, base_path: str = "") -> Any:
    """The checkpoint's params on `mesh`, laid out for the (unpipelined) model of `cfg`. A LoRA run's checkpoint
    holds its adapters; their frozen base is read from `base_path` (the run's load_parameters_path)."""
    model = dataclasses.replace(cfg.model, pipeline=None)
    boxed = abstract_params(model)
    shardings = sharding.tree_shardings(boxed, mesh, rules)
    target = jax.tree.map(lambda b, s: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=s), nn.unbox(boxed), shardings)
    trained = trainable.saved_subset(target, model)
    state_dir = epath.Path(step_dir) / checkpoint_format.STATE
    params = checkpoint_params.read_params(state_dir, trained, f"checkpoint {step_dir}")
    if trainable.trains_everything(model):
        return params
    if not base_path:
        raise ConfigError(f"{step_dir} holds LoRA adapters (lora_rank={model.lora_rank}) but its config names no "
                          "load_parameters_path for their base")
    where = f"the LoRA base load_parameters_path={base_path} of {step_dir}"
    return trainable.merge(params, checkpoint_params.read_base(base_path, target, model, where))
