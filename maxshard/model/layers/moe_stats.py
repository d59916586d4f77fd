"""The MoE layers' sown router statistics (layers/moe.py) turned into what the train step uses: the router losses'
share of the objective, the metrics, and the aux-loss-free moves of the selection biases (DeepSeek-V3).

Each MoE layer sows its statistics under STATS_COLLECTION ("intermediates", stacked by nn.scan; under the pipeline
beside its stages), and with `moe_router_bias` its load beside the bias; `collect_stats` flattens them over the
layers, `loss_sums` makes per-batch sums that add up over microbatches, `objective` and `metrics` read those sums,
and `move_bias` moves each bias toward equal load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

__all__ = ["STATS_COLLECTION", "STATS_NAME", "LOAD_STAT", "BIAS_PARAM", "BIAS_LOAD", "collect_stats", "scaled",
           "joined", "loss_sums", "objective", "move_bias", "metrics"]

STATS_COLLECTION = "intermediates"
STATS_NAME = "moe_stats"
LOAD_STAT = "load"  # the one per-expert statistic: [experts]; the others are scalars
BIAS_PARAM = "router_bias"  # the selection bias [experts] of a layer with `moe_router_bias` (never trained)
BIAS_LOAD = "router_bias_load"  # sown beside it: the layer's load [experts], stacked as the bias is
_BIAS_LOADS = "bias_loads"  # collect_stats' entry: {param path of each bias: its layer's load, same shape}


# --------------------------------------------------------------------------------------------- losses and metrics


def _find_stats(tree: Mapping[str, Any], found: list[dict[str, jax.Array]]) -> None:
    for key, value in tree.items():
        if key == STATS_NAME:
            found.extend(value)  # sow keeps a tuple of values
        elif isinstance(value, Mapping):
            _find_stats(value, found)


# Under the pipeline (layers/pipeline.py) the layers' sown values come back under the pipeline's "stages" entry,
# [repeats, microbatches, stages, layers_per_stage, ...], beside its weights "layers" [repeats, stages, layers, ...].
_PIPELINE_SOWN, _PIPELINE_PARAMS = ("pipeline", "stages"), ("pipeline", "layers")


def _find_bias_loads(tree: Mapping[str, Any], path: tuple[str, ...], found: dict[str, jax.Array]) -> None:
    """{"/"-joined param path of each selection bias: its layer's load, in the bias's shape}."""
    for key, value in tree.items():
        if key == BIAS_LOAD:
            load = value[0]
            if _PIPELINE_SOWN in zip(path, path[1:]):  # one load per microbatch: summed, as accumulation sums
                at = next(i for i in range(len(path)) if path[i:i + 2] == _PIPELINE_SOWN)
                path, load = (*path[:at], *_PIPELINE_PARAMS, *path[at + 2:]), jnp.sum(load, axis=1)
            found["/".join((*path, BIAS_PARAM))] = load
        elif isinstance(value, Mapping):
            _find_bias_loads(value, (*path, key), found)


def collect_stats(intermediates: Mapping[str, Any]) -> dict[str, Any]:
    """Every MoE layer's sown statistics, flattened: scalars [moe_layers], load [moe_layers, experts]; with
    selection biases also `bias_loads` (each bias's path -> its layer's load, stacked as the bias: `move_bias`).

    Under nn.scan a sown value gains leading stacked dims ([layers, ...]); reshaping folds them into one.
    """
    found: list[dict[str, jax.Array]] = []
    _find_stats(intermediates, found)
    if not found:
        return {}

    def flat(name: str, value: jax.Array) -> jax.Array:
        return value.reshape(-1, value.shape[-1]) if name == LOAD_STAT else value.reshape(-1)

    stats: dict[str, Any] = {name: jnp.concatenate([flat(name, s[name]) for s in found]) for name in found[0]}
    bias_loads: dict[str, jax.Array] = {}
    _find_bias_loads(intermediates, (), bias_loads)
    return {**stats, _BIAS_LOADS: bias_loads} if bias_loads else stats


def scaled(stats: Mapping[str, Any], balance: jax.Array, z: jax.Array, sequence: jax.Array) -> dict[str, Any]:
    """`collect_stats`' statistics with each layer's balance, z and sequence-wise losses times these factors, the
    counts and loads as they are: one microbatch's part of a whole batch's statistics, summed over the microbatches
    (training/pipelined.py: the MoE layers after the pipeline under a table schedule)."""
    return {**stats, "lb_loss": stats["lb_loss"] * balance, "z_loss": stats["z_loss"] * z,
            "seq_loss": stats["seq_loss"] * sequence}


def joined(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """Two `collect_stats` results as one: `first`'s layers, then `second`'s."""
    if not first or not second:
        return dict(first or second)
    out: dict[str, Any] = {name: jnp.concatenate([first[name], second[name]]) for name in first if name != _BIAS_LOADS}
    loads = {**first.get(_BIAS_LOADS, {}), **second.get(_BIAS_LOADS, {})}
    return {**out, _BIAS_LOADS: loads} if loads else out


def loss_sums(stats: Mapping[str, Any], weight_sum: jax.Array) -> dict[str, Any]:
    """Per-batch sums that add up across microbatches. Router losses are averaged over MoE layers and scaled by
    the batch's loss weight, so after the step divides by the total weight they are token-weighted means."""
    if not stats:
        return {}
    sums = {
        "moe_lb_loss": weight_sum * jnp.mean(stats["lb_loss"]),
        "moe_z_loss": weight_sum * jnp.mean(stats["z_loss"]),
        "moe_seq_loss": weight_sum * jnp.mean(stats["seq_loss"]),
        "moe_assigned": jnp.sum(stats["assigned"]),
        "moe_dropped": jnp.sum(stats["dropped"]),
        "moe_load": stats[LOAD_STAT],  # [moe_layers, experts]
    }
    if _BIAS_LOADS in stats:
        sums["moe_bias_loads"] = stats[_BIAS_LOADS]  # {bias path: load}, summed over microbatches like the rest
    return sums


