"""Crash safety: SIGKILL a training run at seeded random points, resume it each time, compare with an unbroken run.

    python benchmarks/crash_resume.py [--kills 20] [--seed 0] [--dir DIR]

One uninterrupted reference run, then one run directory that is killed with SIGKILL `--kills` times and started
again after each kill, then run to its end. Checkpoints are saved every step, so a kill lands before, during or
just after a save; each kill point is a number of steps past where that start resumed (seeded, 1 to 3 while the
steps left allow) and a phase: the step's progress line, or the "saving checkpoint" line (the save just begun).
Every loss any of these runs logged must equal the reference's loss at that step bit for bit, and so must the
final checkpoint. Prints one line per kill and the verdict; exits 1 on any difference.

tests/test_checkpoint.py runs the same chain with 5 kills on its own tiny run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEYS = (
    "cpu_device_count=8", "dataset_type=text", "emb_dim=32", "num_layers=2", "num_heads=2", "num_kv_heads=2",
    "head_dim=16", "mlp_dim=64", "max_target_length=32", "per_device_batch_size=1", "eval_period=0", "log_period=1",
    "enable_tensorboard=false",
)
MAX_STRIDE = 3


@dataclasses.dataclass(frozen=True)
class Kill:
    """SIGKILL when the run prints the progress line of `step` (or, `during_save`, begins saving it)."""

    step: int
    during_save: bool

    @property
    def pattern(self) -> str:
        return rf"^saving checkpoint at step {self.step}$" if self.during_save else rf"^step {self.step}/"


def next_kill(rng: random.Random, resumed: int, kills_left: int, steps: int) -> Kill:
    """A kill 1..MAX_STRIDE steps past `resumed`, leaving a step for each later kill.

    A kill at step k leaves the run resumable from k - 1 or k (the save before the one in flight is committed),
    so each later kill needs one step more.
    """
    room = steps - 1 - resumed - (kills_left - 1)
    if room < 1:
        raise RuntimeError(f"resumed from step {resumed}: no room left for {kills_left} kills in {steps} steps")
    return Kill(resumed + rng.randint(1, min(room, MAX_STRIDE)), rng.random() < 0.5)


def started_from(output: str) -> int:
    found = re.search(r"resuming from step (\d+)|starting from step 0", output)
    if found is None:
        raise RuntimeError(f"the run did not say where it started:\n{output[-3000:]}")
    return int(found.group(1) or 0)


def run_and_kill(command: Sequence[str], env: dict[str, str], rng: random.Random, kills_left: int, steps: int,
                 timeout: float) -> tuple[Kill, int]:
    """Starts the run and SIGKILLs it at a seeded point past the step it resumed from: (the kill, that step).

    The process is killed on every way out: a watchdog kills it after `timeout` seconds, and a run that ends
    before the kill point is an error.
    """
    proc = subprocess.Popen(list(command), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    seen: list[str] = []
    kill, resumed = None, None
    try:
        for line in proc.stdout:
            seen.append(line)
            if resumed is None and re.search(r"resuming from step|starting from step 0", line):
                resumed = started_from(line)
                kill = next_kill(rng, resumed, kills_left, steps)
            elif kill is not None and re.search(kill.pattern, line):
                return kill, resumed
        raise RuntimeError(f"the run ended (or ran out of its {timeout:.0f}s) before {kill}:\n" + "".join(seen)[-3000:])
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
        proc.stdout.close()


def kill_chain(command: Sequence[str], env: dict[str, str], kills: int, steps: int, seed: int,
               timeout: float = 240) -> list[tuple[Kill, int]]:
    """Starts the run `kills` times and SIGKILLs each start: (kill, step that start resumed from) per start."""
    rng = random.Random(seed)
    return [run_and_kill(command, env, rng, left, steps, timeout) for left in range(kills, 0, -1)]


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every (step, loss) record in metrics.jsonl, duplicates included: each start appends what it trained."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def differences(reference: dict[int, float], logged: list[tuple[int, float]], steps: int) -> list[str]:
    """What differs from the reference: a loss not bit for bit equal at its step, or a step no run logged."""
    wrong = [f"step {s}: loss {loss!r}, reference {reference.get(s)!r}"
             for s, loss in logged if reference.get(s) != loss]
    missing = sorted(set(range(1, steps + 1)) - {s for s, _ in logged})
    return wrong + ([f"steps never logged: {missing}"] if missing else [])


def command(run_dir: Path, steps: int, *extra: str) -> list[str]:
    base, name = run_dir.parent, run_dir.name
    return [sys.executable, "-m", "maxshard.train", str(REPO / "configs" / "base.yml"), *KEYS, f"steps={steps}",
            f"learning_rate_schedule_steps={steps}", f"base_output_directory={base}", f"run_name={name}", *extra]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    steps = args.kills + 4
    root = args.dir or Path(tempfile.mkdtemp(prefix="crash_resume_"))
    import os  # noqa: PLC0415 - only the script needs the environment

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(root / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    reference_dir, killed_dir = root / "reference", root / "killed"
    subprocess.run(command(reference_dir, steps), cwd=REPO, env=env, check=True, capture_output=True)
    reference = dict(logged_losses(reference_dir))
    chain = kill_chain(command(killed_dir, steps, "checkpoint_period=1"), env, args.kills, steps, args.seed)
    for (kill, resumed) in chain:
        phase = "while saving" if kill.during_save else "after its progress line"
        print(f"resumed from step {resumed:3d}, killed at step {kill.step:3d} {phase}", flush=True)
    final = subprocess.run(command(killed_dir, steps, "checkpoint_period=1"), cwd=REPO, env=env, check=True,
                           capture_output=True, text=True)
    print(f"resumed from step {started_from(final.stdout):3d}, ran to the end", flush=True)
    wrong = differences(reference, logged_losses(killed_dir), steps)
    for line in wrong:
        print(f"DIFFERENT: {line}")
    print(f"{len(chain)} kills, {len(logged_losses(killed_dir))} logged losses: "
          f"{'all equal the uninterrupted run' if not wrong else f'{len(wrong)} differences'} ({root})")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
