"""The Hugging Face model families maxshard converts, one row of data each.

A family says how its config.json and tensor names differ from Llama's, nothing else: every row computes the same
pre-norm decoder (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU), and the differences are switches
the model already has (`qk_norm`, MoE routing, latent attention) or names. A new family that needs nothing new in the
model is a new row; one that does (Gemma 3's sandwich norms) is a model key first, then a row that names its fields
and tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Family", "FAMILIES", "by_architecture", "by_model_type"]


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
    sinks: a learned softmax-denominator logit per head, `self_attn.sinks` (`attention_sinks`).
    layer_types: config.json's layer_types and sliding_window give `attention_pattern` and `sliding_window`.
    quantized_experts: quantization_config.quant_method values whose expert tensors from_hf dequantizes
        (GPT-OSS's released "mxfp4": convert/mxfp4.py).
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
    layer_types: bool = False
    quantized_experts: tuple[str, ...] = ()

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
                   "intermediate_size": "mlp_dim"},
           keys={"attention_type": "mla", "moe_router": "sigmoid", "moe_router_bias": True},
           must_equal={"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
           export={"attention_bias": False, "rope_interleave": True}),
    Family("GptOssForCausalLM", "gpt_oss", moe_prefix="mlp", experts_fields=("num_local_experts",), router="router",
           fused_experts=True, biases=True, sinks=True, layer_types=True, quantized_experts=("mxfp4",),
           keys={"attention_sinks": True, "moe_bias": True, "mlp_activation": "clamped_swiglu"},
           export={"attention_bias": True}),
)


def by_architecture(name: str) -> Family | None:
    return next((f for f in FAMILIES if f.architecture == name), None)


def by_model_type(kind: str) -> Family | None:
    return next((f for f in FAMILIES if f.model_type == kind), None)
