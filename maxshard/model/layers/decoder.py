"""The decoder block and the stack of blocks (scanned or unrolled, with a configurable remat policy).

Remat policies (`remat_policy`) are rows of `maxshard/spec/remat.py`: what each keeps for the backward pass (every
activation, the matmul outputs, or named values), and where (device or host memory). A layer names its input
`layer_input`, so a policy can move it to host memory; the attention projections name theirs (layers/attention.py).
"""

from __future__ import annotations

from typing import Any

import functools
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxshard.spec import blocks, mixer_kinds, remat
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import kv_cache
from maxshard.model.layers.mlp import MLP, activation
from maxshard.model.layers.moe import MoEBlock
from maxshard.model.layers.norms import RMSNorm
from maxshard.model.layers.per_layer_inputs import PerLayerInput, scaled_by_layer
from maxshard.model.layers.pipeline import Pipeline
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = ["mixer_module", "DecoderLayer", "DecoderBlock", "Decoder", "scanned_stack", "norm", "remat_policy",
           "rematted", "stack_unit", "ties_layers"]


def remat_policy(name: str) -> Any:
    """The `jax.checkpoint` policy for a `remat_policy` name (None: recompute everything but the layer input; also
    for `auto` not yet resolved, in a model built only for its parameter shapes)."""
    p = remat.policy(name) if name in remat.NAMES else remat.policy("full")
    if p.keeps == "dots":
        return jax.checkpoint_policies.dots_saveable
    if p.host:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=p.device, names_which_can_be_offloaded=p.host, offload_src="device",
            offload_dst="pinned_host")
    if p.device:
        return jax.checkpoint_policies.save_only_these_names(*p.device)
    return None


# The residual stream between attention and MLP, and the norms on it (ax.RESIDUAL): length sharded by
# "activation_norm_length" (the `tensor_sequence` axis besides context and sequence). The norms and the residual adds
# are elementwise over length, so the devices of a tensor_sequence group split the positions instead of repeating
# them, and what each layer saves for its backward is 1/tensor_sequence of the stream. Attention and the MLP gather
# the length back before their column-parallel projections and reduce their row-parallel outputs onto it (the
# collectives XLA derives from these constraints), as Megatron's sequence parallelism does. Plain `tensor` keeps the
# stream whole: XLA moves twice the collective bytes with the split (benchmarks/tensor_sequence.py), a price only
# memory can justify.


def norm(layer: nn.Module, x: jax.Array) -> jax.Array:
    """An RMSNorm computed on the residual stream's sharding (ax.RESIDUAL)."""
    return constrain(layer(constrain(x, ax.RESIDUAL)), ax.RESIDUAL)


@functools.cache
def mixer_module(row: mixer_kinds.Mixer) -> type[nn.Module]:
    """The Flax module of a token-mixer row ("package.module:Class", spec/mixer_kinds.py), imported when a layer of
    its kind is first built: the row names it so that spec/ stays below the layers."""
    module, _, name = row.module.partition(":")
    return getattr(importlib.import_module(module), name)


