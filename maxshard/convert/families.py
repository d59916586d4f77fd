"""The Hugging Face model families maxshard converts, one row of data each.

A family says how its config.json and tensor names differ from Llama's, nothing else: every row computes the same
pre-norm decoder (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU), and the differences are switches
the model already has (`qk_norm`, MoE routing) or names. A new family that needs nothing new in the model is a new
row; one that does (Gemma 3's sandwich norms, DeepSeek-V3's MLA and shared experts) is a model key first, then a
row that names its fields and tensors.
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
    must_equal: config.json fields whose other values change the function in ways maxshard cannot compute.
    window_switch: the field that turns `sliding_window` on (Qwen3's use_sliding_window); None: a window applies
        whenever it is set.
    export: fields to_hf writes whatever the template says (the family's constants).
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
    must_equal: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    window_switch: str | None = None
    export: Mapping[str, Any] = dataclasses.field(default_factory=dict)

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
)


def by_architecture(name: str) -> Family | None:
    return next((f for f in FAMILIES if f.architecture == name), None)


def by_model_type(kind: str) -> Family | None:
    return next((f for f in FAMILIES if f.model_type == kind), None)
