"""maxshard vs MaxText: steady-state tokens/s of the same model, batch and mesh (fsdp=8) on 8 simulated CPU devices,
each trainer at its own default remat policy.

    python benchmarks/maxtext_compare.py [--venv /tmp/maxtext-venv] [--steps 12] [--repeats 1] [--same-jax]
                                         [--maxshard-remat default|full|none|full,none,...]

Optional: MaxText (PyPI `maxtext`) needs Python >= 3.12, so it lives in its own venv outside the repo
(see docs in benchmarks/README.md). Without that venv this prints why and exits 0.

The shape is issue #21's: emb 256, 4 layers, 4 query / 4 kv heads x 64, mlp 1024 (SwiGLU), vocab 1024, length
256, per-device batch 2 (global 16 x 256 = 4,096 tokens a step), fsdp=8 on 8 simulated CPU devices, scanned
layers, AdamW with clipping, synthetic data, no checkpoints, no TensorBoard.

Both sides compute in float32 with float32 weights: maxshard's `dtype=auto` is float32 on CPU already, but
MaxText's base.yml defaults to `dtype: bfloat16`, which CPUs emulate slowly (converting around every matmul), so
MaxText is given `dtype=float32` to compare the frameworks rather than bf16 emulation.

Remat: each trainer runs at its own default. MaxText's base.yml says `remat_policy: 'full'` (printed from the
venv's base.yml at start). maxshard gets no `remat_policy` key unless `--maxshard-remat` names one: its default
(configs/base.yml) is what a user gets, `auto` once that lands (the least recompute whose planned peak fits the
device; on CPU the capacity is host memory or `device_memory_gb`). `--maxshard-remat` takes a comma list of
policies, `default` meaning no key, and runs one maxshard variant per entry, interleaved with MaxText: e.g.
`--maxshard-remat full` reproduces the equal-footing baseline (both full recompute), `full,none,default` measures
what skipping recompute buys. For each maxshard run the policy it ran with is printed from the first record of
its metrics.jsonl (the startup record) if that record carries a `remat_policy` field, else 'n/a'.

Attention is left at each side's default too: maxshard's `attention: auto` is dot_product on CPU up to one block
(512 tokens; maxshard/model/attention_choice.py), MaxText's `autoselected` is dot_product on CPU
(layers/attention_op.py), so both run plain dot-product attention at length 256.

All runners run as subprocesses, alternating (A, B, C, then C, B, A on the next repeat) so that a slow minute on
the shared machine does not fall on one side only. The figure per run is the median step time over steps after
the first two (warm-up), as each trainer reports it: maxshard's `step_time` from metrics.jsonl, the interval
between MaxText's "completed step: N, seconds: S" log lines. tokens/s = global batch x length / step time.

What is not held equal: the JAX version. maxshard runs in this repo's venv, MaxText in its own (newer JAX).
`--same-jax` adds, for every maxshard variant, a runner of it under the MaxText venv's Python, to tell the
frameworks apart from the JAX versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
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
    """The model, batch and mesh both sides train: issue #21's side-by-side shape."""

    emb: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    mlp: int = 1024
    vocab: int = 1024
    length: int = 256
    per_device_batch: int = 2
    devices: int = 8

    @property
    def tokens_per_step(self) -> int:
        return self.per_device_batch * self.devices * self.length


def maxshard_argv(shape: Shape, steps: int, out: str, run: str, remat: str | None = None) -> list[str]:
    """The trainer's command line; `remat` None leaves `remat_policy` at maxshard's default (no key)."""
    keys = {
        "dataset_type": "synthetic", "cpu_device_count": shape.devices, "ici_fsdp_parallelism": shape.devices,
        "emb_dim": shape.emb, "num_layers": shape.layers, "num_heads": shape.heads, "num_kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "mlp_dim": shape.mlp, "vocab_size": shape.vocab, "max_target_length": shape.length,
        "per_device_batch_size": shape.per_device_batch, "steps": steps, "log_period": 1, "eval_period": 0,
        "dtype": "float32", "weight_dtype": "float32", "scan_layers": "true",
        "enable_checkpointing": "false", "enable_tensorboard": "false", "run_name": run, "base_output_directory": out,
    }  # fmt: skip
    if remat is not None:
        keys["remat_policy"] = remat
    return ["-m", "maxshard.train", os.path.join(REPO, "configs", "base.yml"), *(f"{k}={v}" for k, v in keys.items())]


