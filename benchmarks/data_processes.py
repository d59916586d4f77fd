"""Input seconds per step against process count (1, 2, 4): the document pipeline vs a token store.

    python benchmarks/data_processes.py [key=value ...] [--processes 1,2,4] [--batches 20] [--store DIR]

The same documents (configs/base.yml's source unless overridden: the stdlib corpus, byte tokenizer) are read two
ways: `dataset_type` as given (every process reads and tokenizes the whole global batch, `data/pipeline.py`) and
`dataset_type=store` from a store that `tools/prepare_data.py --store` writes first (each process reads only its
own rows, `data/store.py`). For each process count P, P processes on loopback (8 / P simulated CPU devices each, so
the global batch is the same) take one batch to start, then `--batches` more. Each reports the CPU seconds it spent
per step (all its threads: reading, tokenizing, packing, building the jax.Arrays; the loop does nothing else) and
the wall seconds per step; the table gives their mean over processes and the CPU seconds of all processes together
(the input work of the job). On a machine with fewer cores than processes the wall figures mostly measure the
contention; the CPU figures do not.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import common  # first: the repo on sys.path, JAX on CPU (each worker sets its own device count)

SCRIPT = os.path.abspath(__file__)


def worker(argv: Sequence[str], batches: int) -> dict[str, float]:
    """One process of a run: CPU and wall seconds per step of `make_input`'s batches (after the first)."""
    from maxshard.data import make_input
    from maxshard.parallel import mesh as mesh_lib
    from maxshard.run import loading

    cfg = loading.load_run([common.BASE, *argv], join_processes=True, check_fit=False)
    it = make_input(cfg, mesh_lib.build(cfg))
    try:
        next(it)["inputs"].block_until_ready()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            batch = next(it)
            for array in batch.values():
                array.block_until_ready()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        reads = it.local_reads() if hasattr(it, "local_reads") else None
    finally:
        it.close()
    return {"cpu_s": cpu / batches, "wall_s": wall / batches, "rows": cfg.global_batch_size,
            "length": cfg.max_target_length, "local_rows": reads["rows"] / (batches + 1) if reads else None}


def run(argv: Sequence[str], processes: int, batches: int) -> list[dict[str, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(
        [sys.executable, SCRIPT, "--worker", "--batches", str(batches), *argv,
         f"cpu_device_count={common.DEVICES // processes}", f"process_count={processes}", f"process_id={i}",
         f"coordinator_address=127.0.0.1:{port}", "distributed_timeout=300"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(processes)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a worker failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def prepare(argv: Sequence[str], out_dir: str) -> None:
    """The store of the config's documents, written by the tool users run."""
    keys = dict(a.split("=", 1) for a in argv)
    tool = [sys.executable, os.path.join(common.REPO, "tools", "prepare_data.py"), out_dir, "--store",
            "--workers", "2", "--dataset_type", keys.get("dataset_type", "text")]
    for key in ("dataset_path", "tokenizer_path", "text_field"):
        if key in keys:
            tool += [f"--{key}", keys[key]]
    subprocess.run(tool, check=True, stdout=subprocess.DEVNULL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="*", help="key=value overrides of configs/base.yml")
    parser.add_argument("--processes", default="1,2,4", help="comma-separated process counts (divisors of 8)")
    parser.add_argument("--batches", type=int, default=20, help="timed batches per process")
    parser.add_argument("--store", default="", help="a store of the same documents (default: written first)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.config, args.batches)), flush=True)
        return 0
    defaults = ["per_device_batch_size=8", "max_target_length=1024", "eval_period=0"]
    keys = {a.split("=", 1)[0]: a for a in (*defaults, *args.config)}
    documents = list(keys.values())
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or os.path.join(tmp, "store")
        if not args.store:
            prepare(documents, store)
        from_store = [*(a for a in documents if not a.startswith(("dataset_type=", "dataset_path="))),
                      "dataset_type=store", f"dataset_path={store}"]
        tokenizer = keys.get("tokenizer_path", "tokenizer_path=").split("=", 1)[1] or "byte"
        print(f"{keys.get('dataset_type', 'dataset_type=text')} ({tokenizer} tokenizer) vs store, "
              f"{keys['per_device_batch_size']} x 8 rows x {keys['max_target_length']}, {args.batches} batches, "
              f"{os.cpu_count()} cores")
        print(f"{'processes':>9} {'source':>9} {'rows/process':>12} {'CPU s/step/process':>19} "
              f"{'wall s/step':>11} {'CPU s/step, all':>15}")
        for processes in (int(p) for p in args.processes.split(",")):
            for name, run_argv in (("documents", documents), ("store", from_store)):
                rows = run(run_argv, processes, args.batches)
                cpu = [r["cpu_s"] for r in rows]
                local = rows[0]["local_rows"] or rows[0]["rows"]
                print(f"{processes:>9} {name:>9} {local:>12.0f} {sum(cpu) / len(cpu):>19.4f} "
                      f"{sum(r['wall_s'] for r in rows) / len(rows):>11.4f} {sum(cpu):>15.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
