"""Pipeline parallelism over the `stage` mesh axis: the mechanics that run a schedule (spec/pipeline_schedule.py).

Knobs: S stages (the `stage` mesh axis, ici_pipeline_parallelism x dcn_pipeline_parallelism), L layers per stage
(`num_layers_per_pipeline_stage`), R repeats (`num_pipeline_repeats`), M microbatches (`num_pipeline_microbatches`).
Layer r*S*L + s*L + l lives on stage s in repeat r, so the pipelined model computes exactly the non-pipelined
function: a microbatch walks stages 0..S-1 (layers 0..S*L-1), wraps from the last stage back to the first, walks
them again with the next repeat's weights (layers S*L..2*S*L-1), and so on R times. (For MoE models a "layer" is
the stacked unit, `moe_layer_interval` layers.) Which microbatch and repeat each stage runs at each iteration, which
stage-iterations are bubbles and how many iterations there are is the schedule's (`pipeline_schedule.of(shape)`,
whose docstring works an example through); this module asks it and computes none of it.

Weights. Every kernel of the stack is created as [R, S, L, ...] with logical names
("circular_repeats", "layers", "layers_per_stage", ...): "layers" maps to the `stage` mesh axis, so each stage's
devices hold only their own layers; the other dimensions keep their usual sharding (fsdp, tensor, expert).

One iteration t (everything is [stages, ...], sharded over `stage` with ("activation_stage", ...)):
  1. the last stage's output of iteration t-1, which the shift already moved to slot 0, is stored in the
     circulation buffer [stages, M, microbatch, length, embed] at the index of the microbatch the schedule gave
     the last stage at t-1 (nothing when that was a bubble; only slot 0 is used; every stage keeps a slot because
     SPMD programs are uniform, and a device holds the same M microbatches that stage 0 needs anyway, the local
     share of the layer input of a non-pipelined model);
  2. stage 0 reads the microbatch the schedule gives it from that buffer (the input for repeat 0, the wrapped
     activation afterwards); the other stages take what the shift delivered; stages in a bubble get zeros, so
     whatever sits in a bubble slot (the test fills them with NaN) reaches neither the outputs nor, through
     0 x NaN, the gradients;
  3. every stage runs its L layers with the weights of the repeat the schedule gives it (vmapped over the stage
     dimension);
  4. the shift: `jnp.roll(out, 1, axis=0)` on the stage-sharded dimension.

Stages may span slices (`dcn_pipeline_parallelism`): the shift is then the only per-iteration traffic over DCN, one
microbatch activation per stage, while fsdp/tensor traffic stays inside each slice.

Why `jnp.roll` and not `ppermute` in `shard_map`: XLA's SPMD partitioner turns a roll of a dimension sharded over
`stage` into one collective permute over `stage` (the same communication), while everything else stays in the
automatically partitioned program, so fsdp/tensor/expert/data sharding of the other dimensions, remat and gradient
accumulation compose without restating every axis in shard_map's in/out specs. The segment ids and positions of a
microbatch travel with it by indexing: each stage reads those of the microbatch the schedule gives it, from a copy
that every stage holds (two small int arrays, no communication).

Sown values. What the layers sow into "intermediates" (MoE router statistics) is returned for the M x R x S
stage-iterations that hold a microbatch (the schedule's `slots`), never for bubbles, stacked [repeats, microbatches,
stages, layers_per_stage, ...] under the pipeline's "stages" entry; statistics become per (layer, microbatch), the
same per-microbatch semantics as gradient accumulation.

Remat. Each iteration's stage computation (weight selection included) is one `jax.checkpoint` with the
`remat_policy`: the backward pass keeps the iteration's stage input [stages, microbatch, length, embed] plus what the
policy saves, and never a per-iteration copy of the weights; layers inside a stage are not checkpointed again.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.spec import pipeline_schedule
from maxshard.spec.model_config import ModelConfig, PipelineShape
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import axes_of, constrain

__all__ = ["to_scanned", "from_scanned", "Pipeline"]

_SOWN = "intermediates"  # collection the layers sow into (MoE router statistics); carried out for valid slots
# The circulating stage inputs are the residual stream, split as the decoder splits it (layers/decoder.py), so
# under tensor_sequence a stage hop moves each device's piece instead of gathering the stream: ax.PIPELINE_STATE,
# [stages, microbatch, length, embed], and the buffer of microbatches:
_BUFFER_AXES = (ax.ACT_STAGE, None, ax.BATCH, ax.NORM_LENGTH, ax.ACT_EMBED)  # [stages, M, microbatch, length, embed]


# --------------------------------------------------------------------------------------------- parameter layout


_PIPELINE_LEAD = (ax.CIRCULAR_REPEATS, ax.LAYERS, ax.LAYERS_PER_STAGE)


def _map_stacked(fn: Any, tree: Any, names: Any) -> Any:
    """`fn` on every array of a stack; a leaf boxed with logical names (nn.Partitioned) keeps its box, renamed by
    `names(old_names)`, so the same conversion serves plain arrays and boxed init trees."""

    def leaf(w: Any) -> Any:
        if isinstance(w, nn.Partitioned):
            return w.replace(value=fn(w.value), names=names(w.names))
        return fn(w)

    return jax.tree.map(leaf, tree, is_leaf=lambda w: isinstance(w, nn.Partitioned))


def to_scanned(params: Any) -> Any:
    """Pipelined params (decoder/pipeline/layers: [R, S, L, ...]) -> scanned ones (decoder/layers: [R*S*L, ...]).

    Layer r*S*L + s*L + l is entry [r, s, l], so this is a reshape: checkpoints convert both ways losslessly.
    """
    decoder = dict(params["decoder"])
    stacked = decoder.pop("pipeline")["layers"]
    decoder["layers"] = _map_stacked(lambda w: w.reshape(-1, *w.shape[3:]), stacked,
                                     lambda names: (ax.LAYERS, *names[3:]))
    return {**params, "decoder": decoder}


def from_scanned(params: Any, shape: PipelineShape) -> Any:
    """Inverse of `to_scanned`, for a pipeline of `shape`."""
    lead = (shape.repeats, shape.stages, shape.layers_per_stage)
    decoder = dict(params["decoder"])
    flat = decoder.pop("layers")
    decoder["pipeline"] = {"layers": _map_stacked(lambda w: w.reshape(*lead, *w.shape[1:]), flat,
                                                  lambda names: (*_PIPELINE_LEAD, *names[1:]))}
    return {**params, "decoder": decoder}


# --------------------------------------------------------------------------------------------- iterations


def _split(x: jax.Array, m: int) -> jax.Array:
    """[batch, ...] -> [m, batch/m, ...]; microbatch i holds rows i, i+m, i+2m, ... (like gradient accumulation)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _merge(x: jax.Array) -> jax.Array:
    """Inverse of `_split`: [m, batch/m, ...] -> [batch, ...]."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def _store_finished(buffer: jax.Array, state: jax.Array, t: jax.Array,
                    schedule: pipeline_schedule.Schedule) -> jax.Array:
    """Step 1: after the shift, slot 0 of `state` holds what the last stage computed at iteration t-1; keep it at
    its microbatch index until stage 0 needs it again (or until the end), unless that was a bubble."""
    microbatch, _, valid = schedule.assignment(t - 1)
    index = microbatch[-1]
    old = jax.lax.dynamic_index_in_dim(buffer, index, axis=1, keepdims=False)  # [stages, mb, length, embed]
    new = jnp.where(valid[-1], state, old)
    return jax.lax.dynamic_update_index_in_dim(buffer, new, index, axis=1)


def _stage_inputs(buffer: jax.Array, state: jax.Array, microbatch: jax.Array) -> jax.Array:
    """Step 2: stage 0 reads its microbatch from the buffer, the others what the shift brought (bubbles are
    zeroed inside the checkpoint, `_zero_bubbles`)."""
    fresh = jax.lax.dynamic_index_in_dim(buffer, microbatch[0], axis=1, keepdims=False)  # [stages, mb, len, embed]
    first = (jnp.arange(state.shape[0]) == 0)[:, None, None, None]  # a constant: no per-iteration residual
    return jnp.where(first, fresh, state)


def _finished(buffer: jax.Array) -> jax.Array:
    """[stages, M, mb, length, embed] -> [M, mb, length, embed]: stage 0's slot, where the finished microbatches
    are kept, as a sum over the stages with the others' slots masked to zero (exact). Taken as `buffer[0]`, XLA's
    partitioner sent stage 0's whole slot to every stage before cutting it to the batch's sharding: the whole
    batch's output live on every device; as a sum, only stage 0's term is nonzero and XLA sends each stage its own
    share (collective permutes of M / S microbatches; tests/test_pipeline_tpu.py; what it saves: benchmarks/README.md,
    "Pipeline schedules: in-flight activations")."""
    first = (jnp.arange(buffer.shape[0]) == 0)[:, None, None, None, None]
    return jnp.sum(jnp.where(first, buffer, jnp.zeros_like(buffer)), axis=0)


def _zero_bubbles(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Stages in a bubble get zeros. Called inside the iteration's checkpoint: outside it the backward would keep
    the mask broadcast to the stage input's shape for every iteration (a bool per element, half a bf16 stage input
    per iteration; benchmarks/README.md, "Pipeline schedules: in-flight activations"); inside, the checkpoint
    keeps `valid` [stages] and broadcasts it again in the backward."""
    return jnp.where(valid[:, None, None, None], x, jnp.zeros_like(x))


