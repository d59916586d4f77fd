"""FLOPs of dropless MoE under expert parallelism, compiled for a TPU slice ahead of time: the fixed all_to_all
exchange (worst-case buffer) vs the ragged one (`layers/moe_ragged.py`) at several buffer factors, against dropping.

    python benchmarks/moe_exchange.py [--factors 0,1,1.25,1.5,2] [key=value ...]

tiny_moe (8 experts, top-2, layers 1 and 3 MoE) at 256 tokens, 2 sequences per device, expert=4 x fsdp=2 on a v5e
2x4 slice: libtpu describes the slice (no TPU needed) and XLA:TPU compiles each variant's train step with the TPU
defaults (bfloat16, ragged_dot, remat auto). Printed per variant: the expert rows one device computes per MoE layer,
the step's FLOPs (`cost_analysis`; XLA counts a scanned layer's body once, the same for every variant), their
ratio to dropping at capacity 1.0, and the compiled peak per device.
"""

from __future__ import annotations

import argparse

import common  # noqa: F401 - 8 simulated devices, before anything queries JAX

from maxshard.config import Config
from maxshard.launch import topologies
from maxshard.model.layers import moe, moe_grouped, moe_ragged
from maxshard.parallel import mesh
from maxshard.planning import compiled
from maxshard.planning.tpu_compile import abstract_devices
from maxshard.run.target import load_for_target
from maxshard.units import format_bytes

TARGET = topologies.parse("v5litepod-8")
MODEL = ("model_name=tiny_moe", "override_model_config=true", "max_target_length=256", "dataset_type=synthetic",
         "ici_fsdp_parallelism=2", "ici_expert_parallelism=4")


def variants(factors: list[float]) -> dict[str, tuple[str, ...]]:
    """Name -> overrides: dropping at 1.0 (the reference) and 1.25, the fixed exchange, the ragged one per factor."""
    out = {"dropping, capacity 1.0": ("capacity_factor=1.0",), "dropping, capacity 1.25": ("capacity_factor=1.25",),
           "dropless, fixed all_to_all": ("capacity_factor=-1", "moe_exchange=all_to_all")}
    for f in factors:
        name = "worst case" if f <= 0 else f"factor {f:g}"
        out[f"dropless, ragged {name}"] = ("capacity_factor=-1", "moe_exchange=ragged", f"moe_ragged_buffer_factor={f}")
    return out


def expert_rows(cfg: Config) -> int:
    """Rows one device's experts compute in one MoE layer: its slots when dropping, else its receive buffer."""
    m, p = cfg.model, cfg.ici_expert_parallelism
    tokens = cfg.global_batch_size * cfg.max_target_length // cfg.num_devices
    k, e = m.num_experts_per_tok, m.num_experts
    if m.capacity_factor > 0:
        g = moe.group_size(cfg.max_target_length, m.moe_group_size)
        return tokens // g * e * moe.capacity(g, k, e, m.capacity_factor)
    if m.moe_exchange == "ragged":
        return moe_ragged.buffer_rows(tokens, k, e, p, m.moe_ragged_buffer_factor)
    return p * moe_grouped.exchange_slots(tokens, k, e // p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factors", default="0,1,1.25,1.5,2", help="ragged buffer factors (0: the worst case)")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides (replace the defaults above)")
    args = parser.parse_args()
    devices = abstract_devices(TARGET)
    print(f"{'variant':<34}{'expert rows':>12}{'GFLOPs':>10}{'/ dropping 1.0':>16}{'peak':>12}")
    reference = None
    for name, keys in variants([float(f) for f in args.factors.split(",")]).items():
        merged = {item.split("=", 1)[0]: item for item in (*MODEL, *keys, *args.overrides)}  # the command line wins
        cfg = load_for_target(["configs/base.yml", *merged.values()], TARGET)
        step = compiled.compile_train_step(cfg, mesh.build(cfg, devices))
        cost = step.cost_analysis()
        flops = float((cost[0] if isinstance(cost, list) else cost)["flops"])
        reference = reference or flops
        peak = format_bytes(compiled.peak_bytes(step.memory_analysis()))
        print(f"{name:<34}{expert_rows(cfg):>12}{flops / 1e9:>10.3f}{flops / reference:>16.3f}{peak:>12}", flush=True)


if __name__ == "__main__":
    main()
