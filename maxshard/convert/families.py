"""The Hugging Face model families maxshard converts, one row of data each.

A family says how its config.json and tensor names differ from Llama's, nothing else: every row computes the same
pre-norm decoder (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU), and the differences are switches
the model already has (`qk_norm`, MoE routing, latent attention) or names. A new family that needs nothing new in the
model is a new row; one that does (Gemma 3's sandwich norms) is a model key first, then a row that names its fields
and tensors. A user adds a row without Python through a family file (convert/family_file.py), registered for the
process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from maxshard.errors import ConfigError

__all__ = ["Family", "FAMILIES", "by_architecture", "by_model_type", "register", "rows"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture's config.json fields and tensor names.

    moe_prefix: the module of each layer holding `gate` (router) and `experts.{e}` ("" for dense models; the MoE
        families route in every layer, dropless).
    expert_projections: Hugging Face names of each expert's gate, up and down projections.
    experts_fields: config.json fields that may give the number of routed experts (first present wins).
    expert_width_field: config.json field of each expert's hidden width.
    renormalize_field: the field deciding whether the top-k probabilities are rescaled to sum to 1; None when they
        always are (Mixtral's softmax over the k chosen logits is the same function).
    attention: "gqa", or "mla" (DeepSeek's latent attention: config.json's q_lora_rank, kv_lora_rank, ...).
    shared_experts: the module under moe_prefix holding the shared experts ("" when the family has none).
    router_bias: the router's selection bias under moe_prefix ("" when it has none); sigmoid_router: scores are
        sigmoids (DeepSeek-V3), else a softmax; group routing, routed scaling and dense first layers come with it.
    fields: config.json fields copied to and from maxshard keys as they are ({field: key}; a null field is 0).
    keys: model keys every model of the family has (its kinds and routing), checked on export.
    must_equal: config.json fields whose other values change the function in ways maxshard cannot compute.
    window_switch: the field that turns `sliding_window` on (Qwen3's use_sliding_window); None: a window applies
        whenever it is set.
    export: fields to_hf writes whatever the template says (the family's constants).
    router: the router's module under moe_prefix ("gate"; GPT-OSS: "router").
    fused_experts: the experts are stacked tensors under `experts` (GPT-OSS): gate_up_proj [experts, embed,
        2 x mlp] with the gate and up columns interleaved, down_proj [experts, mlp, embed], each with a bias.
    biases: q/k/v/o, router and expert biases (config.json's attention_bias; `attention_bias`, `moe_bias`).
    qkv_bias: config.json's attention_bias puts biases on q, k and v only, not the output (GLM-4.5: `qkv_bias`;
        the field maps to the key in `fields`).
    sinks: a learned softmax-denominator logit per head, `self_attn.sinks` (`attention_sinks`).
    quantized_experts: quantization_config.quant_method values whose expert tensors from_hf dequantizes
        (GPT-OSS's released "mxfp4": convert/mxfp4.py).
    defaults: config.json fields' values when a file omits them: transformers' config class defaults where they
        differ from Llama's (Gemma: tied head, head_dim 256, soft-caps), so a short config.json means what it
        means to transformers.
    activation_field, activation: the field naming the MLP's activation and the one value the family converts
        (Gemma: hidden_activation gelu_pytorch_tanh, the tanh GELU of `mlp_activation: gelu_tanh`).
    local_global: config.json's layer_types (sliding_attention / full_attention) and sliding_window become
        attention_pattern and sliding_window (hf_local_global.py); without layer_types layer i is local unless
        (i + 1) is a multiple of `pattern_period` (or the field `pattern_period_field` when present: Gemma 3's
        sliding_window_pattern).
    rope_per_layer_type: RoPE settings per layer type (Gemma 3: rope_parameters.{full_attention,
        sliding_attention}; 4.x: rope_theta + rope_scaling for global layers, rope_local_base_freq for local ones).
    local_base_field, local_base_default: the 4.x field of the local layers' RoPE base and its default; "" where
        the family has none (OLMo 3: transformers 5 gives a 4.x config's rope_theta and rope_scaling to the full
        layers only, its sliding layers Olmo3Config's default_theta, so such a family exports rope_parameters).
    carries: the layer options (hf_config.LAYER_OPTIONS) the family's config.json can give any value besides
        those `keys` fixes; every other option must be at its default for a model to be written as the family.
    null_when_zero: `fields` written as null when the key is 0 (a soft-cap of 0 means none; transformers reads
        null so).
    refuse_set: fields whose non-null value transformers ignores for this family (Gemma 3's
        attn_logit_softcapping), refused rather than guessed.
    shared_expert_gate: the module under moe_prefix holding the shared experts' sigmoid gate ("": none).
    shared_width_field: config.json's field of the shared experts' whole width (Qwen3-Next's
        shared_expert_intermediate_size: num_shared_experts x the expert width); None: the family has none, or
        counts them in `fields` (DeepSeek's n_shared_experts).
    linear_attention: the hybrids' gated DeltaNet layers (layer_types "linear_attention", names.py): "fused"
        (Qwen3-Next: in_proj_qkvz, in_proj_ba) or "split" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a);
        "" for families without. Their config.json's layer_types become the `layer_types` key as they are.
    left_out: {prefix: what it is} of tensors a checkpoint carries that transformers' model of the family does
        not load (Qwen3.5's multi-token prediction head `mtp.*`): from_hf leaves them out and says so.
    mtp_prefix: where the checkpoint keeps its multi-token prediction module when not as DeepSeek's decoder layer
        num_layers (names.MTP): Qwen3-Next's "mtp" (mtp.fc, mtp.pre_fc_norm_embedding/hidden, mtp.layers.0,
        mtp.norm: vLLM's Qwen3NextMultiTokenPredictor, which transformers does not load); its presence sets
        mtp_depth 1 (names.QWEN_MTP).
    qk_norm_field: a config.json switch of the per-head q/k RMSNorm (`qk_norm`) in a family where it is optional
        (GLM-4.5's use_qk_norm); "" where `qk_norm` says whether the family always or never has it.
    gate_up_halves: with fused_experts, gate_up_proj holds the gate columns then the up columns (Llama 4), not
        interleaved, and the experts have no biases.
    interleaved_rope: q_proj and k_proj rows rotate interleaved pairs (Llama 4's complex RoPE), reordered per head
        into the half layout (names.py).
    mlp_prefix: the module of a dense layer's gate, up and down projections ("mlp"; Llama 4: "feed_forward").
    per_layer_positions: config.json's layer_types (chunked_attention / full_attention), no_rope_layers,
        attention_chunk_size, the NoPE temperature and use_qk_norm become the Llama 4 keys (hf_positions.py).
    rotary_dim_field: a config.json field giving RoPE's share of each head as a number of features (MiniMax-M2's
        released rotary_dim, which transformers reads as rotary_dim / head_dim) where partial_rotary_factor is absent.
    per_layer_dims: config.json may give the full-attention layers a head shape of their own (Gemma 4's
        per_layer_config, global_head_dim): global_head_dim and global_num_kv_heads (hf_layer_dims.py).
    last_layer_global: the last layer is a full-attention one whatever layer_types says (transformers' Gemma 4
        config forces it, with a warning), so a converted model computes what transformers loads.
    bidirectional_images: the use_bidirectional_attention value under which only image tokens see each other
        (Gemma 4's "vision", as its multimodal releases ship): text attends causally, so a text model converts.
    moe_block_field: a config.json switch of routed experts beside every layer's dense MLP in a family whose layers
        are dense without it (Gemma 4's enable_moe_block: `moe_beside_mlp`, hf_moe_block.py); "" for none.
    """

    architecture: str
    model_type: str
    qk_norm: bool = False
    moe_prefix: str = ""
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    experts_fields: tuple[str, ...] = ()
    expert_width_field: str = "intermediate_size"
    renormalize_field: str | None = None
    renormalize_default: bool = True
    attention: str = "gqa"
    shared_experts: str = ""
    router_bias: str = ""
    sigmoid_router: bool = False
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
    keys: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    must_equal: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    window_switch: str | None = None
    export: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    router: str = "gate"
    fused_experts: bool = False
    biases: bool = False
    sinks: bool = False
    qkv_bias: bool = False
    quantized_experts: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    activation_field: str = "hidden_act"
    activation: str = "silu"
    local_global: bool = False
    pattern_period: int = 0
    pattern_period_field: str | None = None
    rope_per_layer_type: bool = False
    local_base_field: str = "rope_local_base_freq"
    local_base_default: float = 10000.0
    carries: tuple[str, ...] = ()
    null_when_zero: tuple[str, ...] = ()
    refuse_set: tuple[str, ...] = ()
    shared_expert_gate: str = ""
    shared_width_field: str | None = None
    linear_attention: str = ""
    left_out: Mapping[str, str] = dataclasses.field(default_factory=dict)
    mtp_prefix: str = ""
    rotary_dim_field: str = ""
    per_layer_dims: bool = False
    moe_block_field: str = ""
    last_layer_global: bool = False
    bidirectional_images: str = ""
    qk_norm_field: str = ""
    gate_up_halves: bool = False
    interleaved_rope: bool = False
    mlp_prefix: str = "mlp"
    per_layer_positions: bool = False

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_prefix)