class DecoderLayer(nn.Module):
    """One decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); with `post_norms` (Gemma 2/3) each branch's
    output is normalised again before its residual add; with `pre_norms` false (OLMo 2/3) only that way:
    x + norm(attn(x)), then x + norm(mlp(x)). Returns (x, None) so `nn.scan` can carry x.

    Its kinds are layer `index` of the unit of stack `stack` (spec/blocks.py): the token mixer of its row
    (spec/mixer_kinds.py: its module, under its scope, local or global, with RoPE or without), and a dense MLP
    ("mlp"), a routed MoEBlock ("moe"), or both side by side (Gemma 4's MoE block, `_mlp`).
    """

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype
    stack: str = blocks.MAIN_STACK
    index: int = 0

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, layer_input: jax.Array | None = None,
                 shared: dict | None = None) -> tuple[jax.Array, dict | None]:
        """x [batch, length, embed] -> (x, what it gives the KV-shared layers: {its kv_kind: (k, v, mask)} in a
        `gives_kv` stack, else None). `layer_input`: its per-layer input [batch, length, P] (per_layer_input_dim);
        `shared`: in a KV-shared layer, the keys and values the last earlier layer of each kind gave."""
        cfg, dt, wdt = self.cfg, self.dtype, self.weight_dtype
        stack = blocks.stack_named(cfg, self.stack)
        kinds = stack.unit[self.index]
        x = checkpoint_name(constrain(x, ax.RESIDUAL), remat.LAYER_INPUT)  # what an offload policy moves to host
        h = norm(self._norm("attention_norm"), x) if cfg.pre_norms else x
        mixer = mixer_module(kinds.mixer)
        options = {**({"local": True} if kinds.local else {}), **({} if kinds.rope else {"rope": False}),
                   **({"gives_kv": True} if stack.gives_kv else {})}
        reused = {"shared_kv": shared[kinds.kv_kind]} if kinds.kv_shared else {}
        own = blocks.layer_config(cfg, kinds)  # its own head shape and MLP width (Gemma 4)
        h = mixer(own, dt, wdt, **options, name=kinds.mixer.scope)(h, segment_ids, positions, **reused)
        given = None
        if stack.gives_kv:
            h, kv = h
            given = {kinds.kv_kind: kv}
        x = x + (norm(self._norm("post_attention_norm"), h) if cfg.post_norms else h)
        h = norm(self._norm("mlp_norm"), x) if cfg.pre_norms else x
        h = self._mlp(x, h, segment_ids, own, kinds)
        x = x + (norm(self._norm("post_mlp_norm"), h) if cfg.post_norms else h)
        if cfg.per_layer_input_dim:  # Gemma 4 (layers/per_layer_inputs.py)
            x = PerLayerInput(cfg, dt, wdt, name="per_layer_input")(x, layer_input)
        if cfg.layer_scalar:
            x = scaled_by_layer(self, x)
        return constrain(x, ax.RESIDUAL), given

    def _mlp(self, x: jax.Array, h: jax.Array, segment_ids: jax.Array, own: ModelConfig,
             kinds: blocks.Layer) -> jax.Array:
        """The MLP's output of `h` (the normalised stream): the dense MLP, the routed experts, or (Gemma 4's MoE
        block, `moe_beside_mlp`) both: the experts read their own norm of the residual `x` and the router `x`
        itself, and each output is normalised before the two are added."""
        cfg, dt, wdt = self.cfg, self.dtype, self.weight_dtype
        dense = None
        if kinds.has_dense_mlp:
            ranks = (cfg.lora_rank_of("gate"), cfg.lora_rank_of("up"), cfg.lora_rank_of("down"))
            dense = MLP(own.mlp_dim, dt, wdt, ranks, cfg.lora_scale, activation(cfg), name="mlp")(h)
        if not kinds.routed:
            return dense
        if dense is None:
            return MoEBlock(cfg, dt, wdt, name="moe")(h, segment_ids)
        routed = MoEBlock(cfg, dt, wdt, name="moe")(norm(self._norm("moe_norm"), x), segment_ids, residual=x)
        return norm(self._norm("post_dense_norm"), dense) + norm(self._norm("post_moe_norm"), routed)

    def _norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.cfg.norm_epsilon, self.dtype, self.weight_dtype, self.cfg.norm_unit_offset, name=name)


class DecoderBlock(nn.Module):
    """The repeated unit of a stack of more than one layer, or of MoE layers (spec/blocks.py): its layers
    `layer_0 ..`, e.g. `moe_layer_interval` layers the last one MoE, or Gemma 3's five local layers and a global one.

    nn.scan needs identical iterations, so a stack whose layers differ scans over blocks of layers (the unit that
    repeats) rather than over single layers.
    """

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype
    stack: str = blocks.MAIN_STACK

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, unit_inputs: jax.Array | None = None,
                 shared: dict | None = None) -> tuple[jax.Array, dict | None]:
        """x -> (x, what the unit gives the KV-shared layers: each kind's last layer's, or None). `unit_inputs`:
        the per-layer inputs of its layers [batch, length, unit, P]."""
        given: dict = {}
        for i in range(len(blocks.stack_named(self.cfg, self.stack).unit)):
            layer = DecoderLayer(self.cfg, self.dtype, self.weight_dtype, self.stack, i, name=blocks.unit_layer_name(i))
            x, gave = layer(x, segment_ids, positions, None if unit_inputs is None else unit_inputs[:, :, i], shared)
            given.update(gave or {})
        return x, given or None


def stack_unit(cfg: ModelConfig, stack: blocks.Stack | None = None) -> type[nn.Module]:
    """The module a stack (default: the main one) repeats: DecoderLayer for a stack of one dense layer per unit,
    else DecoderBlock (the unit's layers `layer_0 ..`; also for one MoE layer, as checkpoints name it). Built with
    `stack=<its name>` (the main stack's by default, which is what a pipeline runs)."""
    stack = stack or blocks.main_stack(cfg)
    return DecoderBlock if stack.has_moe or len(stack.unit) > 1 or ties_layers(cfg) else DecoderLayer


