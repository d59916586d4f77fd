"""Input tokens/s of a two-source mixture (Parquet + JSONL.zst, packed) next to what the 125m train step consumes.

    python benchmarks/data_mixture.py [--length 256] [--batches 100] [--steps 1] [--rounds 3] [--mb 24] [key=value ...]

The corpus is generated into a temporary directory: `--mb` MB of text, two thirds as Parquet (row groups of 1,000
documents), one third as JSONL compressed with zstd, documents of 40-800 words drawn from a Zipf-distributed
vocabulary. The pipeline row is `make_input(cfg, mesh, "train")` on `dataset_mixture=[[*.parquet, 0.7],
[*.jsonl.zst, 0.3]]` with packing and the byte tokenizer, timed as in `data_throughput.py` (startup and first batch
apart, which includes decompressing the JSONL once; then `--batches` batches as global jax.Arrays). The step row is
the train step of `model_name=125m` on synthetic batches of the same shape, timed as in `data_vs_step.py`.

Both use the same global batch (8 rows: per_device_batch_size=1 on 8 simulated CPU devices) and `--length` tokens
per row instead of the preset's 2048, so one 125m step takes seconds rather than minutes on a shared CPU. A step's
tokens/s hardly depends on the length (the matmuls' FLOPs per token do not; attention's grow with it), so the
shorter rows, if anything, flatter the step and make the reported ratio conservative.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import numpy as np
from data_throughput import measure
from data_vs_step import step_seconds

from maxshard import config
from maxshard.parallel import mesh as mesh_lib

BASE = common.BASE


def write_corpus(root: str, megabytes: float, seed: int = 0) -> tuple[str, str]:
    """A Parquet file and a JSONL.zst file of generated documents; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rng = np.random.default_rng(seed)
    vocabulary = np.array([f"w{i}" for i in range(20_000)])
    weights = 1.0 / np.arange(1, len(vocabulary) + 1)
    words = vocabulary[rng.choice(len(vocabulary), size=int(megabytes * 1e6 / 6), p=weights / weights.sum())]
    lengths = rng.integers(40, 800, size=len(words) // 40)
    ends = np.cumsum(lengths)
    texts = [" ".join(words[a:b]) for a, b in zip(np.concatenate([[0], ends[:-1]]), ends) if b <= len(words)]
    cut = 2 * len(texts) // 3
    parquet_path, jsonl_path = os.path.join(root, "web.parquet"), os.path.join(root, "code.jsonl.zst")
    pq.write_table(pa.table({"text": texts[:cut]}), parquet_path, row_group_size=1000)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts[cut:]).encode()
    with open(jsonl_path, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(lines))
    return parquet_path, jsonl_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both rows")
    parser.add_argument("--length", type=int, default=256, help="tokens per row (the preset's is 2048)")
    parser.add_argument("--batches", type=int, default=100, help="timed pipeline batches")
    parser.add_argument("--steps", type=int, default=1, help="timed train steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="step rounds (median is reported)")
    parser.add_argument("--mb", type=float, default=24, help="megabytes of generated text")
    args = parser.parse_args(argv)
    shape = ["per_device_batch_size=1", f"max_target_length={args.length}", "override_model_config=true"]
    with tempfile.TemporaryDirectory() as root:
        parquet_path, jsonl_path = write_corpus(root, args.mb)
        sizes = {p: os.path.getsize(p) / 1e6 for p in (parquet_path, jsonl_path)}
        mixture = f"[[{parquet_path}, 0.7], [{jsonl_path}, 0.3]]"
        cfg = config.load([BASE, *shape, *args.overrides, f"dataset_mixture={mixture}",
                           f"data_cache_dir={os.path.join(root, 'cache')}"], num_devices=8)
        print(f"corpus: {sizes[parquet_path]:.1f} MB Parquet + {sizes[jsonl_path]:.1f} MB JSONL.zst "
              f"({args.mb:g} MB of text), mixture 0.7/0.3, packing={cfg.packing}, byte tokenizer", flush=True)
        pipeline = measure(cfg, mesh_lib.build(cfg), args.batches)
    print(f"pipeline: {pipeline['tokens_per_s']:,.0f} tokens/s (startup {pipeline['startup_s']:.1f} s)", flush=True)
    runners, seconds = step_seconds({"125m": [BASE, "model_name=125m", *shape, *args.overrides]}, args.steps,
                                    args.rounds, warmup=1)
    step_cfg = runners["125m"].cfg
    step_tps = runners["125m"].tokens_per_step / seconds["125m"]
    ratio = pipeline["tokens_per_s"] / step_tps
    print(f"model 125m: emb {step_cfg.emb_dim}, {step_cfg.num_layers} layers, vocab {step_cfg.vocab_size}; mesh "
          + " ".join(f"{k}={v}" for k, v in mesh_lib.build(step_cfg).shape.items() if v > 1)
          + f"; {os.cpu_count()} cores")
    print("| global batch | pipeline tokens/s | startup s | 125m step s | 125m step tokens/s | pipeline / step |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| {cfg.global_batch_size} x {cfg.max_target_length} | {pipeline['tokens_per_s']:,.0f} | "
          f"{pipeline['startup_s']:.1f} | {seconds['125m']:.2f} | {step_tps:,.0f} | {ratio:.1f} |")
    print(f"ratio pipeline / step: {ratio:.1f}x (target >= 10x: {'met' if ratio >= 10 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
