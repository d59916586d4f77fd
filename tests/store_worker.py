"""One process of the token-store test (tests/test_store.py starts 4 of these, then 2): its rows of a few batches.

Usage: python tests/store_worker.py OUT_PREFIX STEPS [STATE.json] key=value ...   (keys of configs/base.yml)
Loads the run as the trainer does (joining the other processes), takes STEPS batches from `make_input` (after
restoring STATE.json when given) and writes OUT_PREFIX.npz: for each step and field this process's rows of the
global batch, their row numbers, and its read counters per step; OUT_PREFIX.json: the iterator state at the end.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxshard.data import make_input  # noqa: E402
from maxshard.parallel import mesh as mesh_lib  # noqa: E402
from maxshard.run import loading  # noqa: E402


def main(out: str, steps: int, state: str | None, argv: list[str]) -> int:
    cfg = loading.load_run(["configs/base.yml", *argv], join_processes=True, check_fit=False)
    batches = make_input(cfg, mesh_lib.build(cfg))
    if state:
        with open(state, encoding="utf-8") as f:
            batches.set_state(json.load(f))
    saved: dict[str, np.ndarray] = {}
    before = batches.local_reads()
    for step in range(steps):
        batch = batches.__next__()
        for field, array in batch.items():
            shards = {s.index[0].indices(array.shape[0])[:2]: np.asarray(s.data) for s in array.addressable_shards}
            rows = sorted(shards)  # (first, end) of each addressable block of rows, duplicates merged
            saved[f"{step}/{field}"] = np.concatenate([shards[r] for r in rows])
            saved[f"{step}/rows"] = np.concatenate([np.arange(*r) for r in rows])
        after = batches.local_reads()
        saved[f"{step}/reads"] = np.array([after[k] - before[k] for k in ("rows", "tokens", "store_tokens")])
        before = after
    np.savez(out + ".npz", **saved)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(batches.get_state(), f)
    batches.close()
    return 0


if __name__ == "__main__":
    state_arg = sys.argv[3] if sys.argv[3].endswith(".json") else None
    sys.exit(main(sys.argv[1], int(sys.argv[2]), state_arg, sys.argv[4 if state_arg else 3:]))