FAMILIES = (
    Family("LlamaForCausalLM", "llama", export={"attention_bias": False, "mlp_bias": False}),
    Family("MistralForCausalLM", "mistral", export={"sliding_window": None}),
    Family("Qwen3ForCausalLM", "qwen3", qk_norm=True, window_switch="use_sliding_window",
           export={"attention_bias": False, "use_sliding_window": False}),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", qk_norm=True, moe_prefix="mlp",
           experts_fields=("num_experts", "num_local_experts"), expert_width_field="moe_intermediate_size",
           renormalize_field="norm_topk_prob", renormalize_default=False,
           must_equal={"decoder_sparse_step": 1, "mlp_only_layers": []}, window_switch="use_sliding_window",
           export={"attention_bias": False, "use_sliding_window": False, "decoder_sparse_step": 1,
                   "mlp_only_layers": []}),
    Family("MixtralForCausalLM", "mixtral", moe_prefix="block_sparse_moe", expert_projections=("w1", "w3", "w2"),
           experts_fields=("num_local_experts",), export={"sliding_window": None}),
    Family("DeepseekV3ForCausalLM", "deepseek_v3", moe_prefix="mlp", experts_fields=("n_routed_experts",),
           expert_width_field="moe_intermediate_size", renormalize_field="norm_topk_prob", attention="mla",
           shared_experts="shared_experts", router_bias="gate.e_score_correction_bias", sigmoid_router=True,
           fields={"q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
                   "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
                   "first_k_dense_replace": "first_k_dense_replace", "n_group": "moe_n_group",
                   "topk_group": "moe_topk_group", "routed_scaling_factor": "moe_routed_scaling_factor",
                   "n_shared_experts": "num_shared_experts", "moe_intermediate_size": "moe_mlp_dim",
                   "intermediate_size": "mlp_dim", "num_nextn_predict_layers": "mtp_depth"},
           keys={"attention_type": "mla", "moe_router": "sigmoid", "moe_router_bias": True},
           must_equal={"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
           export={"attention_bias": False, "rope_interleave": True}),
    Family("GptOssForCausalLM", "gpt_oss", moe_prefix="mlp", experts_fields=("num_local_experts",), router="router",
           fused_experts=True, biases=True, sinks=True, quantized_experts=("mxfp4",), local_global=True,
           pattern_period=2, carries=("sliding_window", "attention_pattern", "attention_bias"),
           fields={"attention_bias": "attention_bias", "swiglu_limit": "swiglu_limit"},
           defaults={"attention_bias": True, "swiglu_limit": 7.0},  # transformers GptOssConfig's
           keys={"attention_sinks": True, "moe_bias": True, "mlp_activation": "clamped_swiglu",
                 "swiglu_alpha": 1.702}),  # transformers' GptOssExperts fixes alpha (no config.json field)
)

