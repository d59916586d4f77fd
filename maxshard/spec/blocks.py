"""The model-family seam: what each decoder layer is made of, and the stacks the decoder repeats.

A family is described by the model keys, read here once into data:

    Layer(attention, mlp, local, rope) one decoder layer's kinds: its token mixer `attention`, a row of
                              spec/mixer_kinds.py ("gqa" grouped-query, "mla" multi-head latent, "gated_deltanet"
                              linear attention, ...), its MLP ("dense": one gated MLP of mlp_dim, "moe": routed
                              experts of expert_dim, "moe_beside_dense": both, Gemma 4's MoE block;
                              mixer_kinds.MLP_KINDS), whether its mixer is local (the
                              last `sliding_window` keys, or its chunk of `attention_chunk_size`) or global, and
                              whether it rotates its queries and keys (`rope_layers`; NoPE where not)
    Stack(name, unit, repeats) a unit of layers repeated `repeats` times: one nn.scan (or one pipeline) each

Llama:                 Stack("layers", (gqa+dense,), num_layers)
Llama 4 Maverick:      Stack("layers", (chunked gqa+dense, chunked gqa+moe, chunked gqa+dense, NoPE gqa+moe), 12)
Mixtral, Qwen3-MoE:    Stack("layers", (gqa+moe,), num_layers)
an MoE every 2nd layer: Stack("layers", (gqa+dense, gqa+moe), num_layers / 2)
DeepSeek-V3:           Stack("dense_layers", (mla+dense,), 3), Stack("layers", (mla+moe,), 58)
GPT-OSS-20B:           Stack("layers", (local gqa+moe, gqa+moe), 12)
Gemma 3 27B:           Stack("layers", (5 x local gqa+dense, gqa+dense), 10), Stack("last_layers", (2 x local ..,), 1)
Qwen3-Next (3:1):      Stack("layers", (3 x gated_deltanet+moe, gqa+moe), 12)
Gemma 4 E4B-like:      Stack("layers", (5 x local, global), 3), Stack("kv_layers", (5 x local, global), 1),
                       Stack("shared_layers", (5 x KV-shared local, KV-shared global), 3)

Each layer's mixer comes from `layer_types` where the model has one (an entry a layer, Hugging Face's spelling,
resolved by `mixer_kinds.resolve`), else from `attention_type` (every layer) and `attention_pattern` (local or
global: layer i is pattern[i % length], counted from the first layer). A stack's unit is the shortest run of layers
that repeats: the lcm of `moe_layer_interval` and the mixers' period (`ModelConfig.pattern_length`: the pattern's
length, or layer_types' shortest period). Layers left over when the unit does not divide the stack (Gemma 3: 62
layers, a 6-layer pattern) form a stack of their own that runs once, after it ("last_layers"; "dense_layers" itself
is one unit when the period does not divide it).

The decoder (layers/decoder.py) assembles its stacks from `stacks(cfg)` and builds each layer's mixer from its row;
the FLOP count (model/flops.py) sums the rows' matmuls and FLOPs over `layers(cfg)`. A new mixer kind is its module
and its row in spec/mixer_kinds.py; neither this module nor the decoder changes.

This module is arithmetic on ModelConfig only: no layer imports it back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from maxshard.spec import mixer_kinds
from maxshard.spec.model_config import ModelConfig

__all__ = ["Layer", "Stack", "MAIN_STACK", "LAST_STACK", "KV_STACK", "SHARED_STACK", "stacks", "layers", "main_stack",
           "layer_config", "stack_named", "mtp_layers", "moe_layers", "mlp_params", "unit_layer_name",
           "unit_layer_index"]

MAIN_STACK = "layers"  # the stack every model has (and the one a pipeline runs); its params' name since v1
LAST_STACK = "last_layers"  # the layers left over when the main stack's unit does not divide them (runs once)
KV_STACK = "kv_layers"  # the last unit before KV-shared layers, whose keys and values they reuse (Gemma 4)
SHARED_STACK = "shared_layers"  # the KV-shared layers (`kv_shared_layers`)
_UNIT_LAYER = re.compile(r"layer_(\d+)")


def unit_layer_name(i: int) -> str:
    """The name of layer i of a stacked unit in its parameters' path ("decoder/<stack>/layer_<i>/..."): one home for
    the decoder that names it, the converter's tables and the planner's per-layer terms that read it."""
    return f"layer_{i}"


def unit_layer_index(name: str) -> int | None:
    """i for a path element `unit_layer_name(i)`, else None."""
    match = _UNIT_LAYER.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class Layer:
    attention: str  # its token mixer: a row of spec/mixer_kinds.py
    mlp: str  # a row of mixer_kinds.MLP_KINDS
    local: bool = False  # attention over the last `sliding_window` keys or within its chunk (else global)
    rope: bool = True  # its queries and keys are rotated (False: NoPE)
    kv_shared: bool = False  # attends over the keys and values of the last earlier layer of its kind (Gemma 4)

    @property
    def kv_kind(self) -> str:
        """What a KV-shared layer reuses the keys and values of: the last earlier layer of the same key ("local" or
        "global"; `kv_shared_layers`)."""
        return "local" if self.local else "global"

    @property
    def mixer(self) -> mixer_kinds.Mixer:
        """The row of its token mixer."""
        return mixer_kinds.kind(self.attention)

    @property
    def routed(self) -> bool:
        """Whether its MLP is routed experts (an MoE layer)."""
        return mixer_kinds.mlp_kind(self.mlp).routed

    @property
    def has_dense_mlp(self) -> bool:
        """Whether it has a dense MLP: a dense layer, or an MoE one that keeps it beside its experts (Gemma 4)."""
        return mixer_kinds.mlp_kind(self.mlp).has_dense


@dataclasses.dataclass(frozen=True)
class Stack:
    """`repeats` identical units of `unit` layers; its parameters live under "decoder/<name>"."""

    name: str
    unit: tuple[Layer, ...]
    repeats: int
    gives_kv: bool = False  # its last unit's layers hand their keys and values to the KV-shared stack after it

    @property
    def reuses_kv(self) -> bool:
        """Its layers attend over keys and values a `gives_kv` stack handed on (`kv_shared_layers`)."""
        return self.unit[0].kv_shared

    @property
    def num_layers(self) -> int:
        return self.repeats * len(self.unit)

    @property
    def has_moe(self) -> bool:
        return moe_layers(self.unit) > 0


@functools.lru_cache(maxsize=64)
def stacks(cfg: ModelConfig) -> tuple[Stack, ...]:
    """The decoder's stacks, in order: `first_k_dense_replace` dense layers in their own stack, then the main stack
    of repeated units (module docstring), then the layers left over, if any."""
    kinds = [_layer(cfg, i) for i in range(cfg.num_layers)]
    first = cfg.first_k_dense_replace if cfg.is_moe else 0
    period = cfg.pattern_length
    out: list[Stack] = []
    if first:
        unit = period if first % period == 0 else first
        out.append(Stack("dense_layers", tuple(kinds[:unit]), first // unit))
    body = kinds[first:]
    unit = min(math.lcm(period, cfg.moe_layer_interval if cfg.is_moe else 1), len(body))  # a longer unit: no repeat
    if cfg.kv_shared_layers:
        return (*out, *_kv_sharing_stacks(body, unit, cfg.kv_shared_layers))
    repeats, left = divmod(len(body), unit)
    out.append(Stack(MAIN_STACK, tuple(body[:unit]), repeats))
    if left:
        out.append(Stack(LAST_STACK, tuple(body[repeats * unit:]), 1))
    return tuple(out)


def _kv_sharing_stacks(body: list[Layer], unit: int, shared: int) -> tuple[Stack, ...]:
    """Gemma 4's stacks: the layers with keys and values of their own, their last unit (where the last layer of
    each kind lies) a stack of its own that hands its keys and values on ("kv_layers"; the main stack itself when
    it is the only unit), then the KV-shared layers (`SHARED_STACK`, in units where they divide). config/ranges.py
    keeps the own layers a whole number of at least one unit."""
    own, reusing = body[:len(body) - shared], body[len(body) - shared:]
    repeats = len(own) // unit
    head = tuple(own[:unit])
    out = [Stack(MAIN_STACK, head, repeats - 1), Stack(KV_STACK, head, 1, gives_kv=True)] if repeats > 1 else [
        Stack(MAIN_STACK, head, 1, gives_kv=True)]
    width = unit if len(reusing) % unit == 0 else len(reusing)
    out.append(Stack(SHARED_STACK, tuple(reusing[:width]), len(reusing) // width))
    return tuple(out)


def _layer(cfg: ModelConfig, i: int) -> Layer:
    """Layer i's kinds: MoE for the last of every `moe_layer_interval` layers after the dense first ones; its mixer
    and locality from layer_types[i], or attention_type and the attention pattern; RoPE unless rope_layers[i] is 0."""
    first, n = cfg.first_k_dense_replace, cfg.moe_layer_interval
    moe = cfg.is_moe and i >= first and (i - first) % n == n - 1
    mlp = ("moe_beside_dense" if cfg.moe_beside_mlp else "moe") if moe else "dense"
    rope = not cfg.rope_layers or bool(cfg.rope_layers[i])
    shared = i >= cfg.num_layers - cfg.kv_shared_layers
    if cfg.layer_types:
        row, local = mixer_kinds.resolve(cfg.layer_types[i])
        return Layer(row.name, mlp, local and cfg.local_span > 0, rope, shared)
    local = cfg.has_local_layers and cfg.attention_pattern[i % len(cfg.attention_pattern)] == "local"
    return Layer(cfg.attention_type, mlp, local, rope, shared)


def layer_config(cfg: ModelConfig, layer: Layer) -> ModelConfig:
    """The model config a layer is built, converted and counted with (Gemma 4): `cfg`, with a global attention
    layer's heads of their own (`global_head_dim`, `global_num_kv_heads`) as head_dim and num_kv_heads, and a
    KV-shared layer's MLP width (`kv_shared_mlp_dim`) as mlp_dim; `global_values_from_keys` true in the global
    attention layers only. One home for the swap: the layer, its KV cache, its RoPE, its checkpoint tensors and its
    FLOPs all read the shape from here."""
    is_global = layer.mixer.attention and not layer.local
    heads = is_global and bool(cfg.global_head_dim or cfg.global_num_kv_heads)
    wide = layer.kv_shared and bool(cfg.kv_shared_mlp_dim)
    values = cfg.global_values_from_keys and not is_global  # not this layer's
    return _own_shape(cfg, heads, wide, values) if heads or wide or values else cfg


@functools.lru_cache(maxsize=64)
def _own_shape(cfg: ModelConfig, heads: bool, wide: bool, values: bool) -> ModelConfig:
    changes = {"global_values_from_keys": False} if values else {}
    if heads:
        changes.update(head_dim=cfg.global_head_dim or cfg.head_dim,
                       num_kv_heads=cfg.global_num_kv_heads or cfg.num_kv_heads, global_head_dim=0,
                       global_num_kv_heads=0)
    if wide:
        changes.update(mlp_dim=cfg.kv_shared_mlp_dim, kv_shared_mlp_dim=0)
    return dataclasses.replace(cfg, **changes)


def main_stack(cfg: ModelConfig) -> Stack:
    return stack_named(cfg, MAIN_STACK)


def stack_named(cfg: ModelConfig, name: str) -> Stack:
    return next(s for s in stacks(cfg) if s.name == name)


def layers(cfg: ModelConfig) -> tuple[Layer, ...]:
    """Every decoder layer's kinds, first to last."""
    return tuple(layer for s in stacks(cfg) for _ in range(s.repeats) for layer in s.unit)


def moe_layers(kinds: tuple[Layer, ...]) -> int:
    """How many of these layers are MoE layers."""
    return sum(layer.routed for layer in kinds)


def mtp_layers(cfg: ModelConfig) -> tuple[Layer, ...]:
    """The decoder layer of each multi-token prediction module (layers/mtp.py): the main stack's last kind."""
    return (main_stack(cfg).unit[-1],) * cfg.mtp_depth


def mlp_params(cfg: ModelConfig, kind: str) -> dict[str, int]:
    """One MLP's matmul parameters per token by part: a dense SwiGLU, or the k routed experts a token visits, the
    shared experts and the router, or both (`moe_beside_dense`)."""
    return mixer_kinds.mlp_kind(kind).params(cfg)