def _select_repeat(leaf: jax.Array, repeat: jax.Array) -> jax.Array:
    """[R, S, ...] -> [S, ...]: stage s takes the weights of its current repeat (a local gather per stage)."""
    if leaf.shape[0] == 1:
        return leaf[0]
    pick = lambda w, r: jax.lax.dynamic_index_in_dim(w, r, axis=0, keepdims=False)  # noqa: E731
    return jax.vmap(pick, in_axes=(1, 0))(leaf, repeat)


def _stage_mesh_axes() -> tuple[str, ...] | None:
    """Mesh axes of the stage dimension of ax.PIPELINE_STATE under the active rules: vmap over stages must keep
    that dimension sharded (without `spmd_axis_name` the layers' sharding constraints would replicate it)."""
    rules = nn.get_logical_axis_rules()
    return (axes_of(ax.ACT_STAGE, ax.PIPELINE_STATE, rules) or None) if rules else None


# --------------------------------------------------------------------------------------------- the module


def _scanned(unit: type[nn.Module], length: int, axis_name: str) -> type[nn.Module]:
    """`unit` applied `length` times in a row; its params gain a leading `axis_name` axis of that size."""
    return nn.scan(
        unit,
        variable_axes={"params": 0, "intermediates": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast),
        length=length,
        metadata_params={nn.PARTITION_NAME: axis_name},
    )


