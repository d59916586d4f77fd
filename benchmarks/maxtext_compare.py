"""maxshard vs MaxText: steady-state tokens/s of the same model, batch and mesh (fsdp=8) on 8 simulated CPU devices.

    python benchmarks/maxtext_compare.py [--venv /tmp/maxtext-venv] [--steps 12] [--repeats 1] [--same-jax]

Optional: MaxText (PyPI `maxtext`) needs Python >= 3.12, so it lives in its own venv outside the repo
(see docs in benchmarks/README.md). Without that venv this prints why and exits 0.

Both trainers run as subprocesses, alternating (maxshard, MaxText, then MaxText, maxshard on a second repeat) so
that a slow minute on the shared machine does not fall on one side only. The figure per run is the median step
time over steps after the first two (warm-up), as each trainer reports it: maxshard's `step_time` from
metrics.jsonl, MaxText's "completed step: N, seconds: S" log lines. tokens/s = global batch x length / step time.

What is held equal: shape (emb, layers, heads, kv heads, head_dim, mlp, vocab), global batch and length, mesh
(fsdp=8), float32 compute and weights (maxshard's `dtype=auto` is float32 on CPU; MaxText defaults to bfloat16,
which CPUs emulate slowly), full remat, scanned layers, AdamW with clipping, synthetic data, no checkpoints, no
TensorBoard. What is not: the JAX version. maxshard runs in this repo's venv, MaxText in its own (newer JAX).
`--same-jax` adds a third runner, maxshard under the MaxText venv's Python, to tell the frameworks apart from
the JAX versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VENV = "/tmp/maxtext-venv"
WARMUP_STEPS = 2  # steps left out of the median on both sides


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model, batch and mesh both sides train: the 256-wide model of compile_time.py and memory.py."""

    emb: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 32
    mlp: int = 1024
    vocab: int = 512
    length: int = 128
    per_device_batch: int = 2
    devices: int = 8

    @property
    def tokens_per_step(self) -> int:
        return self.per_device_batch * self.devices * self.length


def maxshard_argv(shape: Shape, steps: int, out: str, run: str) -> list[str]:
    keys = {
        "dataset_type": "synthetic", "cpu_device_count": shape.devices, "ici_fsdp_parallelism": shape.devices,
        "emb_dim": shape.emb, "num_layers": shape.layers, "num_heads": shape.heads, "num_kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "mlp_dim": shape.mlp, "vocab_size": shape.vocab, "max_target_length": shape.length,
        "per_device_batch_size": shape.per_device_batch, "steps": steps, "log_period": 1, "eval_period": 0,
        "dtype": "float32", "weight_dtype": "float32", "remat_policy": "full", "scan_layers": "true",
        "enable_checkpointing": "false", "enable_tensorboard": "false", "run_name": run, "base_output_directory": out,
    }  # fmt: skip
    return ["-m", "maxshard.train", os.path.join(REPO, "configs", "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


def maxtext_argv(shape: Shape, steps: int, out: str, run: str, base_yml: str) -> list[str]:
    keys = {
        "dataset_type": "synthetic", "hardware": "cpu", "skip_jax_distributed_system": "True",
        "ici_fsdp_parallelism": shape.devices, "base_emb_dim": shape.emb, "base_num_decoder_layers": shape.layers,
        "base_num_query_heads": shape.heads, "base_num_kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "base_mlp_dim": shape.mlp, "vocab_size": shape.vocab, "max_target_length": shape.length,
        "per_device_batch_size": shape.per_device_batch, "steps": steps, "dtype": "float32",
        "weight_dtype": "float32", "remat_policy": "full", "scan_layers": "True", "attention": "dot_product",
        "enable_checkpointing": "False", "enable_tensorboard": "False", "run_name": run,
        "base_output_directory": out,
    }  # fmt: skip
    return ["-m", "maxtext.trainers.pre_train.train", base_yml, *(f"{k}={v}" for k, v in keys.items())]


def find_maxtext(venv: str) -> tuple[str, str] | str:
    """(python, MaxText's base.yml) of the venv, or a message saying what is missing."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        return f"no MaxText venv at {venv} (needs Python >= 3.12; see benchmarks/README.md)"
    probe = "import os, maxtext; print(os.path.dirname(maxtext.__file__))"
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
    if found.returncode:
        return f"{python} cannot import maxtext: {(found.stderr.strip().splitlines() or ['?'])[-1]}"
    base = os.path.join(found.stdout.strip(), "configs", "base.yml")
    return (python, base) if os.path.exists(base) else f"MaxText's base.yml not found at {base}"


def run(python: str, argv: Sequence[str], env_extra: dict[str, str], log_path: str, timeout_s: float) -> str:
    """Runs a trainer to completion and returns its output (also saved to `log_path`); raises on failure."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONUNBUFFERED": "1", **env_extra}  # fmt: skip
    done = subprocess.run([python, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    output = done.stdout + done.stderr
    with open(log_path, "w", encoding="utf-8") as f:
        f.write(output)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv[:2])} exited {done.returncode}; see {log_path}")
    return output


def maxshard_step_times(run_dir: str) -> list[float]:
    """Step times of logged steps 2..N (step 1 holds compilation and is never logged as a step time)."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["step_time"] for r in records if "step_time" in r and r["step"] > WARMUP_STEPS]


def maxtext_step_times(output: str) -> list[float]:
    """Intervals between MaxText's consecutive 'completed step: N' log lines (glog timestamps), warm-up left out.

    The interval, not the 'seconds:' figure on the line, is the counterpart of maxshard's `step_time` (the time
    between the ends of consecutive steps): both then include whatever the loop does besides the step itself.
    """
    stamps = re.findall(r"^I\d{4} (\d\d):(\d\d):([\d.]+) .*completed step: (\d+), seconds:", output, re.M)
    ends = {int(n): int(h) * 3600 + int(m) * 60 + float(sec) for h, m, sec, n in stamps}
    return [(ends[n] - ends[n - 1]) % 86400 for n in sorted(ends) if n >= WARMUP_STEPS and n - 1 in ends]


def maxtext_reported(output: str) -> list[float]:
    """MaxText's own 'seconds:' per step (steps >= WARMUP_STEPS), printed for reference."""
    times = re.findall(r"completed step: (\d+), seconds: ([\d.]+)", output)
    return [float(s) for n, s in times if int(n) >= WARMUP_STEPS]


