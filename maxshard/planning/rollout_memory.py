"""The memory GRPO's rollouts add: the KV cache that sampling keeps (`generation/rollouts.py`).

A GRPO step first samples completions of the whole global batch with the KV-cache engine, from the train state's
own parameters, then trains on them. The cache and the step's gradients and activations are never alive together,
so the plan's peak takes the larger of the two beside the state (`estimate.Plan.peak_bytes`). The cache's shape is
traced from the model (`transformer.abstract_cache`: [layers, batch, kv_heads, prompt + new tokens, head_dim] for
keys and values; whatever a local layer's cache keeps of its window, the traced shape has it) and laid out by the
run's logical rules, as generation lays it out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from maxshard.config import Config
from maxshard.model import transformer
from maxshard.objectives import kinds as objective_kinds
from maxshard.parallel import axis_names as ax
from maxshard.parallel import sharding

__all__ = ["rollout_cache_bytes"]


def rollout_cache_bytes(cfg: Config, sizes: Mapping[str, int]) -> int:
    """Bytes per device of the KV cache GRPO's sampling keeps for the rows it decodes at once (the global batch,
    or grpo_rollout_rows of it; 0 for other objectives)."""
    if not objective_kinds.kind(cfg.objective).samples:
        return 0
    rules = sharding.flax_rules(cfg)
    spec = sharding.logical_to_spec((ax.CACHE_BATCH,), rules)
    shards = 1
    for axis in (spec[0],) if isinstance(spec[0], str) else (spec[0] or ()):
        shards *= sizes.get(axis, 1)
    rows = min(cfg.grpo_rollout_rows or cfg.global_batch_size, cfg.global_batch_size)  # generation/refill.py
    rows = -(-rows // shards) * shards  # the engine pads the batch to the cache's batch shards
    length = cfg.grpo_max_prompt_length + cfg.grpo_max_new_tokens
    if cfg.grpo_max_turns > 1:  # a later turn's context is padded to the longest whose reply fits the row
        length = max(length, cfg.max_target_length + 1)  # (generation/environments.py `context_limit`)
    model = dataclasses.replace(cfg.model, pipeline=None)
    with transformer.without_layout():
        params = transformer.abstract_params(model)
        cache = transformer.abstract_cache(model, params, rows, length)
    return sum(row.bytes_per_device for row in sharding.layout(cache, rules, sizes))
