"""Per-device parameter + optimizer bytes under fsdp=8, against the ideal (params x 12 bytes) / 8 (target: 2%).

    python benchmarks/memory.py [key=value ...]

AdamW in float32 keeps 12 bytes per parameter: the parameter (4), mu (4) and nu (4). Perfect FSDP over 8 devices
leaves each device 12/8 bytes per parameter. Two independent measurements are compared with that:

1. live: the train state as `init_state` creates it; for device 0, the bytes of every shard it holds
   (`addressable_shards`), summed over parameters and optimizer state. This is what really sits in memory.
2. compiled: `memory_analysis()` of the compiled train step. Its argument bytes are per device (the SPMD program
   of one device) and include the input batch, which is subtracted; with the state donated, the outputs alias the
   arguments, so the argument size is the state's resident size. Temporaries are printed for information.

What can push the ratio above 1: arrays left replicated (norm scales have no sharded dimension, the step counters),
and dimensions that do not divide by 8 (padded shards). The model is sized so that these are small but real.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import jax

from maxshard import config, data
from maxshard.model import transformer as model
from maxshard.parallel import mesh
from maxshard.training.step import Trainer

# The 256-wide model, 4 layers, float32 weights (so 12 B per parameter with AdamW), fsdp=8.
MODEL = (*common.WIDE_MODEL, "num_layers=4", "ici_fsdp_parallelism=8", "weight_dtype=float32")
BYTES_PER_PARAM = 12  # float32 param + mu + nu


def device_bytes(tree: Any, device: jax.Device) -> int:
    """Bytes of `tree`'s shards that live on `device` (a replicated array counts whole on every device)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


def batch_bytes_per_device(cfg: config.Config) -> int:
    """The five [batch, length] int32/float32 input arrays, split over the 8 devices by the batch axis."""
    return 5 * 4 * cfg.global_batch_size * cfg.max_target_length // cfg.num_devices


def live_bytes(state: Any) -> dict[str, int]:
    """Device 0's bytes of each part of the train state."""
    device = jax.devices()[0]
    parts = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    return {name: device_bytes(tree, device) for name, tree in parts.items()}


def compiled_bytes(trainer: Trainer, cfg: config.Config, state: Any) -> dict[str, int]:
    """Argument (state only), output, alias and temporary bytes per device of the compiled train step."""
    step = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))
    batch = next(data.make_input(cfg, trainer.mesh))
    stats = step.lower(state, batch).compile().memory_analysis()
    return {
        "state_args": stats.argument_size_in_bytes - batch_bytes_per_device(cfg),
        "outputs": stats.output_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
        "temp": stats.temp_size_in_bytes,
    }


def report(params: int, live: dict[str, int], compiled: dict[str, int]) -> str:
    """A Markdown table of both measurements against the ideal, and the verdict on the larger one."""
    ideal = params * BYTES_PER_PARAM / 8
    live_total = sum(live.values())
    rows = [
        f"parameters: {params:,}; ideal per device (params x {BYTES_PER_PARAM} B / 8): {ideal:,.0f} B",
        "| measurement | bytes/device | / ideal |",
        "|---|---:|---:|",
        f"| live shards: params | {live['params']:,} | |",
        f"| live shards: optimizer state | {live['opt_state']:,} | |",
        f"| live shards: step counter | {live['step']:,} | |",
        f"| live shards: whole train state | {live_total:,} | {live_total / ideal:.4f} |",
        f"| compiled step: arguments - batch | {compiled['state_args']:,} | {compiled['state_args'] / ideal:.4f} |",
        f"| compiled step: outputs (aliased {compiled['aliased']:,}) | {compiled['outputs']:,} | |",
        f"| compiled step: temporaries | {compiled['temp']:,} | |",
    ]
    worst = max(live_total, compiled["state_args"]) / ideal - 1
    verdict = "meets" if worst <= 0.02 else "misses"
    rows.append(f"largest excess over ideal: {100 * worst:.2f}% ({verdict} the 2% target)")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = parser.parse_args(argv)
    cfg = common.load([common.BASE, *MODEL, *args.overrides])
    trainer = Trainer(cfg, mesh.build(cfg))
    state = trainer.init_state()
    live = live_bytes(state)
    compiled = compiled_bytes(trainer, cfg, state)
    print(f"mesh: {dict(trainer.mesh.shape)}")
    print(report(model.param_count(cfg.model), live, compiled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