# Gemma 2 and 3 (text): (1 + w) RMSNorms before and after attention and MLP, GeGLU with tanh GELU, embeddings x
# sqrt(width), query_pre_attn_scalar, local (sliding-window) and global layers; Gemma 2 soft-caps attention and
# output logits, Gemma 3 normalises q/k per head and gives local layers their own RoPE base.
_GEMMA_KEYS = {"norm_unit_offset": True, "post_norms": True, "embed_scale": True, "mlp_activation": "gelu_tanh"}
_GEMMA_FIELDS = {"query_pre_attn_scalar": "query_pre_attn_scalar", "final_logit_softcapping": "final_logit_softcapping"}
_GEMMA_DEFAULTS = {"tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6}
# Gemma3TextConfig's shape defaults: the text_config Google publishes inside Gemma3ForConditionalGeneration
# (convert/multimodal.py) omits some (4B: the heads; all: vocab_size, max_position_embeddings)
_GEMMA3_SHAPE = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 131072}
FAMILIES += (
    Family("Gemma2ForCausalLM", "gemma2", fields={**_GEMMA_FIELDS, "attn_logit_softcapping": "attn_logit_softcapping"},
           keys=_GEMMA_KEYS, defaults={**_GEMMA_DEFAULTS, "final_logit_softcapping": 30.0,
                                       "attn_logit_softcapping": 50.0, "rope_theta": 10000.0},
           activation_field="hidden_activation", activation="gelu_pytorch_tanh", local_global=True, pattern_period=2,
           carries=("sliding_window", "attention_pattern", "attn_logit_softcapping", "final_logit_softcapping",
                    "query_pre_attn_scalar"),
           null_when_zero=("final_logit_softcapping", "attn_logit_softcapping"), export={"attention_bias": False}),
    Family("Gemma3ForCausalLM", "gemma3_text", qk_norm=True, fields=_GEMMA_FIELDS, keys=_GEMMA_KEYS,
           defaults={**_GEMMA_DEFAULTS, **_GEMMA3_SHAPE, "final_logit_softcapping": None,
                     "attn_logit_softcapping": None},
           activation_field="hidden_activation", activation="gelu_pytorch_tanh", local_global=True, pattern_period=6,
           pattern_period_field="sliding_window_pattern", rope_per_layer_type=True,
           carries=("sliding_window", "attention_pattern", "rope_local_max_timescale", "final_logit_softcapping",
                    "query_pre_attn_scalar"),
           null_when_zero=("final_logit_softcapping",), refuse_set=("attn_logit_softcapping",),
           export={"attention_bias": False}),
)