def objective(sums: Mapping[str, jax.Array], balance_weight: float, z_weight: float, seq_weight: float = 0.0
              ) -> jax.Array | float:
    """The router losses' share of the summed training objective (0.0 for dense models); the weights are the run's
    `load_balance_loss_weight`, `router_z_loss_weight` and `moe_seq_balance_loss_weight`."""
    if "moe_lb_loss" not in sums:
        return 0.0
    total = balance_weight * sums["moe_lb_loss"] + z_weight * sums["moe_z_loss"]
    return total + seq_weight * sums["moe_seq_loss"] if seq_weight else total


def move_bias(params: Any, sums: Mapping[str, Any], rate: float) -> Any:
    """Aux-loss-free balancing (DeepSeek-V3): every selection bias moved by `rate` toward equal load, per layer,
    `bias + rate * sign(mean load - load)` (an overloaded expert is chosen less, an idle one more), from the
    step's loads (`sums` of `loss_sums`, over every microbatch). `params` unchanged without biases or a rate."""
    loads = sums.get("moe_bias_loads", {})
    if not rate or not loads:
        return params
    flat = traverse_util.flatten_dict(params, sep="/")
    for path, load in loads.items():
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        flat[path] = flat[path] + step.astype(flat[path].dtype)
    return traverse_util.unflatten_dict(flat, sep="/")


def metrics(sums: Mapping[str, jax.Array], weight_sum: jax.Array) -> dict[str, jax.Array]:
    """MoE entries of the metrics dict (none for dense models), keyed `moe/...` so TensorBoard groups them.

    Expert load is measured per layer as routed assignments over their mean (1.0: balanced); min and max are
    over all MoE layers and experts, cv (std / mean over experts) is averaged over layers.
    """
    if "moe_lb_loss" not in sums:
        return {}
    load = sums["moe_load"]  # [moe_layers, experts]
    mean = jnp.maximum(jnp.mean(load, axis=-1, keepdims=True), 1e-9)
    relative = load / mean
    return {
        "moe/lb_loss": sums["moe_lb_loss"] / jnp.maximum(weight_sum, 1.0),
        "moe/z_loss": sums["moe_z_loss"] / jnp.maximum(weight_sum, 1.0),
        "moe/seq_balance_loss": sums["moe_seq_loss"] / jnp.maximum(weight_sum, 1.0),
        "moe/dropped_fraction": sums["moe_dropped"] / jnp.maximum(sums["moe_assigned"], 1.0),
        "moe/expert_load_min": jnp.min(relative),
        "moe/expert_load_max": jnp.max(relative),
        "moe/expert_load_cv": jnp.mean(jnp.std(relative, axis=-1)),
    }
