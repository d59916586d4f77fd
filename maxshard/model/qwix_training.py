"""qwix's side of quantized training (`model/quantization.py` says where and in which types): its rules and the
provider that intercepts the model's matmuls. Imported only when a run quantizes, so a run that does not never
loads qwix.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import qwix
from qwix._src.utils import flax_util  # private: which parameter of the current module an operand is (as MaxText)

from maxshard.model.layers import lora, moe
from maxshard.model.quantization import MOE_PATH, RECIPES, RULES

__all__ = ["ENTRY_POINTS", "Provider", "backward_residuals", "quantize", "rules"]


def rules(mode: str) -> list[qwix.QtRule]:
    """qwix's quantized-training rules of `mode` ('int8' or 'fp8'), with the backward's residuals quantized again
    from the original operands (`backward_residuals`)."""
    recipe = RECIPES[mode]
    return [qwix.QtRule(module_path=path, op_names=ops, weight_qtype=recipe.forward, act_qtype=recipe.forward,
                        bwd_qtype=recipe.gradient, additional_qt_config=backward_residuals(recipe.forward))
            for path, ops in RULES]


def backward_residuals(qtype: Any) -> dict[str, Any]:
    """qwix's dot_general settings that make the backward quantize the original operands (the weight and the
    activation the forward read) in `qtype` itself, each for the GEMM it feeds, instead of reusing the forward's
    8-bit copies.

    Why. An 8-bit GEMM on a GPU reads both operands with the contracted dimension minor, and the forward's copy of
    each operand is quantized and laid out for the forward's contraction. Reused (qwix's default when both passes
    are quantized), those copies are kept from the forward scan and laid out again for the backward's contractions,
    the weight's across every layer, and the incoming gradient is multiplied by the forward copy's scales (the
    scales of the other contraction). Quantized again, each backward operand is written once, by the fusion that
    quantizes it, in the layout its GEMM reads, with scales of the backward's own contraction; the forward's 8-bit
    copies are not kept. The copies this removes from the compiled program: benchmarks/README.md, "The fp8
    backward's copies"."""
    return {"use_original_residuals": True, "dlhs_residual_qtype": qtype, "drhs_residual_qtype": qtype}


class Provider(qwix.QtProvider):
    """qwix's quantized training, less two kinds of matmul that run in a quantized module but stay in the compute
    dtype, since a rule (module path and op name) cannot single them out:

    - LoRA's adapter matmuls (layers/lora.py), which run in the module of the projection they correct. They are what
      trains under LoRA and run at rank r, where 8 bits save nothing and cost the adapters precision: QLoRA's split,
      the frozen base in 8 bits and the adapters not.
    - an MoE layer's einsums other than its experts' (`moe.EXPERT_EINSUMS`): the dispatch and combine with one-hot
      masks and router weights, and the routing statistics.
    """

    def einsum(self, einsum_str: str, *operands: Any, **kwargs: Any) -> jax.Array:
        rule, _ = self._get_current_rule_and_op_id("einsum", only_rule=True)  # qwix's lookup, meant for subclasses
        if rule is not None and rule.module_path == MOE_PATH and einsum_str not in moe.EXPERT_EINSUMS:
            return jnp.einsum(einsum_str, *operands, **kwargs)  # not intercepted again inside the interceptor
        return super().einsum(einsum_str, *operands, **kwargs)

    def dot_general(self, lhs: Any, rhs: Any, *args: Any, **kwargs: Any) -> jax.Array:
        if any(flax_util.find_param(x) in lora.ADAPTER_PARAMS for x in (lhs, rhs)):
            return jax.lax.dot_general(lhs, rhs, *args, **kwargs)  # not intercepted again inside the interceptor
        return super().dot_general(lhs, rhs, *args, **kwargs)


# The methods a caller applies a module through: the Transformer's entry points (`after_stack` is the table
# pipelines' last part, training/pipelined.py), a layer's or a stack's `__call__`. Interception nests: a method
# called from an intercepted one (`__call__` -> `hidden`, `head`) runs under the one interception.
ENTRY_POINTS = ("__call__", "hidden", "hidden_with_mtp", "after_stack", "head")


def quantize(model: Any, mode: str) -> Any:
    """`model` (the Transformer, or a stack or stage a table pipeline applies as its own root) with those of its
    methods that are `ENTRY_POINTS` run under qwix's interception with the rules of `mode` ('int8' or 'fp8')."""
    methods = tuple(name for name in ENTRY_POINTS if hasattr(type(model), name))
    return qwix.quantize_model(model, Provider(rules(mode)), methods=methods)
