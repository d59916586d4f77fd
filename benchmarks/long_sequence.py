"""Train a few steps on one 32k-token sequence on CPU with attention=auto (blockwise there), through the real CLI.

    python benchmarks/long_sequence.py [--length 32768] [--steps 3] [key=value ...]

Not a CI test: on 2 shared CPU cores it takes minutes (see benchmarks/README.md). dot_product would need ~70 GiB of
temporaries for this step (benchmarks/attention_memory.py); blockwise needs ~430 MiB at 8 devices' batch, so a single
simulated device with one 32k row fits in a few hundred MiB. Prints the trainer's own log and the wall time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(length: int, steps: int, output_dir: str, overrides: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", "maxshard.train", os.path.join(REPO, "configs", "base.yml"),
        "model_name=tiny", "override_model_config=true", "dataset_type=synthetic", "attention=auto",
        f"max_target_length={length}", "per_device_batch_size=1", "cpu_device_count=1", f"steps={steps}",
        "log_period=1", "eval_period=0", "enable_checkpointing=false", "enable_tensorboard=false",
        f"base_output_directory={output_dir}", "run_name=long_sequence", *overrides,
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    args = parser.parse_args(argv)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as output_dir:
        start = time.perf_counter()
        result = subprocess.run(command(args.length, args.steps, output_dir, args.overrides), env=env, cwd=REPO)
        seconds = time.perf_counter() - start
    print(f"{args.steps} steps of 1 x {args.length} tokens: exit {result.returncode}, {seconds:.0f} s wall")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
