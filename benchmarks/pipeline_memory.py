"""In-flight activations of the pipeline schedules: the train step of a 70B-class pipeline compiled for a TPU slice
ahead of time (libtpu, no TPU), its memory per device per schedule, against what the schedule tables say.

    python benchmarks/pipeline_memory.py [--schedules circular,1f1b,...] [--target v5p-256] [key=value ...]

Llama-3-70B's widths (emb 8192, 64 heads / 8 kv heads of 128, mlp 28672) at length 4096, 16 of its 80 layers and a
1024-token vocabulary, on a v5p-256 slice (128 chips): stage=8 x fsdp=16, 2 layers per stage, M=16 microbatches of
16 sequences (one per device), remat `full`, so what a stage keeps for its backward is its microbatch stage inputs
alone, [1 x 4096 x 8192] bf16 = 64 MiB each. (The whole preset, 80 layers of which 10 per stage and its 128256
vocabulary, compiles for both: `num_layers=80 vocab_size=128256 num_layers_per_pipeline_stage=10`.) XLA:TPU compiles
each schedule's real train step (`memory_analysis`). The table's prediction of the peak difference to circular is
  (circular: M*R + S - 1 kept stage inputs + the M-microbatch circulation buffer + its M/S output microbatches)
  - (a table schedule: its most in-flight stage inputs + output cotangents, `pipeline_tables.Table`)
times one stage input; printed beside three measured differences. `live`: the bytes of the buffers live where the
step's HBM heap is fullest, read off XLA's buffer assignment and live ranges (planning/buffer_dump.py) - what
the schedule holds; `heap`: that heap's size, which adds the gaps XLA's placement leaves between buffers of
different lifetimes (they differ by schedule: 0.41 GiB in 1F1B's heap at the default shape, 0.16 in circular's);
`peak`: the project's compiled peak (`compiled.peak_bytes`: arguments + temporaries + outputs - aliased, the
planner's check), whose temporaries are the heap on libtpu 0.0.52 and more on older releases (benchmarks/README.md,
pipeline schedules). `--target cpu` compiles a small shape for the 8 simulated CPU devices instead (XLA:CPU, float32;
stage=4 x fsdp=2, M=16, 1 MiB stage inputs). Not a test: run it, read the table.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import common  # 8 simulated devices, before anything queries JAX
import jax
import jax.numpy as jnp

from maxshard.launch import topologies
from maxshard.spec import pipeline_schedule
from maxshard.parallel import mesh
from maxshard.planning import buffer_dump, compiled
from maxshard.planning.tpu_compile import abstract_devices
from maxshard.run.target import load_for_target

MODEL = ("dataset_type=synthetic", "emb_dim=8192", "num_heads=64", "num_kv_heads=8", "head_dim=128", "mlp_dim=28672",
         "max_target_length=4096", "num_layers=16", "vocab_size=1024", "ici_pipeline_parallelism=8",
         "ici_fsdp_parallelism=16", "num_layers_per_pipeline_stage=2", "num_pipeline_microbatches=16",
         "per_device_batch_size=2", "remat_policy=full")


CPU_MODEL = ("dataset_type=synthetic", "emb_dim=256", "num_heads=4", "num_kv_heads=4", "head_dim=64", "mlp_dim=512",
             "max_target_length=1024", "num_layers=4", "vocab_size=512", "ici_pipeline_parallelism=4",
             "ici_fsdp_parallelism=2", "num_layers_per_pipeline_stage=1", "num_pipeline_microbatches=16",
             "per_device_batch_size=4", "remat_policy=full", "attention=dot_product")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", default="circular,1f1b")
    parser.add_argument("--target", default="v5p-256")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides (replace the defaults above)")
    args = parser.parse_args()
    cpu = args.target == "cpu"
    target = None if cpu else topologies.parse(args.target)
    devices = jax.devices() if cpu else abstract_devices(target)
    print(f"{'schedule':<14}{'held':>6}{'table says':>13}{'live':>13}{'vs circular':>13}{'heap':>13}"
          f"{'vs circular':>13}{'peak':>13}{'vs circular':>13}{'compile s':>11}")
    reference = None
    for name in args.schedules.split(","):
        keys = (*(CPU_MODEL if cpu else MODEL), f"pipeline_schedule={name}", *args.overrides)
        merged = {i.split("=", 1)[0]: i for i in keys}  # the command line wins
        cfg = common.load([common.BASE, *merged.values()]) if cpu else \
            load_for_target(["configs/base.yml", *merged.values()], target)
        shape = cfg.model.pipeline
        stage_input = (cfg.global_batch_size // shape.microbatches // cfg.ici_fsdp_parallelism
                       * cfg.max_target_length * cfg.emb_dim * jnp.dtype(cfg.model.compute_dtype).itemsize)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as dump:
            step = compiled.compile_train_step(cfg, mesh.build(cfg, devices), buffer_dump.options(dump))
            _, live, heap = buffer_dump.live_at_peak(dump)
        seconds = time.perf_counter() - started
        held = pipeline_schedule.held_at_peak(pipeline_schedule.of(shape))
        row = (held, sum(size for size, _, _ in live), heap, compiled.peak_bytes(step.memory_analysis()))
        reference = reference or row
        predicted = (row[0] - reference[0]) * stage_input
        figures = "".join(f"{_mib(n):>13}{_mib(n - r, '+'):>13}" for n, r in zip(row[1:], reference[1:]))
        print(f"{name:<14}{row[0]:>6}{_mib(predicted, '+'):>13}{figures}{seconds:>11.0f}", flush=True)


def _mib(n: int, sign: str = "") -> str:
    return f"{n / 2**20:{sign}.1f} MiB"


if __name__ == "__main__":
    main()
