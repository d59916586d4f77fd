"""Which Hugging Face tensor is which maxshard parameter, and how its layout differs: the table as data (each row an
`Entry`; the arithmetic of its layouts, re-exported here, is convert/entries.py's).

Hugging Face stores a linear layer as `weight[out_features, in_features]` (torch's y = x @ W.T); maxshard stores a
`kernel[*in_dims, *out_dims]` contracted over its leading `num_in` dims (layers/linears.py), with heads split out:

    q_proj  [heads * head_dim, embed]      -> attention/query/kernel  [embed, heads, head_dim]
    k_proj  [kv_heads * head_dim, embed]   -> attention/key/kernel    [embed, kv_heads, head_dim]
    o_proj  [embed, heads * head_dim]      -> attention/out/kernel    [heads, head_dim, embed]   (num_in = 2)
    lm_head [vocab, embed]                 -> logits/kernel           [embed, vocab]

so a linear weight maps by a transpose then a reshape, and back by a reshape then a transpose; embeddings and norm
scales have the same layout on both sides. Rows of q/k need no permutation: Hugging Face's rotate-half RoPE pairs
(i, i + head_dim/2) exactly as maxshard does (layers/rope.py); the families that rotate interleaved pairs (DeepSeek's
RoPE columns, Llama 4's heads) are reordered (`Entry.rope_tail`). Per-layer tensors become one stacked parameter
[layers, ...] under decoder/layers (scan_layers=true).

MoE families store each expert's projections as their own tensors ("{e}": expert index); maxshard stacks them
[layers, experts, ...] under decoder/layers/layer_0/moe, the `exp` dimension that expert parallelism shards:

    experts.{e}.gate_proj [mlp, embed]  -> moe/wi_0 [layers, experts, embed, mlp]   (w1 in Mixtral; up: w3 -> wi_1)
    experts.{e}.down_proj [embed, mlp]  -> moe/wo   [layers, experts, mlp, embed]   (w2 in Mixtral)
    gate [experts, embed]               -> moe/gate/kernel [layers, embed, experts] (the router)

GPT-OSS (`Family.fused_experts`) stores each layer's experts stacked, the gate and up columns interleaved, with
biases; its attention has q/k/v/o biases and sinks:

    experts.gate_up_proj [experts, embed, 2 mlp]  -> moe/wi_0 = [..., 0::2], moe/wi_1 = [..., 1::2]  ("interleaved")
    experts.gate_up_proj_bias [experts, 2 mlp]    -> moe/bi_0, moe/bi_1 the same way
    experts.down_proj [experts, mlp, embed]       -> moe/wo (as it is), down_proj_bias -> moe/bo
    router.weight [experts, embed], router.bias   -> moe/gate/kernel, moe/gate/bias
    q_proj.bias [heads * head_dim]                -> attention/query/bias [heads, head_dim]  ("flat")
    self_attn.sinks [heads]                       -> attention/sinks

Qwen3-Next / Qwen3.5 (`Family.linear_attention`): the gated attention's q_proj holds each head's [query, gate] rows,
maxshard's query kernel [embed, heads, 2 x head_dim] as it is; a gated DeltaNet layer's q, k, v (and z, b, a) come
cut from fused tensors (`part` with groups: Qwen3-Next's in_proj_qkvz holds per key head [q, k, v, z], in_proj_ba
per key head [b, a]; Qwen3.5's in_proj_qkv is [all q; all k; all v], one group), as is its depthwise conv1d
[channels, 1, width] ("conv": the channels of q, k, v in a row) -> query_conv / key_conv / value_conv [width, heads,
dim]; such tensors move whole (`Entry.whole`), one layer's projection at a time:

    linear_attn.in_proj_qkvz [kh (2 dk + 2 r dv), embed] -> linear_attention/{query,key,value,z}/kernel  (r = vh / kh)
    linear_attn.in_proj_ba [kh 2 r, embed]                -> linear_attention/{b,a}/kernel [embed, vh]
    linear_attn.conv1d.weight [2 kh dk + vh dv, 1, width]  -> linear_attention/{query,key,value}_conv
    linear_attn.A_log, dt_bias [vh]; norm.weight [dv]      -> linear_attention/A_log, dt_bias, norm/scale
    mlp.shared_expert_gate.weight [1, embed]               -> moe/shared_gate/kernel [embed, 1]

The table of a layer is `per_layer(family, cfg, layer)`: Llama's rows, plus q/k norms with `qk_norm`, with the MLP
replaced by the router and experts in the MoE layers (spec/blocks.py says which layers those are), or kept beside
them (Gemma 4's MoE block: `MOE_BLOCK`, its experts stacked as torch Linear weights, "expert_linear":
experts.gate_up_proj [experts, 2 mlp, embed] -> moe/wi_0, moe/wi_1 transposed, down_proj [experts, embed, mlp] ->
moe/wo); Gemma's four
norms a layer (`SANDWICH_NORMS`) in families with `post_norms`; OLMo 3's two after (`pre_norms` false: the rows
without `PRE_NORMS`), its q/k norms over all heads "flat" (q_norm.weight [heads * head_dim] -> [heads, head_dim]).

Llama 4 (`Family.gate_up_halves`, `interleaved_rope`, `mlp_prefix`): its MoE layers' experts stacked as GPT-OSS's
but gate then up ("halves") with no biases, beside `shared_expert`; its dense layers' MLP under feed_forward; its
q and k rows in interleaved pairs, reordered per head as DeepSeek's RoPE columns are ("rope_tail"):

    feed_forward.experts.gate_up_proj [experts, embed, 2 mlp]  -> moe/wi_0 = [..., :mlp], moe/wi_1 = [..., mlp:]
    feed_forward.router.weight [experts, embed]                -> moe/gate/kernel

A stack whose unit is several layers (Gemma 3's five local and one global) holds each as layer_<slot>
(convert/layout.py maps Hugging Face layer i to its unit and slot).
"""

