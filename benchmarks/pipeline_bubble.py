"""Pipeline bubble: measured train-step time of a 4-stage circular pipeline against (S-1)/(M*R + S-1).

    python benchmarks/pipeline_bubble.py [--steps 3] [--rounds 3] [key=value ...]

Every configuration trains the same 16-layer model on the same global batch over 8 devices (stage=4 x fsdp=2);
only the repeats R (with L = 16 / (4 R) layers per stage) and the microbatches M change. Bubble stages compute on
zeros, so on simulated CPU devices, which share the host's cores, the bubble shows up as extra work: the step time
should scale like 1 / (1 - bubble). Configurations are timed round-robin and the fastest round counts, so a change
of machine load between configurations does not masquerade as a bubble. The last rows run the same model without a pipeline
(fsdp=8) on the same devices. Not a test: run it, read the table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import jax

from maxshard import data
from maxshard.spec import pipeline_schedule
from maxshard.parallel import mesh
from maxshard.training.step import Trainer

MODEL = (*common.STEP_ONLY, "emb_dim=128", "mlp_dim=256", "num_heads=4", "num_kv_heads=4", "head_dim=32",
         "max_target_length=64", "num_layers=16", "per_device_batch_size=4")
STAGES = 4


class Run:
    """One compiled configuration, ready to time: its train step, state and batch iterator."""

    def __init__(self, overrides: Sequence[str]) -> None:
        self.cfg = common.load([common.BASE, *MODEL, *overrides])
        trainer = Trainer(self.cfg, mesh.build(self.cfg))
        self.step = trainer.jit_train_step(data.batch_sharding(self.cfg, trainer.mesh))
        self.batches = data.make_input(self.cfg, trainer.mesh)
        self.state = trainer.init_state()
        self.seconds_per_step(2)  # compiles and warms up

    def seconds_per_step(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.state, metrics = self.step(self.state, next(self.batches))
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / steps


def pipelined(repeats: int, microbatches: int) -> list[str]:
    per_stage = 16 // (STAGES * repeats)
    return [f"ici_pipeline_parallelism={STAGES}", "ici_fsdp_parallelism=2", f"num_pipeline_repeats={repeats}",
            f"num_layers_per_pipeline_stage={per_stage}", f"num_pipeline_microbatches={microbatches}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per timing round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all configs; the fastest round counts")
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run")
    args = parser.parse_args()
    names = [f"S=4 R={r} M={m}" for r in (1, 2, 4) for m in (4, 8, 16)] + ["no pipeline, fsdp=8"]
    overrides = [pipelined(r, m) for r in (1, 2, 4) for m in (4, 8, 16)] + [["ici_fsdp_parallelism=8"]]
    runs = [Run([*o, *args.overrides]) for o in overrides]
    print(f"compiled {len(runs)} configurations", flush=True)
    best = [float("inf")] * len(runs)
    for _ in range(args.rounds):  # round-robin, so a change in machine load hits every configuration alike
        best = [min(b, run.seconds_per_step(args.steps)) for b, run in zip(best, runs)]
    print_table([(n, _bubble(run.cfg), b) for n, run, b in zip(names, runs, best)])


def _bubble(cfg) -> float:
    return 0.0 if cfg.model.pipeline is None else pipeline_schedule.of(cfg.model.pipeline).bubble_fraction


def print_table(rows: list[tuple[str, float, float]]) -> None:
    """Step times relative to the fastest pipelined run, next to the formula's 1 / (1 - bubble) relative to it."""
    _, best_bubble, best_seconds = min(rows[:-1], key=lambda row: row[2])
    print(f"\n{'config':24s} {'bubble':>8s} {'s/step':>9s} {'measured':>9s} {'formula':>9s}")
    for name, bubble, seconds in rows:
        formula = (1 - best_bubble) / (1 - bubble)
        print(f"{name:24s} {bubble:8.3f} {seconds:9.3f} {seconds / best_seconds:9.2f} {formula:9.2f}")


if __name__ == "__main__":
    main()
