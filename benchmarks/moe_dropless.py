"""Step time of dropless MoE: grouped matmuls (`moe_dropless_impl=tiled`) vs every expert on every token (`dense`).

    python benchmarks/moe_dropless.py [--experts 8,16,32] [--steps N] [--rounds R] [key=value ...]

A small all-MoE model (top-2, capacity_factor=-1: dropless) on 2 simulated CPU devices with fsdp=2 (no expert
parallelism: each device routes and computes its own 4 x 128 tokens), for each expert count E and both
implementations (two devices for the two cores of the machine the README's table comes from).
Every variant is compiled and warmed up first; then they take turns for `--rounds` rounds of `--steps` timed steps,
and the table shows the median round's step time. The all-experts path does E / k times the routed expert FLOPs,
the grouped one ~1.2x them (tile padding), so the gap should grow with E; attention, the router and the optimizer
are the same in both.

On CPU, `moe_dropless_impl=auto` is `tiled` (jax lowers `ragged_dot` on CPU as a masked dense dot, as many FLOPs as
`dense`); on accelerators it is `ragged_dot`.
"""

from __future__ import annotations

import argparse

import numpy as np
from moe_capacity import Run, prepare, time_round  # benchmarks/ is the script's directory

MODEL = (
    "dataset_type=synthetic", "emb_dim=128", "num_layers=2", "num_heads=4", "num_kv_heads=4", "head_dim=32",
    "mlp_dim=256", "max_target_length=128", "num_experts_per_tok=2", "moe_layer_interval=1",
    "per_device_batch_size=4", "eval_period=0", "enable_tensorboard=false",
)
LAYOUT = ("cpu_device_count=2", "ici_fsdp_parallelism=2")
IMPLS = (("grouped", "tiled"), ("all-experts", "dense"))


def table(runs: dict[tuple[int, str], Run], experts: list[int]) -> str:
    head = f"{'experts':>7} {'grouped ms':>10} {'all-experts ms':>14} {'all-experts / grouped':>21} {'E / k':>5}"
    lines = [head, "-" * len(head)]
    for e in experts:
        grouped, dense = (float(np.median(runs[e, name].times)) for name, _ in IMPLS)
        k = runs[e, "grouped"].cfg.num_experts_per_tok
        lines.append(f"{e:>7} {grouped * 1e3:>10.1f} {dense * 1e3:>14.1f} {dense / grouped:>21.2f} {e / k:>5.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="8,16,32", help="comma-separated expert counts")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; variants take turns so load hits all alike")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides (replace the defaults above)")
    args = parser.parse_args()
    experts = [int(e) for e in args.experts.split(",")]
    merged = {item.split("=", 1)[0]: item for item in (*MODEL, *LAYOUT, *args.overrides)}  # the command line wins
    overrides = list(merged.values())
    runs = {
        (e, name): prepare(name, [*overrides, f"num_experts={e}", f"moe_dropless_impl={impl}"], -1.0, args.warmup)
        for e in experts for name, impl in IMPLS
    }
    for _ in range(args.rounds):
        for run in runs.values():
            time_round(run, args.steps)
    print(f"MoE dropless, grouped vs all experts: {' '.join(overrides)}")
    print(table(runs, experts))


if __name__ == "__main__":
    main()
