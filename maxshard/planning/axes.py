"""Which mesh axes a logical name gets, as the planner asks it: of the array the program really constrains.

The axes of a name depend on the other names of its array (`sharding.mesh_axes`: Flax applies a rule only while
all its mesh axes are free in that array, so a rule whose axes a neighbour took is skipped for the next one). A
name alone can get axes that the program's array never gives it, so the planner asks about a name within an
array: by default the one of `ARRAYS`, where the layers constrain the activation the planner means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from maxshard.config import Config
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import axes_of, flax_rules

__all__ = ["ARRAYS", "rule_axes"]

# The activation each name stands for in the plan. The decoder's tokens are those of the attention projections
# (the MLP's and the MoE block's [batch, length] split the same way); the MoE experts' hidden width is taken as the
# dense MLP's; the expert shards of dropless MoE are those of its kernels' `exp` dimension (layers/moe_grouped.py).
ARRAYS: dict[str, tuple[str | None, ...]] = {
    ax.BATCH: ax.QUERY,
    ax.LENGTH: ax.QUERY,
    ax.ACT_HEADS: ax.QUERY,
    ax.ACT_KV_HEADS: ax.KEY_VALUE,
    ax.ACT_MLP: ax.MLP_HIDDEN,
    ax.NORM_LENGTH: ax.RESIDUAL,
    ax.ATTN_LENGTH: ax.ATTN_QUERY,  # the length ring attention runs over (layers/ring_attention.py)
    ax.EMBED_AND_LOGITS_BATCH: ax.EMBEDDED,
    ax.ACT_VOCAB: ax.LOGITS,
    ax.EXP: ax.EXPERT_KERNEL,
    ax.ACT_EXP: ax.DISPATCHED,  # the experts token dropping exchanges its capacity slots over
    ax.ACT_STAGE: ax.PIPELINE_STATE,  # the stages a pipeline shifts its state over
}


def rule_axes(
    cfg: Config, logical: str, sizes: Mapping[str, int], array: Sequence[str | None] | None = None
) -> tuple[str, ...]:
    """Mesh axes (size > 1) that `logical` gets in `array` under the config's rules; `array` defaults to
    `ARRAYS[logical]` (a KeyError for a name the planner has not placed in an array: ask with one)."""
    return axes_of(logical, ARRAYS[logical] if array is None else array, flax_rules(cfg), sizes)