def _stage_class(unit: type[nn.Module], layers_per_stage: int) -> type[nn.Module]:
    """One stage: `unit` scanned `layers_per_stage` times; params [L, ...]."""
    return _scanned(unit, layers_per_stage, ax.LAYERS_PER_STAGE)


def _stacked_class(unit: type[nn.Module], shape: PipelineShape) -> type[nn.Module]:
    """All layers in model order (repeat, stage, layer), only to create the weights [R, S, L, ...] in their final
    layout. Nested scans rather than vmaps: XLA compiles a loop of initialisers about twice as fast."""
    per_repeat = _scanned(_stage_class(unit, shape.layers_per_stage), shape.stages, ax.LAYERS)
    return _scanned(per_repeat, shape.repeats, ax.CIRCULAR_REPEATS)


class Pipeline(nn.Module):
    """The decoder stack as a pipeline (see the module docstring); params under "layers": [R, S, L, ...].

    Attributes:
      unit: the stacked module, called as unit(cfg, dtype, weight_dtype)(x, segment_ids, positions) -> (x, _).
      policy: the `jax.checkpoint` policy of the remat_policy (None: save only each iteration's input).
      bubble_fill: value of the stage slots before the first microbatch arrives (tests fill them with NaN).
    """

    cfg: ModelConfig
    unit: type[nn.Module]
    dtype: jnp.dtype
    weight_dtype: jnp.dtype
    policy: Any = None
    bubble_fill: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        shape = self.cfg.pipeline
        stack = _stacked_class(self.unit, shape)(self.cfg, self.dtype, self.weight_dtype, name="layers")
        if self.is_initializing():  # init only creates the weights; one microbatch row is enough for shapes
            stack(x[:1], segment_ids[:1], positions[:1])
            return x
        if x.shape[0] % shape.microbatches:  # the loader checks the run's batch; this guards direct callers
            raise ValueError(f"a batch of {x.shape[0]} does not split into {shape.microbatches} microbatches")
        weights = nn.unbox(self.variables["params"]["layers"])
        collect = self.is_mutable_collection(_SOWN)
        y, sown = self._run(weights, x, segment_ids, positions, shape, collect)
        if collect and sown:
            self.put_variable(_SOWN, "stages", sown)
        return y

    def _run(self, weights: Any, x: jax.Array, segment_ids: jax.Array, positions: jax.Array,
             shape: PipelineShape, collect: bool) -> tuple[jax.Array, Any]:
        """x [batch, length, embed] -> ([batch, length, embed] through all R*S*L layers, what the layers sowed)."""
        m, schedule = shape.microbatches, pipeline_schedule.circular_of(shape)
        inputs = _split(x, m)  # [M, mb, length, embed]
        segments, positions = _split(segment_ids, m), _split(positions, m)  # [M, mb, length]
        buffer = constrain(jnp.broadcast_to(inputs, (shape.stages, *inputs.shape)), _BUFFER_AXES)
        state = constrain(jnp.full((shape.stages, *inputs.shape[1:]), self.bubble_fill, x.dtype), ax.PIPELINE_STATE)
        stages = jax.checkpoint(functools.partial(self._stages, collect=collect), policy=self._policy(),
                                prevent_cse=False)

        def iteration(carry: tuple[jax.Array, jax.Array], t: jax.Array) -> tuple[tuple[jax.Array, jax.Array], Any]:
            state, buffer = carry
            buffer = _store_finished(buffer, state, t, schedule)
            microbatch, repeat, valid = schedule.assignment(t)
            stage_in = constrain(_stage_inputs(buffer, state, microbatch), ax.PIPELINE_STATE)
            out, sown = stages(weights, stage_in, valid, repeat, microbatch, segments, positions)
            return (constrain(jnp.roll(out, 1, axis=0), ax.PIPELINE_STATE), buffer), sown  # step 4: the shift

        (state, buffer), sown = jax.lax.scan(iteration, (state, buffer), jnp.arange(schedule.iterations))
        buffer = _store_finished(buffer, state, jnp.asarray(schedule.iterations), schedule)
        y = constrain(_merge(_finished(buffer)), ax.EMBEDDED)
        slots = schedule.slots()
        return y, jax.tree.map(lambda v: v[slots], sown)  # [iterations, stages, ...] -> [R, M, S, ...]

    def _stages(self, weights: Any, x: jax.Array, valid: jax.Array, repeat: jax.Array, microbatch: jax.Array,
                segments: jax.Array, positions: jax.Array, collect: bool) -> tuple[jax.Array, Any]:
        """Step 3: every stage runs its L layers of its current repeat on its microbatch; x [stages, mb, len, embed],
        zeros for the stages in a bubble (`valid` False).

        With `collect`, also returns what the layers sowed into "intermediates", [stages, L, ...]."""
        x = constrain(_zero_bubbles(x, valid), ax.PIPELINE_STATE)
        stage_weights = jax.tree.map(lambda w: _select_repeat(w, repeat), weights)  # [S, L, ...]
        layer = _stage_class(self.unit, self.cfg.pipeline.layers_per_stage)(
            self.cfg, self.dtype, self.weight_dtype, parent=None
        )

        def one_stage(w: Any, x: jax.Array, seg: jax.Array, pos: jax.Array) -> tuple[jax.Array, Any]:
            if not collect:
                return layer.apply({"params": w}, x, seg, pos)[0], {}
            (y, _), variables = layer.apply({"params": w}, x, seg, pos, mutable=[_SOWN])
            return y, variables.get(_SOWN, {})

        run = jax.vmap(one_stage, spmd_axis_name=_stage_mesh_axes())
        y, sown = run(stage_weights, x, segments[microbatch], positions[microbatch])
        return constrain(y, ax.PIPELINE_STATE), sown

    def _policy(self) -> Any:
        """remat_policy "none" saves every matmul output (like "minimal") and recomputes elementwise work: saving
        literally everything would also keep a copy of the stage's weights per iteration, M x R times the weights."""
        if self.cfg.remat_policy == "none":
            return jax.checkpoint_policies.dots_saveable
        return self.policy