# Qwen3-Next and Qwen3.5 (text): hybrids of gated DeltaNet and gated full-attention layers (layer_types), q/k norms,
# (1 + w) norms everywhere but the DeltaNet's gated one, partial rotary; the MoE variants route top-k softmax
# with a sigmoid-gated shared expert. transformers' config defaults where they differ from Llama's (Qwen3NextConfig,
# Qwen3_5TextConfig: head_dim 256, partial_rotary_factor 0.25, the DeltaNet's heads and widths).
_QWEN3_NEXT_KEYS = {"norm_unit_offset": True, "attention_output_gate": True}
_LINEAR_FIELDS = {f: f for f in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                 "linear_value_head_dim", "linear_conv_kernel_dim")}
_QWEN3_NEXT_DEFAULTS = {"head_dim": 256, "partial_rotary_factor": 0.25, "linear_num_key_heads": 16,
                        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6}
_QWEN_MOE = dict(moe_prefix="mlp", experts_fields=("num_experts",), expert_width_field="moe_intermediate_size",
                 shared_experts="shared_expert", shared_expert_gate="shared_expert_gate",
                 shared_width_field="shared_expert_intermediate_size")
_HYBRID = dict(qk_norm=True, fields=_LINEAR_FIELDS, carries=("partial_rotary_factor", "layer_types"))
_MTP_LEFT_OUT = {"mtp.": "the multi-token prediction head, which transformers does not load either"}
FAMILIES += (
    Family("Qwen3NextForCausalLM", "qwen3_next", **_QWEN_MOE, **_HYBRID, linear_attention="fused", mtp_prefix="mtp",
           renormalize_field="norm_topk_prob", renormalize_default=True,
           keys={**_QWEN3_NEXT_KEYS, "shared_expert_gate": True}, defaults=_QWEN3_NEXT_DEFAULTS,
           must_equal={"decoder_sparse_step": 1, "mlp_only_layers": []},
           export={"attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    Family("Qwen3_5ForCausalLM", "qwen3_5_text", **_HYBRID, linear_attention="split", keys=_QWEN3_NEXT_KEYS,
           defaults=_QWEN3_NEXT_DEFAULTS, export={"attention_bias": False}, left_out=_MTP_LEFT_OUT),
    Family("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", **_QWEN_MOE, **_HYBRID, linear_attention="split",
           keys={**_QWEN3_NEXT_KEYS, "shared_expert_gate": True}, defaults=_QWEN3_NEXT_DEFAULTS,
           export={"attention_bias": False}, left_out=_MTP_LEFT_OUT),
)

# OLMo 3: no norms before attention and the MLP, one after each (pre_norms false, post_norms), q/k normalised over
# all heads at once, three sliding-window layers then a full one (layer_types; transformers' rule without them),
# RoPE per layer type (rope_parameters; the sliding layers unscaled). Olmo3Config's defaults where they differ
# from Llama's.
_OLMO3_DEFAULTS = {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                   "rope_theta": 500000.0, "sliding_window": 4096}
FAMILIES += (
    Family("Olmo3ForCausalLM", "olmo3", qk_norm=True, keys={"pre_norms": False, "post_norms": True,
                                                            "qk_norm_all_heads": True},
           defaults=_OLMO3_DEFAULTS, local_global=True, pattern_period=4, rope_per_layer_type=True,
           local_base_field="", local_base_default=500000.0,
           carries=("sliding_window", "attention_pattern", "rope_local_max_timescale"),
           export={"attention_bias": False}),
)

# MiniMax-M2: Mixtral's layer and tensor names, experts routed by sigmoid scores with a selection bias
# (block_sparse_moe.e_score_correction_bias) and always renormalised, q/k normalised over all heads at once, RoPE on
# part of each head (the release's rotary_dim). MiniMaxM2Config's defaults where they differ from Llama's.
_MINIMAX_M2_DEFAULTS = {"vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
                        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
                        "max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
                        "num_local_experts": 256, "num_experts_per_tok": 8}
FAMILIES += (
    Family("MiniMaxM2ForCausalLM", "minimax_m2", qk_norm=True, moe_prefix="block_sparse_moe",
           expert_projections=("w1", "w3", "w2"), experts_fields=("num_local_experts",),
           router_bias="e_score_correction_bias", sigmoid_router=True, rotary_dim_field="rotary_dim",
           keys={"qk_norm_all_heads": True, "moe_router": "sigmoid", "moe_router_bias": True},
           defaults=_MINIMAX_M2_DEFAULTS, carries=("partial_rotary_factor",), export={"attention_bias": False}),
)

# GLM-4.5 / 4.6 (Glm4MoeForCausalLM): DeepSeek-V3's routing and tensor names (dense first layers, grouped top-k by
# sigmoid scores with a selection bias, routed scaling, shared experts) under grouped-query attention with biases
# on q, k and v only (attention_bias) and RoPE on half of each head. Glm4MoeConfig's defaults where they differ from
# Llama's; its per-head q/k norms (use_qk_norm, off in the releases) are `qk_norm`.
_GLM4_MOE_DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
                      "num_attention_heads": 96, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                      "rms_norm_eps": 1e-5, "moe_intermediate_size": 1408, "num_experts_per_tok": 8,
                      "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1,
                      "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
                      "partial_rotary_factor": 0.5, "attention_bias": False, "num_nextn_predict_layers": 1}
