"""The train step compiled from abstract inputs: what the planner is checked against, with nothing allocated.

`compile_train_step` lowers the trainer's own jitted step from `jax.ShapeDtypeStruct`s that carry the state's and
the batch's shardings, and compiles it for the given mesh; `memory_analysis()` and `as_text()` of the result are
exact per-device figures of the real program. Only HLO passes matter for these figures, so code generation runs
at the lowest effort. `peak_bytes` is the one definition of a compiled step's per-device peak.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard import data
from maxshard.config import Config
from maxshard.training.step import Trainer

__all__ = ["abstract_inputs", "compile_init", "compile_train_step", "peak_bytes"]

_FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def abstract_inputs(trainer: Trainer, batch_sharding: jax.sharding.NamedSharding) -> tuple[Any, Any]:
    """(state, batch) of the train step as `jax.ShapeDtypeStruct`s with their shardings: nothing allocated."""
    cfg = trainer.cfg
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         nn.unbox(trainer.abstract_state), trainer.state_shardings)
    shape = (cfg.global_batch_size, cfg.max_target_length)
    fields = trainer.batch_fields
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=batch_sharding) for k, dtype in fields.items()}
    return state, batch


def compile_train_step(cfg: Config, mesh: jax.sharding.Mesh, options: dict[str, Any] | None = None) -> Any:
    """The compiled train step of `cfg` on `mesh`, lowered from abstract sharded state and batch; `options`: more
    compile options (XLA's dumps: planning/buffer_dump.py)."""
    trainer = Trainer(cfg, mesh)
    batch_sharding = data.batch_sharding(cfg, trainer.mesh)
    lowered = trainer.jit_train_step(batch_sharding).lower(*abstract_inputs(trainer, batch_sharding))
    return lowered.compile({**_FAST, **(options or {})})


def compile_init(cfg: Config, mesh: jax.sharding.Mesh) -> Any:
    """The compiled fresh-run init of `cfg` on `mesh` (`Trainer.jit_init`), lowered from an abstract key."""
    key = jax.eval_shape(lambda: jax.random.key(0))
    return Trainer(cfg, mesh).jit_init().lower(key).compile(_FAST)


def peak_bytes(stats: Any) -> int:
    """Per-device peak of a compiled step from its `memory_analysis()`: arguments + temporaries + outputs, less
    the donated state its outputs update in place (aliased)."""
    return (stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes)
