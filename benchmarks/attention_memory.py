"""Compiled train-step temporaries per device against sequence length, blockwise vs dot_product attention.

    python benchmarks/attention_memory.py [--lengths 2048 8192 32768] [--skip-dot-product-from 32768] [key=value ...]

The tiny model (`model_name=tiny`), per_device_batch_size=1, fsdp=8 on 8 simulated CPU devices, remat_policy=full.
The train step is lowered from abstract arguments (`jax.ShapeDtypeStruct` with shardings) and compiled; nothing is
allocated. `memory_analysis().temp_size_in_bytes` is what the step needs beyond its arguments and outputs, per
device. Beside it: the planner's activation estimate (`maxshard/planning/memory.py`) for the same config.

dot_product materialises float32 scores [batch, kv_heads, group, length, length] and grows with length squared;
blockwise keeps [block_q, block_kv] scores at a time and grows linearly. A length where dot_product takes minutes
to compile can be skipped (--skip-dot-product-from); its row then says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


from maxshard import config  # noqa: E402
from maxshard.parallel import mesh
from maxshard.planning import compiled, estimate  # noqa: E402
from maxshard.run import loading

BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")
MODEL = ("model_name=tiny", "override_model_config=true", "dataset_type=synthetic", "per_device_batch_size=1",
         "ici_fsdp_parallelism=8", "remat_policy=full", "eval_period=0")
MIB = 2**20


def load(length: int, attention: str, *overrides: str) -> config.Config:
    argv = [BASE, *MODEL, f"max_target_length={length}", f"attention={attention}", *overrides]
    return loading.complete(config.finalize(config.parse(argv), 8, "cpu"))


def compiled_temp_bytes(cfg: config.Config) -> int:
    """Temporaries per device of the compiled train step, lowered from abstract sharded arguments."""
    step = compiled.compile_train_step(cfg, mesh.build(cfg, jax.devices()[: cfg.num_devices]))
    return step.memory_analysis().temp_size_in_bytes


def measure(length: int, attention: str, *overrides: str) -> dict[str, float]:
    cfg = load(length, attention, *overrides)
    start = time.perf_counter()
    temp = compiled_temp_bytes(cfg)
    seconds = time.perf_counter() - start
    planned = estimate.make_plan(cfg).activations
    return {"length": length, "attention": cfg.model.attention, "temp": temp, "plan": planned, "seconds": seconds}


def table(rows: list[dict[str, float]]) -> str:
    lines = ["| length | attention | compiled temporaries | planner activations | plan / compiled | compile s |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['length']:,} | {r['attention']} | skipped: {r['skipped']} | | | |")
            continue
        lines.append(f"| {r['length']:,} | {r['attention']} | {r['temp'] / MIB:,.1f} MiB | {r['plan'] / MIB:,.1f} MiB "
                     f"| {r['plan'] / r['temp']:.2f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def ratios(rows: list[dict[str, float]], attention: str) -> str:
    temps = {r["length"]: r["temp"] for r in rows if r["attention"] == attention and not r.get("skipped")}
    lengths = sorted(temps)
    parts = [f"{b}/{a}: {temps[b] / temps[a]:.2f}" for a, b in zip(lengths, lengths[1:])]
    return f"{attention} growth: " + ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--implementations", nargs="+", default=["dot_product", "blockwise"])
    parser.add_argument("--skip-dot-product-from", type=int, default=0,
                        help="lengths from which dot_product is not compiled (0: never skip)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = parser.parse_args(argv)
    rows = []
    for length in args.lengths:
        for attention in args.implementations:
            if attention == "dot_product" and 0 < args.skip_dot_product_from <= length:
                rows.append({"length": length, "attention": attention, "skipped": "quadratic scores, slow compile"})
                continue
            rows.append(measure(length, attention, *args.overrides))
            print(rows[-1], flush=True)
    print(table(rows))
    for attention in args.implementations:
        print(ratios(rows, attention))
    return 0


if __name__ == "__main__":
    sys.exit(main())
