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

__all__ = ["ENTRY_POINTS", "Provider", "quantize", "rules"]


def rules(mode: str) -> list[qwix.QtRule]:
    """qwix's quantized-training rules of `mode` ('int8' or 'fp8')."""
    recipe = RECIPES[mode]
    return [qwix.QtRule(module_path=path, op_names=ops, weight_qtype=recipe.forward, act_qtype=recipe.forward,
                        bwd_qtype=recipe.gradient)
            for path, ops in RULES]


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
