"""The train step compiled from abstract inputs: what the planner is checked against, with nothing allocated.

`compile_train_step` lowers the trainer's own jitted step from `jax.ShapeDtypeStruct`s that carry the state's and
the batch's shardings, and compiles it for the given mesh; `memory_analysis()` and `as_text()` of the result are
exact per-device figures of the real program. Only HLO passes matter for these figures, so code generation runs
at the lowest effort. `peak_bytes` is the one definition of a compiled step's per-device peak (the trainer's
compile check, `maxshard.plan` and the benchmarks read it), and `StepMemory` splits that peak into what holds it:
the state and the batch, exact from their shardings (a shard's elements x its dtype), and XLA's temporaries.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard import data
from maxshard.config import Config
from maxshard.training.step import Trainer

__all__ = ["StepMemory", "abstract_inputs", "compile_init", "compile_train_step", "compile_step_memory",
           "peak_bytes", "shard_bytes"]

_FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """A compiled train step's per-device peak (`peak_bytes`), split into what holds it. The state's and the batch's
    bytes are those of their shards; `temporaries` is XLA's (`temp_size_in_bytes`: the gradients, the activations
    and every working buffer, which the compiler overlaps as it schedules them, so no finer split is exact);
    `other` is the rest of the peak: outputs not donated into the state (the metrics) and any layout padding of
    the arguments (TPU tiles)."""

    params: int
    optimizer: int  # the optimizer's moments and the step counter
    reference: int  # a frozen reference model's parameters (0: the objective keeps none)
    batch: int
    temporaries: int
    peak: int
    host: int = 0  # host memory buffers per device (what an offload policy moves there; not in the peak)

    @property
    def other(self) -> int:
        return self.peak - self.params - self.optimizer - self.reference - self.batch - self.temporaries

    def as_json(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "other": self.other}


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded `jax.ShapeDtypeStruct`s: each leaf's shard (the largest device's,
    as a sharding's shards are equal or padded) x its dtype."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(tree))


def abstract_inputs(trainer: Trainer, batch_sharding: jax.sharding.NamedSharding) -> tuple[Any, Any]:
    """(state, batch) of the train step as `jax.ShapeDtypeStruct`s with their shardings: nothing allocated."""
    cfg = trainer.cfg
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         nn.unbox(trainer.abstract_state), trainer.state_shardings)
    shape = (cfg.global_batch_size, cfg.max_target_length)
    fields = trainer.batch_fields
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=batch_sharding) for k, dtype in fields.items()}
    return state, batch


def _compiled(cfg: Config, mesh: jax.sharding.Mesh, options: dict[str, Any] | None) -> tuple[Any, Any, Any]:
    """(the compiled train step, its abstract state, its abstract batch)."""
    trainer = Trainer(cfg, mesh)
    batch_sharding = data.batch_sharding(cfg, trainer.mesh)
    state, batch = abstract_inputs(trainer, batch_sharding)
    compiled = trainer.jit_train_step(batch_sharding).lower(state, batch).compile({**_FAST, **(options or {})})
    return compiled, state, batch


def compile_train_step(cfg: Config, mesh: jax.sharding.Mesh, options: dict[str, Any] | None = None) -> Any:
    """The compiled train step of `cfg` on `mesh`, lowered from abstract sharded state and batch; `options`: more
    compile options (XLA's dumps: planning/buffer_dump.py)."""
    return _compiled(cfg, mesh, options)[0]


def compile_step_memory(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[Any, StepMemory]:
    """(the compiled train step of `cfg` on `mesh`, its per-device peak split by what holds it)."""
    compiled, state, batch = _compiled(cfg, mesh, None)
    stats = compiled.memory_analysis()
    split = StepMemory(params=shard_bytes(state.params), optimizer=shard_bytes((state.opt_state, state.step)),
                       reference=shard_bytes(state.reference), batch=shard_bytes(batch),
                       temporaries=stats.temp_size_in_bytes, peak=peak_bytes(stats),
                       host=stats.host_temp_size_in_bytes)
    return compiled, split


def compile_init(cfg: Config, mesh: jax.sharding.Mesh) -> Any:
    """The compiled fresh-run init of `cfg` on `mesh` (`Trainer.jit_init`), lowered from an abstract key."""
    key = jax.eval_shape(lambda: jax.random.key(0))
    return Trainer(cfg, mesh).jit_init().lower(key).compile(_FAST)


def peak_bytes(stats: Any) -> int:
    """Per-device peak of a compiled step from its `memory_analysis()`: arguments + temporaries + outputs, less
    the donated state its outputs update in place (aliased)."""
    return (stats.argument_size_in_bytes + stats.temp_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes)