FAMILIES += (
    Family("Glm4MoeForCausalLM", "glm4_moe", moe_prefix="mlp", experts_fields=("n_routed_experts",),
           expert_width_field="moe_intermediate_size", renormalize_field="norm_topk_prob",
           shared_experts="shared_experts", router_bias="gate.e_score_correction_bias", sigmoid_router=True,
           qkv_bias=True,
           fields={"first_k_dense_replace": "first_k_dense_replace", "n_group": "moe_n_group",
                   "topk_group": "moe_topk_group", "routed_scaling_factor": "moe_routed_scaling_factor",
                   "n_shared_experts": "num_shared_experts", "moe_intermediate_size": "moe_mlp_dim",
                   "intermediate_size": "mlp_dim", "num_nextn_predict_layers": "mtp_depth",
                   "attention_bias": "qkv_bias"},
           keys={"moe_router": "sigmoid", "moe_router_bias": True}, defaults=_GLM4_MOE_DEFAULTS,
           qk_norm_field="use_qk_norm", carries=("partial_rotary_factor", "qkv_bias")),
)

# Llama 4 text (Llama4ForCausalLM, model_type llama4_text): chunked attention with RoPE (interleaved pairs) and
# L2-normalised q/k in most layers, global NoPE layers with a query temperature in the others (layer_types,
# no_rope_layers), MoE every interleave_moe_layer_step layers: top-1 by sigmoid score, the score on the expert's
# input, stacked experts (gate then up) beside one shared expert; the dense layers' MLP is intermediate_size_mlp
# wide. Llama4TextConfig's defaults where they differ from Llama's (Llama 4 Scout's shape).
_LLAMA4_DEFAULTS = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
                    "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
                    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "num_local_experts": 16, "num_experts_per_tok": 1,
                    "interleave_moe_layer_step": 1, "use_qk_norm": True, "attention_chunk_size": 8192,
                    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                    "no_rope_layer_interval": 4}