def ties_layers(cfg: ModelConfig) -> bool:
    """Whether every unit takes two more arguments, its layers' per-layer inputs and the keys and values a KV-shared
    stack reuses (Gemma 4: `per_layer_input_dim`, `kv_shared_layers`; either may be None in a unit)."""
    return bool(cfg.per_layer_input_dim or cfg.kv_shared_layers)


def rematted(cfg: ModelConfig, unit: type[nn.Module]) -> type[nn.Module]:
    """`unit` under the model's remat policy (unchanged with remat_policy none)."""
    if cfg.remat_policy == "none":
        return unit
    return nn.remat(unit, policy=remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)


def scanned_stack(stack: blocks.Stack, layer: type[nn.Module], per_layer: bool = False) -> type[nn.Module]:
    """`layer` (a stack's unit, rematted) scanned over the stack's repeats, its parameters stacked on the layers axis:
    how the decoder runs a scanned stack, and how the table pipelines' runner runs the stacks outside the pipeline
    (training/pipelined.py). With `per_layer` (Gemma 4) it also takes each unit's per-layer inputs (scanned) and the
    keys and values a KV-shared stack reuses (the same for every unit)."""
    return nn.scan(
        layer,
        variable_axes={"params": 0, "intermediates": 0, kv_cache.COLLECTION: 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast) if per_layer else (nn.broadcast, nn.broadcast),
        length=stack.repeats,
        metadata_params={nn.PARTITION_NAME: ax.LAYERS if stack.name == blocks.MAIN_STACK else ax.UNSTAGED_LAYERS},
    )


class Decoder(nn.Module):
    """The stacks of spec/blocks.py, in order. Each is one scanned unit with a leading "layers" axis (params under
    its name: "layers", "dense_layers" for `first_k_dense_replace`, "last_layers" for the layers a pattern leaves
    over), or unrolled `<name>_0 .. <name>_{n-1}`; with more than one pipeline stage the main stack is a circular
    pipeline (params under "pipeline", see layers/pipeline.py) and the other stacks run before and after it on
    every stage."""

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array,
                 per_layer_inputs: jax.Array | None = None) -> jax.Array:
        """x [batch, length, embed] -> the last residual stream; `per_layer_inputs` [batch, length, layers, P]
        (Gemma 4, layers/per_layer_inputs.py), each stack reading its layers' slice."""
        cfg, tied = self.cfg, ties_layers(self.cfg)
        first, given = 0, None  # the first layer of the stack; the keys and values the last gives_kv stack gave
        for stack in blocks.stacks(cfg):
            unit = stack_unit(cfg, stack)
            inputs = _stack_inputs(per_layer_inputs, first, stack)
            shared = given if stack.reuses_kv else None
            first += stack.num_layers
            if stack.name == blocks.MAIN_STACK and cfg.pipeline is not None:  # layers/pipeline.py
                pipeline = Pipeline(cfg, unit, self.dtype, self.weight_dtype, remat_policy(cfg.remat_policy),
                                    name="pipeline")
                x = pipeline(x, segment_ids, positions)
            elif cfg.scan_layers:
                scanned = scanned_stack(stack, rematted(cfg, unit), per_layer=tied)
                x, gave = scanned(cfg, self.dtype, self.weight_dtype, stack=stack.name, name=stack.name)(
                    x, segment_ids, positions, *((inputs, shared) if tied else ()))
                given = jax.tree.map(lambda a: a[-1], gave) if stack.gives_kv else given
            else:
                layer = rematted(cfg, unit)
                for i in range(stack.repeats):
                    block = layer(cfg, self.dtype, self.weight_dtype, stack=stack.name, name=f"{stack.name}_{i}")
                    args = (None if inputs is None else inputs[i], shared) if tied else ()
                    x, gave = block(x, segment_ids, positions, *args)
                    given = gave if stack.gives_kv else given
        return x


def _stack_inputs(per_layer_inputs: jax.Array | None, first: int, stack: blocks.Stack) -> jax.Array | None:
    """The per-layer inputs of a stack's layers, one [batch, length, unit, P] a repeat stacked first
    ([repeats, batch, length, unit, P]), or None in a model without them."""
    if per_layer_inputs is None:
        return None
    batch, length, _, width = per_layer_inputs.shape
    mine = per_layer_inputs[:, :, first:first + stack.num_layers]
    return jnp.moveaxis(mine.reshape(batch, length, stack.repeats, len(stack.unit), width), 2, 0)
