"""What a model's layer options add to the residuals one decoder layer keeps for its backward pass, traced from the
layer itself rather than written down, so an option added to the layers is counted by the planner without a formula.

The planner's per-layer formula (planning/memory.py) counts the standard layer: the norms, attention and SwiGLU at
the model's dimensions, calibrated against compiled programs. Every other ModelConfig field that changes what a
layer computes is a layer option (`OPTIONS`: qk_norm, shared experts, LoRA, ...). What the options of a model add is

    traced(model) - traced(model with every option at its default)

where `traced` is the bytes per token and layer of the residuals jax's `saved_residuals` lists for one stacked unit
(layers/decoder.py `stack_unit`, under the `jax.checkpoint` policy of `remat_policy` as the decoder applies it, its
frozen parameters behind stop_gradient as the train step has them: model/trainable.py), traced from abstract values
(nothing is computed or allocated) at the widths the caller gives (the planner: one device's heads, kv heads and
mlp). Only token-proportional residuals count: the unit is traced on 1 and on 2 sequences and the difference taken,
so parameters and what is derived from them alone (a broadcast scale, the stacked MLP kernel) drop out. With every
option at its default the difference is 0 by construction and nothing is traced. Traces are cached: the layout
search plans thousands of candidates, over a few distinct per-device widths; and one trace of the layers serves
every remat policy (`_unit_loss`).

Fields are classified here, once, by exclusion: `COUNTED` are those the planner's formula and terms take (dimensions,
dtypes, remat and attention, the MoE shape, the stack), `VALUES` change numbers but no shape of anything a layer
keeps; every other field is an option. So a field added to ModelConfig is traced unless someone names it here: the
safe side, where a forgotten classification costs a trace, never a silently wrong plan (a `layer_option` mark in
the dataclass's field metadata would fail the other way, unmarked meaning ignored). tests/test_residuals.py gives
every field outside COUNTED a probe value, fails for a new field without one, and checks that each option changes
what a layer keeps and each of VALUES does not.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals  # the list jax.ad_checkpoint.print_saved_residuals prints

from maxshard.model import trainable
from maxshard.spec import blocks
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers.decoder import remat_policy, stack_unit
from maxshard.model.transformer import without_layout

__all__ = ["COUNTED", "VALUES", "OPTIONS", "defaults", "at_defaults", "traced_bytes", "option_bytes"]

COUNTED = frozenset({
    # the dimensions of the formula (planning/widths.py Widths) and the head
    "vocab_size", "emb_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "max_target_length",
    "logits_via_embedding", "score_head",
    # dtypes, remat, attention, the stack: knobs the formula takes
    "dtype", "weight_dtype", "remat_policy", "attention", "attention_block_q", "attention_block_kv", "scan_layers",
    "pipeline",
    # the MoE shape: the MoE terms of planning/memory.py
    "num_experts", "num_experts_per_tok", "capacity_factor", "moe_layer_interval", "moe_group_size",
    "moe_dropless_impl", "moe_exchange", "moe_ragged_buffer_factor", "moe_mlp_dim", "first_k_dense_replace",
    # which layers are local and what they see: the attention terms (spec/blocks.py, planning/memory.py)
    "sliding_window", "attention_pattern",
    # which layers reuse earlier keys and values (Gemma 4): the stacks; every layer is planned as one of the main
    # stack, which keeps more than a KV-shared layer (no key/value projections), unless kv_shared_mlp_dim widens
    # their MLP: that the formula does not count (a compiled plan does)
    "kv_shared_layers", "kv_shared_mlp_dim",
})
VALUES = frozenset({"norm_epsilon", "rope_max_timescale", "rope_scaling_type", "rope_scaling_factor",
                    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position", "lora_alpha",
                    "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
                    "yarn_truncate",
                    "moe_routed_scaling_factor",
                    # which experts a token chooses: indices, no gradient, nothing kept (tests/test_residuals.py)
                    "moe_n_group", "moe_topk_group", "moe_router_bias",
                    # biases, scales and constants of the local/global families: elementwise on what is kept anyway
                    "attention_bias", "qkv_bias", "moe_bias", "embed_scale", "final_logit_softcapping", "norm_unit_offset",
                    "query_pre_attn_scalar", "rope_local_max_timescale", "swiglu_alpha", "swiglu_limit",
                    # modules after the last layer (layers/mtp.py): the stack's unit is unchanged
                    "mtp_depth",
                    # a chunk cuts the segment ids (int, no gradient): the kernels keep what a global layer keeps;
                    # the temperature's floor is a constant of it
                    "attention_chunk_size", "nope_temperature_floor",
                    # Gemma 4's: pairs left unrotated (the same rotation's shapes), the per-layer table's rows (read
                    # before the layers), a constant scale of each layer's output
                    "rope_proportion", "per_layer_vocab_size", "layer_scalar",
                    # the global layers' values from the key projection: a tensor of the values' shape in their place
                    "global_values_from_keys"})
OPTIONS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in COUNTED | VALUES)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in OPTIONS}
_VALUE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in VALUES}


def defaults(model: ModelConfig) -> ModelConfig:
    """`model` with every layer option at its default."""
    return dataclasses.replace(model, **_DEFAULTS)


def at_defaults(model: ModelConfig) -> bool:
    """Whether every layer option of `model` is at its default (then options add nothing)."""
    return all(getattr(model, name) == value for name, value in _DEFAULTS.items())


def _unit(model: ModelConfig) -> ModelConfig:
    """One unit of `model`'s main stack, alone: no dense first layers (the formula counts their dense MLPs), no scan,
    no pipeline, no vocabulary to speak of, no KV-shared layers (COUNTED); its layer_types and rope_layers the unit's
    own."""
    layers = len(blocks.main_stack(dataclasses.replace(model, pipeline=None)).unit)
    first = model.first_k_dense_replace if model.is_moe else 0
    types, rope = model.layer_types[first:first + layers], model.rope_layers[first:first + layers]
    return dataclasses.replace(model, num_layers=layers, scan_layers=False, pipeline=None, vocab_size=1,
                               first_k_dense_replace=0, layer_types=types, rope_layers=rope, kv_shared_layers=0)


@functools.lru_cache(maxsize=512)
def _sequence_bytes(model: ModelConfig, sequences: int) -> int:
    """Bytes of the residuals one unit keeps for its backward on `sequences` sequences (module docstring): what
    `saved_residuals` lists for the unit's loss under the `jax.checkpoint` policy of `model.remat_policy`."""
    loss, args = _unit_loss(dataclasses.replace(model, remat_policy="none"), sequences)
    if model.remat_policy != "none":
        loss = jax.checkpoint(loss, policy=remat_policy(model.remat_policy))
    return sum(a.size * a.dtype.itemsize for a, _ in saved_residuals(loss, *args))