@dataclasses.dataclass
class Runner:
    """One side of the comparison: how to start it and how to read its step times."""

    label: str
    python: str
    env: dict[str, str]
    is_maxtext: bool = False

    def step_time(self, shape: Shape, steps: int, out: str, index: int, base_yml: str, timeout_s: float) -> float:
        name = f"{re.sub(r'[^a-z0-9]+', '-', self.label.lower()).strip('-')}-{index}"
        if self.is_maxtext:
            argv = maxtext_argv(shape, steps, out, name, base_yml)
        else:
            argv = maxshard_argv(shape, steps, out, name)
        output = run(self.python, argv, self.env, os.path.join(out, f"{name}.log"), timeout_s)
        times = maxtext_step_times(output) if self.is_maxtext else maxshard_step_times(os.path.join(out, name))
        if self.is_maxtext and maxtext_reported(output):
            print(f"  MaxText's own 'seconds:' median {statistics.median(maxtext_reported(output)) * 1e3:.0f} ms",
                  flush=True)  # fmt: skip
        if not times:
            raise RuntimeError(f"{self.label}: no steady step times found in its output ({out}/{name}.log)")
        return statistics.median(times)


def compare(runners: list[Runner], shape: Shape, steps: int, repeats: int, base_yml: str, out: str,
            timeout_s: float) -> dict[str, list[float]]:  # fmt: skip
    """Median step time of every run, runners alternating in order, then reversed, repeat after repeat."""
    seconds: dict[str, list[float]] = {r.label: [] for r in runners}
    for rep in range(repeats):
        for runner in runners if rep % 2 == 0 else runners[::-1]:
            s = runner.step_time(shape, steps, out, rep, base_yml, timeout_s)
            seconds[runner.label].append(s)
            print(f"repeat {rep + 1}: {runner.label}: {s * 1e3:.0f} ms/step", flush=True)
    return seconds


def table(seconds: dict[str, list[float]], shape: Shape) -> str:
    """Markdown rows per runner and the maxshard / MaxText ratio of tokens/s (> 1: maxshard is faster)."""
    lines = ["| trainer | ms/step (median of runs) | tokens/s | tokens/s/device |", "|---|---:|---:|---:|"]
    for label, runs in seconds.items():
        s = statistics.median(runs)
        lines.append(f"| {label} | {s * 1e3:.0f} | {shape.tokens_per_step / s:,.0f} | "
                     f"{shape.tokens_per_step / s / shape.devices:,.0f} |")  # fmt: skip
    mt = statistics.median(seconds["MaxText"])
    for label, runs in seconds.items():
        if label != "MaxText":
            lines.append(f"ratio {label} / MaxText (tokens/s): {mt / statistics.median(runs):.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=os.environ.get("MAXTEXT_VENV", DEFAULT_VENV), help="MaxText's venv")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (the first two are warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per trainer, alternating")
    parser.add_argument("--same-jax", action="store_true", help="also run maxshard with the MaxText venv's JAX")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = parser.parse_args(argv)
    found = find_maxtext(args.venv)
    if isinstance(found, str):
        print(f"maxtext_compare: skipped: {found}")
        return 0
    python, base_yml = found
    runners = [Runner("maxshard", sys.executable, {}), Runner("MaxText", python, {}, is_maxtext=True)]
    if args.same_jax:
        runners.append(Runner("maxshard (MaxText's JAX)", python, {"PYTHONPATH": REPO}))
    shape = Shape()
    print(f"shape: {shape}; {args.steps} steps per run, {args.repeats} run(s) each; {os.cpu_count()} cores", flush=True)
    out = tempfile.mkdtemp(prefix="maxtext-compare-")
    seconds = compare(runners, shape, args.steps, args.repeats, base_yml, out, args.timeout)
    print(table(seconds, shape))
    print(f"logs: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
