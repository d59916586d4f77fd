"""The planner against XLA:TPU for a local/global (sliding-window) model, compiled ahead of time without a TPU:
planned vs compiled train-step peak per device, and the planned model FLOPs against the same model all global.

    python benchmarks/local_global_plan.py [--topology v5litepod-8] [--only NAME] [--plan-only] [key=value ...]

The model is Gemma-3-like in its attention pattern (five local layers, then a global one; window 512 at 2048 tokens)
and a ~220M-parameter Llama otherwise: 12 x 1024, 8 query and 4 kv heads of 128, mlp 4096, 32k vocabulary, 2
sequences per chip, fsdp=8 on a v5e 2x4 slice, remat full, bfloat16; beside it the same model all global, and a
4-layer pattern at 4096 tokens under save_qkv_proj. Attention is dot_product by default, the implementation that
takes the window everywhere on main (a mask over the whole [q, kv] scores); `attention=splash` runs the TPU kernel
once it takes the window. libtpu describes the slice (`planning/tpu_compile.py`) and XLA:TPU compiles each variant's
train step (2-7 minutes each on 2 busy cores); the plan is `maxshard.plan`'s. Printed per variant: planned and
compiled peak, their ratio (tests/test_plan_heldout_tpu.py holds held-out shapes within 0.95-1.15), the planned model FLOPs per device
and step, and their ratio to the same model with every layer global. Figures: benchmarks/README.md, "Local/global".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiled for the TPU slice libtpu describes; nothing runs here

from maxshard.config import Config  # noqa: E402
from maxshard.launch import topologies  # noqa: E402
from maxshard.model import flops  # noqa: E402
from maxshard.parallel import mesh  # noqa: E402
from maxshard.planning import compiled, estimate  # noqa: E402
from maxshard.planning.tpu_compile import abstract_devices  # noqa: E402
from maxshard.run.target import load_for_target  # noqa: E402

MODEL = ("model_name=125m", "override_model_config=true", "emb_dim=1024", "num_layers=12", "num_heads=8",
         "num_kv_heads=4", "head_dim=128", "mlp_dim=4096", "max_target_length=2048", "per_device_batch_size=2",
         "attention=dot_product", "remat_policy=full", "dataset_type=synthetic")
VARIANTS = {
    "local x5 + global, window 512": ("attention_pattern=[local,local,local,local,local,global]",
                                      "sliding_window=512"),
    "global only": ("attention_pattern=[global]", "sliding_window=0"),
    "local x3 + global, 4096 tokens, window 1024, save_qkv_proj": (
        "attention_pattern=[local,local,local,global]", "sliding_window=1024", "max_target_length=4096",
        "per_device_batch_size=1", "remat_policy=save_qkv_proj"),
}


def _global_share(cfg: Config) -> float:
    """The model FLOPs over those of the same model with every layer global."""
    every = dataclasses.replace(cfg.model, sliding_window=0, attention_pattern=("global",))
    return flops.flops_per_token(cfg.model) / flops.flops_per_token(every)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5litepod-8", help="a TPU slice as XPK names it")
    parser.add_argument("--only", default="", help="the variants whose name contains this")
    parser.add_argument("--plan-only", action="store_true", help="print the plans, compile nothing")
    parser.add_argument("overrides", nargs="*", help="config key=value overrides, for every variant")
    args = parser.parse_args()
    target = topologies.parse(args.topology)
    devices = None if args.plan_only else abstract_devices(target)
    print(f"{'variant':<62}{'planned':>12}{'XLA:TPU':>12}{'plan/compiled':>15}{'TFLOPs/device':>15}{'/ global':>10}"
          f"{'compile':>9}")
    configs = {}
    for name, keys in VARIANTS.items():
        if args.only not in name:
            continue
        merged = {item.split("=", 1)[0]: item for item in (*MODEL, *keys, *args.overrides)}  # the command line wins
        configs[name] = load_for_target(["configs/base.yml", *merged.values()], target)
    plans = {name: estimate.make_plan(cfg, target) for name, cfg in configs.items()}
    for name, cfg in configs.items():
        plan = plans[name]
        if args.plan_only:
            print(f"{name:<62}{_mib(plan.peak_bytes):>12}{'':>27}{plan.model_flops / 1e12:>15.3f}"
                  f"{_global_share(cfg):>10.3f}")
            continue
        started = time.perf_counter()
        stats = compiled.compile_train_step(cfg, mesh.build(cfg, devices)).memory_analysis()
        seconds = time.perf_counter() - started
        peak = compiled.peak_bytes(stats)
        print(f"{name:<62}{_mib(plan.peak_bytes):>12}{_mib(peak):>12}{plan.peak_bytes / peak:>15.2f}"
              f"{plan.model_flops / 1e12:>15.3f}{_global_share(cfg):>10.3f}{seconds:>8.0f}s", flush=True)


if __name__ == "__main__":
    main()