@functools.lru_cache(maxsize=256)
def _unit_loss(model: ModelConfig, sequences: int) -> tuple[Callable[..., jax.Array], tuple[Any, ...]]:
    """The unit's loss on `sequences` sequences as a function of flat abstract arguments, and those arguments.

    Traced from the layers once, as a jaxpr, for every remat policy: the layers do not read the policy, only the
    checkpoint around them does, and running the jaxpr under a policy's checkpoint is ~3x cheaper than tracing the
    Flax modules again (`auto` plans several policies of each model and of its defaults). Traced with no mesh or rules
    in context: the same whole-array layers wherever the planner is called from (a cached answer must not depend on
    the caller's layout, and a layout's kernels would refuse the abstract inputs)."""
    with without_layout():
        dtype = model.compute_dtype
        unit = stack_unit(model)(model, dtype, model.param_dtype)
        shape = (sequences, model.max_target_length)
        x = jax.ShapeDtypeStruct((*shape, model.emb_dim), dtype)
        ids = jax.ShapeDtypeStruct(shape, jnp.int32)  # segment ids and positions: inputs of the step, as there
        # Gemma 4: the unit's layers' per-layer inputs [sequences, length, unit, P], computed before the layers
        extra = (jax.ShapeDtypeStruct((*shape, model.num_layers, model.per_layer_input_dim), dtype),) if (
            model.per_layer_input_dim) else ()
        params = nn.unbox(jax.eval_shape(unit.init, jax.random.key(0), x, ids, ids, *extra))["params"]

        def loss(params: dict, x: jax.Array, segments: jax.Array, positions: jax.Array, *extra: jax.Array
                 ) -> jax.Array:
            trained, frozen = trainable.split(params, model)
            whole = trainable.merge(trained, jax.lax.stop_gradient(frozen))
            return jnp.sum(unit.apply({"params": whole}, x, segments, positions, *extra)[0].astype(jnp.float32))

        args = (params, x, ids, ids, *extra)
        traced = jax.make_jaxpr(loss)(*args)
    run = jax.extend.core.jaxpr_as_fun(traced)
    return (lambda *flat: run(*flat)[0]), tuple(jax.tree.leaves(args))


def traced_bytes(model: ModelConfig) -> float:
    """Bytes per token and layer of the token-proportional residuals one unit of `model` keeps under its
    remat_policy: the unit on two sequences less on one, per position, per layer of the unit."""
    unit = _unit(model)
    per_sequence = _sequence_bytes(unit, 2) - _sequence_bytes(unit, 1)
    return per_sequence / unit.max_target_length / unit.num_layers


def option_bytes(model: ModelConfig) -> float | int:
    """What the layer options of `model` add per token and layer to what a layer keeps under its remat_policy (0
    with every option at its default, with nothing traced: an int, so the planner's terms of a model without options
    stay exactly its formula's)."""
    if at_defaults(model):
        return 0
    model = dataclasses.replace(model, **_VALUE_DEFAULTS)  # they change no residual: one trace for such models
    return traced_bytes(model) - traced_bytes(defaults(model))