FAMILIES += (
    Family("Llama4ForCausalLM", "llama4_text", moe_prefix="feed_forward", experts_fields=("num_local_experts",),
           router="router", fused_experts=True, gate_up_halves=True, shared_experts="shared_expert",
           sigmoid_router=True, renormalize_default=False, interleaved_rope=True, mlp_prefix="feed_forward",
           per_layer_positions=True,
           fields={"intermediate_size": "moe_mlp_dim", "intermediate_size_mlp": "mlp_dim",
                   "interleave_moe_layer_step": "moe_layer_interval"},
           keys={"moe_router": "sigmoid", "moe_weights_on_input": True, "num_shared_experts": 1},
           defaults=_LLAMA4_DEFAULTS,
           carries=("layer_types", "attention_chunk_size", "rope_layers", "nope_temperature_scale", "qk_l2_norm"),
           export={"attention_bias": False, "moe_layers": None}),
)

# Gemma 4 text (Gemma4ForCausalLM, model_type gemma4_text): Gemma's sandwich norms (multiplying by the weight, not
# 1 + weight), GeGLU, embeddings x sqrt(width), local and global layers (layer_types; 5 : 1 without them), q/k norms
# with a scale and a value norm without one, softmax scale 1, proportional RoPE in the global layers, per-layer input
# embeddings, the last layers reusing earlier keys and values, a fixed scalar a layer; the global layers' own head
# shape and values, the shared layers' MLP width (hf_layer_dims.py); with enable_moe_block routed experts beside every
# layer's MLP (hf_moe_block.py). Gemma4TextConfig's defaults.
_GEMMA4_DEFAULTS = {"vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                    "sliding_window": 512, "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh",
                    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
                    "num_kv_shared_layers": 0, "attention_k_eq_v": False, "enable_moe_block": False,
                    "use_double_wide_mlp": False}
FAMILIES += (
    Family("Gemma4ForCausalLM", "gemma4_text", qk_norm=True,
           fields={"final_logit_softcapping": "final_logit_softcapping",
                   "hidden_size_per_layer_input": "per_layer_input_dim",
                   "vocab_size_per_layer_input": "per_layer_vocab_size", "num_kv_shared_layers": "kv_shared_layers"},
           keys={**_GEMMA_KEYS, "norm_unit_offset": False, "query_pre_attn_scalar": 1.0, "value_norm": True,
                 "layer_scalar": True},
           defaults=_GEMMA4_DEFAULTS, activation_field="hidden_activation", activation="gelu_pytorch_tanh",
           local_global=True, pattern_period=6, rope_per_layer_type=True, local_base_field="",
           local_base_default=10000.0, per_layer_dims=True, moe_block_field="enable_moe_block", last_layer_global=True,
           bidirectional_images="vision",
           carries=("sliding_window", "attention_pattern", "rope_local_max_timescale", "final_logit_softcapping",
                    "rope_proportion", "kv_shared_layers", "per_layer_input_dim", "per_layer_vocab_size",
                    "global_head_dim", "global_num_kv_heads", "kv_shared_mlp_dim", "global_values_from_keys",
                    "moe_beside_mlp"),
           null_when_zero=("final_logit_softcapping",), export={"attention_bias": False}),
)


# Rows added for this process by `register` (a family file given to `maxshard.convert --family FILE`), after the
# built-in ones.
_REGISTERED: list[Family] = []


def rows() -> tuple[Family, ...]:
    """Every family row: the built-in ones (the plainest first), then the registered ones."""
    return (*FAMILIES, *_REGISTERED)


def register(family: Family) -> None:
    """Adds a row for this process; a name another row already has is refused, so a file cannot change a built-in
    row (the same row again is a no-op)."""
    if family in _REGISTERED:
        return
    for known in rows():
        for field in ("architecture", "model_type"):
            if getattr(known, field) == getattr(family, field):
                raise ConfigError(f"family {field}={getattr(family, field)!r} is already a row; give the new "
                                  "family its own name")
    _REGISTERED.append(family)


def by_architecture(name: str) -> Family | None:
    return next((f for f in rows() if f.architecture == name), None)


def by_model_type(kind: str) -> Family | None:
    return next((f for f in rows() if f.model_type == kind), None)