def maxtext_argv(shape: Shape, steps: int, out: str, run: str, base_yml: str) -> list[str]:
    keys = {
        "dataset_type": "synthetic", "hardware": "cpu", "skip_jax_distributed_system": "True",
        "ici_fsdp_parallelism": shape.devices, "base_emb_dim": shape.emb, "base_num_decoder_layers": shape.layers,
        "base_num_query_heads": shape.heads, "base_num_kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "base_mlp_dim": shape.mlp, "vocab_size": shape.vocab, "max_target_length": shape.length,
        "per_device_batch_size": shape.per_device_batch, "steps": steps, "dtype": "float32",
        "weight_dtype": "float32", "scan_layers": "True",
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


def maxtext_default(base_yml: str, key: str) -> str:
    """A top-level key's value as MaxText's base.yml states it (read as text: the yml is only shown, not used)."""
    with open(base_yml, encoding="utf-8") as f:
        found = re.search(rf"^{re.escape(key)}:\s*['\"]?([^'\"#\s]+)", f.read(), re.M)
    return found.group(1) if found else "?"


def run(python: str, argv: Sequence[str], env_extra: dict[str, str], log_path: str, timeout_s: float) -> str:
    """Runs a trainer to completion and returns its output (also saved to `log_path`); raises on failure."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONUNBUFFERED": "1", **env_extra}  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([python, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"  {argv[1]}: whole process {cpu:.0f} CPU s (start-up and compilation included)", flush=True)
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


def _find_key(value: object, key: str) -> object:
    """The first value under `key` anywhere in nested dicts/lists (depth first), or None."""
    if isinstance(value, dict):
        if key in value:
            return value[key]
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            found = _find_key(item, key)
            if found is not None:
                return found
    return None


def maxshard_remat_chosen(run_dir: str) -> str:
    """The remat policy the run reports in its first metrics.jsonl record (the startup record), or 'n/a'.

    Read defensively: the field may sit at the top level or inside `startup`, and older trainers do not write it.
    """
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            first = json.loads(next(line for line in f if line.strip()))
    except (OSError, StopIteration, ValueError):
        return "n/a"
    found = _find_key(first, "remat_policy")
    return "n/a" if found is None else str(found)


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
    remat: str | None = None  # maxshard's remat_policy key; None: not passed (the trainer's default)
    chosen: list[str] = dataclasses.field(default_factory=list)  # per run: the policy maxshard reports using

    def step_time(self, shape: Shape, steps: int, out: str, index: int, base_yml: str, timeout_s: float) -> float:
        name = f"{re.sub(r'[^a-z0-9]+', '-', self.label.lower()).strip('-')}-{index}"
        if self.is_maxtext:
            argv = maxtext_argv(shape, steps, out, name, base_yml)
        else:
            argv = maxshard_argv(shape, steps, out, name, self.remat)
        output = run(self.python, argv, self.env, os.path.join(out, f"{name}.log"), timeout_s)
        times = maxtext_step_times(output) if self.is_maxtext else maxshard_step_times(os.path.join(out, name))
        if not self.is_maxtext:
            self.chosen.append(maxshard_remat_chosen(os.path.join(out, name)))
            print(f"  {self.label}: remat policy reported by the run: {self.chosen[-1]}", flush=True)
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


def table(seconds: dict[str, list[float]], shape: Shape, remat: dict[str, str]) -> str:
    """Markdown rows per runner and the maxshard / MaxText ratio of tokens/s (> 1: maxshard is faster)."""
    lines = ["| trainer | remat policy | ms/step (median of runs) | runs (ms) | tokens/s | tokens/s/device |",
             "|---|---|---:|---|---:|---:|"]  # fmt: skip
    for label, runs in seconds.items():
        s = statistics.median(runs)
        each = ", ".join(f"{r * 1e3:.0f}" for r in runs)
        lines.append(f"| {label} | {remat.get(label, '?')} | {s * 1e3:.0f} | {each} | "
                     f"{shape.tokens_per_step / s:,.0f} | {shape.tokens_per_step / s / shape.devices:,.0f} |")
    mt = statistics.median(seconds["MaxText"])
    for label, runs in seconds.items():
        if label != "MaxText":
            lines.append(f"ratio {label} / MaxText (tokens/s): {mt / statistics.median(runs):.2f}x")
    return "\n".join(lines)


def maxshard_runner(variant: str, python: str, env: dict[str, str], suffix: str) -> Runner:
    """A maxshard runner for one `--maxshard-remat` entry ('default': no remat_policy key)."""
    remat = None if variant == "default" else variant
    label = "maxshard (default remat)" if remat is None else f"maxshard remat={remat}"
    return Runner(label + suffix, python, env, remat=remat)


def remat_cell(runner: Runner) -> str:
    """What the table says of a maxshard runner's policy: as passed, and as the run reported it."""
    reported = ", ".join(sorted(set(runner.chosen))) or "n/a"
    return f"{runner.remat or 'default'}; run reports: {reported}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=os.environ.get("MAXTEXT_VENV", DEFAULT_VENV), help="MaxText's venv")
    parser.add_argument("--steps", type=int, default=12, help="steps per run (the first two are warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per trainer, alternating")
    parser.add_argument("--same-jax", action="store_true", help="also run maxshard with the MaxText venv's JAX")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--maxshard-remat", default="default",
                        help="comma list of maxshard remat policies to run, one variant each; 'default' passes no "
                             "remat_policy key (the trainer's own default), e.g. 'full' or 'full,none,default'")
    args = parser.parse_args(argv)
    found = find_maxtext(args.venv)
    if isinstance(found, str):
        print(f"maxtext_compare: skipped: {found}")
        return 0
    python, base_yml = found
    variants = [v.strip() for v in args.maxshard_remat.split(",") if v.strip()] or ["default"]
    runners = [maxshard_runner(v, sys.executable, {}, "") for v in variants]
    runners.insert(min(1, len(runners)), Runner("MaxText", python, {}, is_maxtext=True))
    if args.same_jax:
        runners += [maxshard_runner(v, python, {"PYTHONPATH": REPO}, " (MaxText's JAX)") for v in variants]
    shape = Shape()
    mt_remat = maxtext_default(base_yml, "remat_policy")
    print(f"shape: {shape}; {args.steps} steps per run, {args.repeats} run(s) each; {os.cpu_count()} cores", flush=True)
    print(f"MaxText's base.yml defaults: remat_policy={mt_remat}, attention={maxtext_default(base_yml, 'attention')}, "
          f"dtype={maxtext_default(base_yml, 'dtype')} (overridden to float32)", flush=True)  # fmt: skip
    out = tempfile.mkdtemp(prefix="maxtext-compare-")
    seconds = compare(runners, shape, args.steps, args.repeats, base_yml, out, args.timeout)
    remat = {r.label: f"{mt_remat} (default)" if r.is_maxtext else remat_cell(r) for r in runners}
    print(table(seconds, shape, remat))
    print(f"logs: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
