"""Tokens per second the input pipeline delivers, as global jax.Arrays, with 0, 1 and 2 grain workers.

    python benchmarks/data_throughput.py [CONFIG.yml] [key=value ...] [--batches 200] [--workers 0,1,2]

Defaults to configs/base.yml: the stdlib corpus, byte tokenizer, packing. Each row builds a fresh iterator, times
the first batch (listing, worker start-up) apart, then `--batches` more. "tokens/s" counts every position of the
batch; "loss tokens/s" only those with loss weight (they differ by padding). The train step's consumption is
compared elsewhere; here the pipeline alone is measured, with nothing else competing for the cores. Like every
benchmark here it runs on 8 simulated CPU devices, so the global batch is 8 x per_device_batch_size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path

from maxshard import config
from maxshard.data import make_input
from maxshard.parallel import mesh as mesh_lib


def measure(cfg: config.Config, mesh, batches: int) -> dict[str, float]:
    """Start-up seconds, then tokens/s and loss-weighted tokens/s over `batches` batches."""
    start = time.perf_counter()
    it = make_input(cfg, mesh)
    try:
        next(it)["inputs"].block_until_ready()
        startup = time.perf_counter() - start
        weighted = 0.0
        start = time.perf_counter()
        for _ in range(batches):
            batch = next(it)
            weighted += float(batch["loss_weights"].sum())  # also waits for the arrays
        seconds = time.perf_counter() - start
    finally:
        it.close()
    tokens = batches * cfg.global_batch_size * cfg.max_target_length
    return {"startup_s": startup, "tokens_per_s": tokens / seconds, "loss_tokens_per_s": weighted / seconds}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="*", help="CONFIG.yml and key=value overrides (default: configs/base.yml)")
    parser.add_argument("--batches", type=int, default=200, help="timed batches per row")
    parser.add_argument("--workers", default="0,1,2", help="comma-separated grain_worker_count values")
    args = parser.parse_args(argv)
    has_yml = args.config and args.config[0].endswith((".yml", ".yaml"))
    cfg_argv = args.config if has_yml else [common.BASE, *args.config]
    cfg_argv = [a for a in cfg_argv if not a.startswith("grain_worker_count=")]  # set per row below
    base = common.load(cfg_argv)
    mesh = mesh_lib.build(base)
    print(f"{base.dataset_type} data ({base.dataset_path or 'stdlib'}), batch {base.global_batch_size} x "
          f"{base.max_target_length}, packing={base.packing}, {args.batches} batches per row, {os.cpu_count()} cores")
    print(f"{'workers':>7} {'startup s':>10} {'tokens/s':>12} {'loss tokens/s':>14}")
    for workers in (int(w) for w in args.workers.split(",")):
        cfg = common.load([*cfg_argv, f"grain_worker_count={workers}"])
        row = measure(cfg, mesh, args.batches)
        rates = f"{row['tokens_per_s']:>12,.0f} {row['loss_tokens_per_s']:>14,.0f}"
        print(f"{workers:>7} {row['startup_s']:>10.2f} {rates}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