from __future__ import annotations

import dataclasses
import re

from maxshard.convert.entries import (Entry, hf_name, hf_rows_per_row, hf_shape, join_parts, row_axis, to_hf,
                                      to_maxshard, whole_rows)
from maxshard.convert.families import Family
from maxshard.errors import ConfigError
from maxshard.spec.blocks import Layer, layer_config, main_stack
from maxshard.model.layers import rope
from maxshard.spec.model_config import ModelConfig

__all__ = ["Entry", "MIXERS", "GLOBAL", "PER_LAYER_EMBED", "PER_LAYER_INPUT", "LAYER_SCALAR", "global_rows",
           "ATTENTION", "QK_NORM", "MLP_NORM", "SANDWICH_NORMS", "QK_NORM_ALL_HEADS", "PRE_NORMS", "MLP", "HEAD",
           "SCORE", "IGNORED",
           "MTP", "MTP_COPIES", "QWEN_MTP", "mtp_rows", "mtp_layer", "mtp_copies", "per_layer", "hf_name",
           "hf_shape", "row_axis", "hf_rows_per_row", "whole_rows", "to_maxshard", "to_hf", "join_parts"]


GLOBAL = (
    Entry("model.embed_tokens.weight", ("token_embed", "embedding"), "same"),
    Entry("model.norm.weight", ("final_norm", "scale"), "same"),
)
# Gemma 4's per-layer input embeddings (`per_layer_input_dim`, layers/per_layer_inputs.py): the second table, the
# projection of the embedded tokens and its norm, then in each layer its gate, projection back and norm
PER_LAYER_EMBED = (
    Entry("model.embed_tokens_per_layer.weight", ("per_layer_embed", "table", "embedding"), "same"),
    Entry("model.per_layer_model_projection.weight", ("per_layer_embed", "projection", "kernel"), "linear"),
    Entry("model.per_layer_projection_norm.weight", ("per_layer_embed", "norm", "scale"), "same"),
)
PER_LAYER_INPUT = (
    Entry("model.layers.{i}.per_layer_input_gate.weight", ("per_layer_input", "gate", "kernel"), "linear"),
    Entry("model.layers.{i}.per_layer_projection.weight", ("per_layer_input", "out", "kernel"), "linear"),
    Entry("model.layers.{i}.post_per_layer_input_norm.weight", ("per_layer_input", "norm", "scale"), "same"),
)
LAYER_SCALAR = Entry("model.layers.{i}.layer_scalar", ("layer_scalar",), "same")  # Gemma 4 (`layer_scalar`)
HEAD = Entry("lm_head.weight", ("logits", "kernel"), "linear")  # absent with tie_word_embeddings
SCORE = Entry("score.weight", ("score", "kernel"), "linear")  # a reward model's head ([1, embed]; `score_head`)
# Each layer's rows, in Hugging Face's order: attention (with q/k norms in qk_norm families), then the MLP's norm
# and the MLP (or the MoE).
ATTENTION = (
    Entry("model.layers.{i}.input_layernorm.weight", ("attention_norm", "scale"), "same"),
    Entry("model.layers.{i}.self_attn.q_proj.weight", ("attention", "query", "kernel"), "linear"),
    Entry("model.layers.{i}.self_attn.k_proj.weight", ("attention", "key", "kernel"), "linear"),
    Entry("model.layers.{i}.self_attn.v_proj.weight", ("attention", "value", "kernel"), "linear"),
    Entry("model.layers.{i}.self_attn.o_proj.weight", ("attention", "out", "kernel"), "linear", num_in=2),
)
QK_NORM = (
    Entry("model.layers.{i}.self_attn.q_norm.weight", ("attention", "query_norm", "scale"), "same"),
    Entry("model.layers.{i}.self_attn.k_norm.weight", ("attention", "key_norm", "scale"), "same"),
)
# OLMo 2/3 (`qk_norm_all_heads`): one norm over all heads, weight [heads * head_dim] -> scale [heads, head_dim]
QK_NORM_ALL_HEADS = tuple(dataclasses.replace(e, layout="flat") for e in QK_NORM)
# The norms before attention and before the MLP, which a family without them (`pre_norms` false: OLMo 3) lacks.
PRE_NORMS = (("attention_norm", "scale"), ("mlp_norm", "scale"))
MLP_NORM = Entry("model.layers.{i}.post_attention_layernorm.weight", ("mlp_norm", "scale"), "same")
# Gemma 2/3 (`post_norms`): a norm before and after each of attention and MLP; the name Llama gives its MLP's norm
# is Gemma's norm after attention.
SANDWICH_NORMS = (
    Entry("model.layers.{i}.post_attention_layernorm.weight", ("post_attention_norm", "scale"), "same"),
    Entry("model.layers.{i}.pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), "same"),
    Entry("model.layers.{i}.post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), "same"),
)
# Gemma 4's MoE block (`moe_beside_mlp`): beside the MLP, the experts' own norm and one after each of the two
# outputs; the router (its input norm's scale, its kernel, the weights' per-expert scale); the experts stacked as
# torch Linear weights [experts, out, in], the gate rows then the up rows ("expert_linear")
MOE_BLOCK = (
    Entry("model.layers.{i}.pre_feedforward_layernorm_2.weight", ("moe_norm", "scale"), "same"),
    Entry("model.layers.{i}.post_feedforward_layernorm_1.weight", ("post_dense_norm", "scale"), "same"),
    Entry("model.layers.{i}.post_feedforward_layernorm_2.weight", ("post_moe_norm", "scale"), "same"),
    Entry("model.layers.{i}.router.scale", ("moe", "router_norm", "scale"), "same"),
    Entry("model.layers.{i}.router.proj.weight", ("moe", "gate", "kernel"), "linear"),
    Entry("model.layers.{i}.router.per_expert_scale", ("moe", "expert_scale"), "same"),
    Entry("model.layers.{i}.experts.gate_up_proj", ("moe", "wi_0"), "expert_linear", part=(0, 1, 2)),
    Entry("model.layers.{i}.experts.gate_up_proj", ("moe", "wi_1"), "expert_linear", part=(1, 2, 2)),
    Entry("model.layers.{i}.experts.down_proj", ("moe", "wo"), "expert_linear"),
)
MLP = (
    Entry("model.layers.{i}.mlp.gate_proj.weight", ("mlp", "wi_0", "kernel"), "linear"),
    Entry("model.layers.{i}.mlp.up_proj.weight", ("mlp", "wi_1", "kernel"), "linear"),
    Entry("model.layers.{i}.mlp.down_proj.weight", ("mlp", "wo", "kernel"), "linear"),
)


def _latent_attention(cfg: ModelConfig) -> tuple[Entry, ...]:
    """DeepSeek's multi-head latent attention (layers/mla.py): the query through its low-rank latent (or one
    projection), the shared key/value latent with the RoPE key, kv_b_proj split into key and value per head."""
    attn, n, p, v = "model.layers.{i}.self_attn", cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    query = ((Entry(f"{attn}.q_a_proj.weight", ("attention", "query_down", "kernel"), "linear"),
              Entry(f"{attn}.q_a_layernorm.weight", ("attention", "query_down_norm", "scale"), "same"),
              Entry(f"{attn}.q_b_proj.weight", ("attention", "query", "kernel"), "linear", rope_tail=p))
             if cfg.q_lora_rank else (Entry(f"{attn}.q_proj.weight", ("attention", "query", "kernel"), "linear",
                                            rope_tail=p),))
    return (
        ATTENTION[0],
        *query,
        Entry(f"{attn}.kv_a_proj_with_mqa.weight", ("attention", "kv_down", "kernel"), "linear", rope_tail=p),
        Entry(f"{attn}.kv_a_layernorm.weight", ("attention", "kv_down_norm", "scale"), "same"),
        Entry(f"{attn}.kv_b_proj.weight", ("attention", "key", "kernel"), "linear", part=(0, n, n + v)),
        Entry(f"{attn}.kv_b_proj.weight", ("attention", "value", "kernel"), "linear", part=(n, n + v, n + v)),
        ATTENTION[4],
    )


def _shared(family: Family, cfg: ModelConfig) -> tuple[Entry, ...]:
    """The shared experts (one gated MLP under `Family.shared_experts`) and their sigmoid gate, where the model has
    them."""
    prefix, shared = family.moe_prefix, ()
    if family.shared_experts and cfg.num_shared_experts:
        stem = f"model.layers.{{i}}.{prefix}.{family.shared_experts}"
        shared = tuple(Entry(f"{stem}.{hf}.weight", ("moe", "shared", name, "kernel"), "linear")
                       for hf, name in (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo")))
    if family.shared_expert_gate and cfg.shared_expert_gate:
        shared += (Entry(f"model.layers.{{i}}.{prefix}.{family.shared_expert_gate}.weight",
                         ("moe", "shared_gate", "kernel"), "linear"),)
    return shared


def _moe(family: Family, cfg: ModelConfig) -> tuple[Entry, ...]:
    prefix, (gate, up, down) = family.moe_prefix, family.expert_projections
    experts = f"model.layers.{{i}}.{prefix}.experts.{{e}}"
    router = (Entry(f"model.layers.{{i}}.{prefix}.gate.weight", ("moe", "gate", "kernel"), "linear"),)
    if family.router_bias:
        router += (Entry(f"model.layers.{{i}}.{prefix}.{family.router_bias}", ("moe", "router_bias"), "same"),)
    return (
        *router,
        Entry(f"{experts}.{gate}.weight", ("moe", "wi_0"), "linear", per_expert=True),
        Entry(f"{experts}.{up}.weight", ("moe", "wi_1"), "linear", per_expert=True),
        Entry(f"{experts}.{down}.weight", ("moe", "wo"), "linear", per_expert=True),
        *_shared(family, cfg),
    )


def _fused_moe(family: Family, cfg: ModelConfig) -> tuple[Entry, ...]:
    """Each layer's experts stacked: GPT-OSS's (a router with a bias, gate and up interleaved, with biases) or
    Llama 4's (`Family.gate_up_halves`: the gate columns then the up columns, no biases, a shared expert)."""
    stem = f"model.layers.{{i}}.{family.moe_prefix}"
    router, experts = f"{stem}.{family.router}", f"{stem}.experts"
    layout = "halves" if family.gate_up_halves else "interleaved"
    biased = family.biases  # GPT-OSS: the router's and every expert's projections
    return (
        Entry(f"{router}.weight", ("moe", "gate", "kernel"), "linear"),
        *((Entry(f"{router}.bias", ("moe", "gate", "bias"), "same"),) if biased else ()),
        Entry(f"{experts}.gate_up_proj", ("moe", "wi_0"), layout, part=(0, 1, 2)),
        Entry(f"{experts}.gate_up_proj", ("moe", "wi_1"), layout, part=(1, 2, 2)),
        *((Entry(f"{experts}.gate_up_proj_bias", ("moe", "bi_0"), layout, part=(0, 1, 2)),
           Entry(f"{experts}.gate_up_proj_bias", ("moe", "bi_1"), layout, part=(1, 2, 2))) if biased else ()),
        Entry(f"{experts}.down_proj", ("moe", "wo"), "same"),
        *((Entry(f"{experts}.down_proj_bias", ("moe", "bo"), "same"),) if biased else ()),
        *_shared(family, cfg),
    )


def _attention_extras(cfg: ModelConfig, family: Family) -> tuple[Entry, ...]:
    """q/k/v/o biases (`attention_bias`), q/k/v ones (`qkv_bias`) and sinks (`attention_sinks`) of the families
    that have them."""
    attn = "model.layers.{i}.self_attn"
    projections = (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"))
    if family.biases and cfg.attention_bias:
        projections += (("o_proj", "out"),)
    elif not (family.qkv_bias and cfg.qkv_bias):
        projections = ()
    biases = tuple(Entry(f"{attn}.{hf}.bias", ("attention", name, "bias"), "flat") for hf, name in projections)
    sinks = (Entry(f"{attn}.sinks", ("attention", "sinks"), "same"),) if family.sinks and cfg.attention_sinks else ()
    return biases + sinks


def _grouped_attention(family: Family, cfg: ModelConfig, layer: Layer) -> tuple[Entry, ...]:
    """Grouped-query attention (a gated one's q_proj is its query kernel as it is), with the q/k norms of
    qk_norm families; a family that rotates interleaved pairs (`Family.interleaved_rope`, Llama 4) has each
    q and k head's rows reordered into the half layout (every layer alike: q.k is the same under one order of
    both, so NoPE layers may take it too)."""
    has_norms = family.qk_norm or (family.qk_norm_field and cfg.qk_norm)
    qk_norm = (QK_NORM_ALL_HEADS if cfg.qk_norm_all_heads else QK_NORM) if has_norms else ()
    attention = ATTENTION
    if family.interleaved_rope:
        tail = rope.rotary_dim(cfg)
        attention = tuple(dataclasses.replace(e, rope_tail=tail) if e.path[1] in ("query", "key") else e
                          for e in ATTENTION)
    rows = (*attention, *qk_norm)
    if cfg.global_values_from_keys:  # Gemma 4's attention_k_eq_v: the values are the key projection's
        rows = tuple(e for e in rows if e.path[1] != "value")
    if layer.kv_shared:  # Gemma 4: it reuses an earlier layer's keys and values, so it has no projections for them
        return tuple(e for e in rows if e.path[1] not in ("key", "value", "key_norm"))
    return rows


def _cut(hf: str, scope: str, cuts: tuple[tuple[str, int, int], ...], width: int, layout: str = "linear",
         leaf: str = "kernel") -> tuple[Entry, ...]:
    """The maxshard kernels (name, start, stop) cut from each group of `width` rows of one Hugging Face tensor."""
    return tuple(Entry(hf, (scope, name, leaf) if leaf else (scope, name), layout, part=(start, stop, width),
                       whole=True) for name, start, stop in cuts)


def _gated_deltanet(family: Family, cfg: ModelConfig, layer: Layer) -> tuple[Entry, ...]:
    """Gated DeltaNet (layers/gated_deltanet.py) under its row's scope: Qwen3-Next's fused in_proj_qkvz (per key
    head [q, k, v, z]) and in_proj_ba (per key head [b, a]), or Qwen3.5's in_proj_qkv ([q; k; v]) beside
    in_proj_z, in_proj_b, in_proj_a; the conv1d's channels [q; k; v]; A_log, dt_bias, the gated norm, out_proj."""
    attn, scope = "model.layers.{i}.linear_attn", layer.mixer.scope
    kh, vh, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    key, value, r = kh * dk, vh * dv, vh // kh
    qkv = (("query", 0, key), ("key", key, 2 * key), ("value", 2 * key, 2 * key + value))
    if family.linear_attention == "fused":
        per_head = (("query", 0, dk), ("key", dk, 2 * dk), ("value", 2 * dk, 2 * dk + r * dv),
                    ("z", 2 * dk + r * dv, 2 * dk + 2 * r * dv))
        projections = (*_cut(f"{attn}.in_proj_qkvz.weight", scope, per_head, 2 * dk + 2 * r * dv),
                       *_cut(f"{attn}.in_proj_ba.weight", scope, (("b", 0, r), ("a", r, 2 * r)), 2 * r))
    else:
        projections = (*_cut(f"{attn}.in_proj_qkv.weight", scope, qkv, 2 * key + value),
                       *(Entry(f"{attn}.in_proj_{n}.weight", (scope, n, "kernel"), "linear") for n in ("z", "b", "a")))
    conv = tuple(dataclasses.replace(e, path=(scope, f"{e.path[1]}_conv"))
                 for e in _cut(f"{attn}.conv1d.weight", scope, qkv, 2 * key + value, "conv", ""))
    return (
        ATTENTION[0],
        *projections,
        *conv,
        Entry(f"{attn}.A_log", (scope, "A_log"), "same"),
        Entry(f"{attn}.dt_bias", (scope, "dt_bias"), "same"),
        Entry(f"{attn}.norm.weight", (scope, "norm", "scale"), "same"),
        Entry(f"{attn}.out_proj.weight", (scope, "out", "kernel"), "linear", num_in=2),
    )


def _mlp(family: Family) -> tuple[Entry, ...]:
    """A dense layer's MLP rows, under the family's module name for it (Llama 4's feed_forward)."""
    if family.mlp_prefix == "mlp":
        return MLP
    return tuple(dataclasses.replace(e, hf=e.hf.replace(".mlp.", f".{family.mlp_prefix}.")) for e in MLP)


# Each token mixer's rows, by its row of spec/mixer_kinds.py: a new mixer kind that converts is one more entry.
MIXERS = {
    "gqa": _grouped_attention,
    "mla": lambda family, cfg, layer: _latent_attention(cfg),
    "gated_deltanet": _gated_deltanet,
}


def _mlp_rows(family: Family, cfg: ModelConfig, layer: Layer) -> tuple[Entry, ...]:
    """The dense MLP, the routed experts with their router, or (Gemma 4's MoE block) both, of `layer`'s kind."""
    if not layer.routed:
        return _mlp(family)
    if layer.has_dense_mlp:
        if not family.moe_block_field:
            raise ConfigError(f"{family.architecture} has no tensors for experts beside the MLP (moe_beside_mlp)")
        return (*_mlp(family), *MOE_BLOCK)
    return _fused_moe(family, cfg) if family.fused_experts else _moe(family, cfg)


def per_layer(family: Family, cfg: ModelConfig, layer: Layer) -> tuple[Entry, ...]:
    """The rows of one layer of `layer`'s kinds (spec/blocks.py): its token mixer (MIXERS: attention with the q/k
    norms of qk_norm families, latent attention's own rows, gated DeltaNet's), then the MLP's norm and the dense
    MLP or the MoE (router, its selection bias, experts, shared experts and their gate), or both (`_mlp_rows`)."""
    mixer = MIXERS.get(layer.attention)
    if mixer is None:
        raise ConfigError(f"{family.architecture} has no tensors for token mixer {layer.attention!r}")
    attention = mixer(family, layer_config(cfg, layer), layer)  # at the layer's own head shape
    mlp = _mlp_rows(family, cfg, layer)
    norms = SANDWICH_NORMS if family.keys.get("post_norms") else (MLP_NORM,)
    rows = (*attention, *_attention_extras(cfg, family), *norms, *mlp,
            *(PER_LAYER_INPUT if cfg.per_layer_input_dim else ()), *((LAYER_SCALAR,) if cfg.layer_scalar else ()))
    return rows if cfg.pre_norms else tuple(e for e in rows if e.path not in PRE_NORMS)


def global_rows(cfg: ModelConfig) -> tuple[Entry, ...]:
    """The tensors outside the layers before the head: the embedding (and Gemma 4's per-layer embedding rows)
    first, the final norm last."""
    return (GLOBAL[0], *(PER_LAYER_EMBED if cfg.per_layer_input_dim else ()), *GLOBAL[1:])


# A multi-token prediction module (layers/mtp.py, DeepSeek-V3's `num_nextn_predict_layers`) is Hugging Face's layer
# num_layers + k - 1: a decoder layer of the main stack's last kind (its rows under mtp_<k>/layer) and these.
MTP = (
    Entry("model.layers.{i}.enorm.weight", ("embed_norm", "scale"), "same"),
    Entry("model.layers.{i}.hnorm.weight", ("hidden_norm", "scale"), "same"),
    Entry("model.layers.{i}.eh_proj.weight", ("eh_proj", "kernel"), "linear", num_in=2),  # in: [enorm; hnorm]
    Entry("model.layers.{i}.shared_head.norm.weight", ("head_norm", "scale"), "same"),
)
# ... and copies of the shared embedding and head, which the model keeps once: skipped on the way in, written from
# the shared parameters on the way out.
MTP_COPIES = (("model.layers.{i}.embed_tokens.weight", GLOBAL[0]), ("model.layers.{i}.shared_head.head.weight", HEAD))


# Qwen3-Next's one MTP module (`Family.mtp_prefix`, vLLM's Qwen3NextMultiTokenPredictor: the same function as
# layers/mtp.py's module 1): its decoder layer is mtp.layers.0 (the layer's rows with that prefix), and these.
QWEN_MTP = (
    Entry("mtp.pre_fc_norm_embedding.weight", ("embed_norm", "scale"), "same"),
    Entry("mtp.pre_fc_norm_hidden.weight", ("hidden_norm", "scale"), "same"),
    Entry("mtp.fc.weight", ("eh_proj", "kernel"), "linear", num_in=2),  # in: [embedding; hidden]
    Entry("mtp.norm.weight", ("head_norm", "scale"), "same"),
)


def mtp_rows(family: Family, cfg: ModelConfig) -> list[tuple[tuple[str, ...], Entry]]:
    """(path inside the module "mtp_<k>", row) of one MTP module: its decoder layer of the main stack's last kind
    (under "layer") and its own rows, as DeepSeek (MTP) or Qwen3-Next (QWEN_MTP) keeps them."""
    layer = per_layer(family, cfg, main_stack(cfg).unit[-1])
    if not family.mtp_prefix:
        return [(("layer", *e.path), e) for e in layer] + [(e.path, e) for e in MTP]
    stem = f"{family.mtp_prefix}.layers.{{i}}."
    return ([(("layer", *e.path), dataclasses.replace(e, hf=e.hf.replace("model.layers.{i}.", stem))) for e in layer]
            + [(e.path, e) for e in QWEN_MTP])


def mtp_layer(cfg: ModelConfig, module: str, family: Family) -> int | None:
    """Hugging Face's layer index of the MTP module named `module` ("mtp_<k>"), None for another name: DeepSeek's
    decoder layer num_layers + k - 1, or under `Family.mtp_prefix` its own layer k - 1."""
    found = re.fullmatch(r"mtp_(\d+)", module)
    if not found:
        return None
    return int(found.group(1)) - 1 + (0 if family.mtp_prefix else cfg.num_layers)


def mtp_copies(cfg: ModelConfig, family: Family) -> list[tuple[str, Entry]]:
    """(Hugging Face name, the shared tensor it copies) of every MTP module's embedding and head copy (DeepSeek's;
    Qwen3-Next keeps none); the head is the embedding in a tied model."""
    if family.mtp_prefix:
        return []
    return [(name.format(i=cfg.num_layers + k), entry if entry is GLOBAL[0] or not cfg.logits_via_embedding
             else GLOBAL[0]) for k in range(cfg.mtp_depth) for name, entry in MTP_COPIES]


# Buffers some older checkpoints saved; recomputed from the config, never learned.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
