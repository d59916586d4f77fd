"""The output head's collectives under a table pipeline schedule: grouped over each microbatch's token shards on the
last stage (training/pipelined.py `_last_stage_groups`, one gather and one reduction a microbatch) against the head
applied piece by piece (what the runner ran before: XLA gathers the sharded head and reduces its gradient at every
loss piece).

    python benchmarks/pipeline_head_collectives.py [key=value ...]

Compiles the 1f1b train step for the 8 simulated CPU devices (stage=2 x fsdp=4, 4 microbatches, the loss in 4
pieces, an 8192-word vocabulary so that the head dominates) twice and prints the all-gather and all-reduce bytes per
step (`planning/collectives.py`: every instruction counted per execution; the last stage's head sits in a branch of
the tick loop, counted at every tick in both programs alike) and the temporaries. Not a test: run it, read the table.
"""

from __future__ import annotations

import sys

import common  # 8 simulated devices, before anything queries JAX
import jax

from maxshard.parallel import mesh
from maxshard.parallel.token_groups import TokenGroups
from maxshard.planning.collectives import count_collectives
from maxshard.planning.compiled import compile_train_step
from maxshard.training import pipelined

SHAPE = (*common.STEP_ONLY, "emb_dim=64", "num_heads=2", "num_kv_heads=2", "head_dim=32", "mlp_dim=128",
         "max_target_length=64", "num_layers=4", "num_layers_per_pipeline_stage=2", "vocab_size=8192",
         "per_device_batch_size=2", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4",
         "num_pipeline_microbatches=4", "pipeline_schedule=1f1b", "loss_chunks=4", "enable_tensorboard=false")
MIB = 2**20


def measure(overrides: list[str], grouped: bool) -> tuple[dict[str, dict[str, int]], int]:
    """(collectives by kind, temporary bytes) of the compiled step; without `grouped` the last stage's token groups
    are empty, so Trainer._head falls back to the plain head over pieces."""
    groups_of = pipelined._last_stage_groups
    if not grouped:
        pipelined._last_stage_groups = lambda trainer: TokenGroups(jax.sharding.get_abstract_mesh(), (), (), ())
    try:
        cfg = common.load([common.BASE, *SHAPE, *overrides])
        step = compile_train_step(cfg, mesh.build(cfg, jax.devices()[:common.DEVICES]))
        return count_collectives(step.as_text()), step.memory_analysis().temp_size_in_bytes
    finally:
        pipelined._last_stage_groups = groups_of


def main(overrides: list[str]) -> None:
    rows = {name: measure(overrides, grouped) for name, grouped in (("per piece", False), ("grouped", True))}
    print("| head | all-gather | all-reduce | reduce-scatter | temporaries |\n|---|---:|---:|---:|---:|")
    for name, (counts, temp) in rows.items():
        cells = [f"{counts[k]['bytes'] / MIB:.1f} MiB" for k in ("all-gather", "all-reduce", "reduce-scatter")]
        print(f"| {name} | {' | '.join(cells)} | {temp / MIB:.2f} MiB |")


if __name__ == "__main__":
    main(sys.argv[1:])
