"""Writes tests/fixtures/eval/NAME.json: what lm-eval's own Hugging Face backend scores on the example tasks of
configs/eval_tasks/ for the Hugging Face fixtures of tests/fixtures/hf (tools/make_hf_fixtures.py).

Run once, by hand, in the venv that holds torch and transformers (never a dependency of maxshard or its CI):

    /work/trlvenv/bin/pip install lm-eval==0.4.13
    /work/trlvenv/bin/python tools/make_eval_fixtures.py

The backend loads each fixture in float32 (the fixtures' bfloat16 weights exactly, computed as maxshard computes
on CPU) with `max_length=32`, so the longer rolling documents span several windows and generation left-truncates
as it would at a model's full context; batch size 1. Each file holds, per task, lm-eval's metrics and every
document's `resps` (log-likelihoods and greedy flags, rolling log-likelihoods, or generated text), in document order.
"""

from __future__ import annotations

import json
import os
import pathlib

import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

REPO = pathlib.Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "configs" / "eval_tasks"
OUT = REPO / "tests" / "fixtures" / "eval"
NAMES = ("llama_gqa", "qwen3", "qwen3_moe")
TASKS = ["local_choice", "local_rolling", "local_generate"]
MAX_LENGTH = 32


def score(name: str) -> dict:
    model = HFLM(pretrained=str(REPO / "tests" / "fixtures" / "hf" / name), dtype="float32", batch_size=1,
                 max_length=MAX_LENGTH, device="cpu")
    results = lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=TaskManager(include_path=str(TASKS_DIR)),
                                      log_samples=True, bootstrap_iters=0)
    out = {}
    for task in TASKS:
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        metrics = {k: v for k, v in results["results"][task].items() if k != "alias" and "stderr" not in k}
        out[task] = {"metrics": metrics, "resps": [s["resps"] for s in samples],
                     "filtered_resps": [s["filtered_resps"] for s in samples]}
    return out


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    os.chdir(TASKS_DIR)  # lm_eval reads the tasks' relative data_files from the working directory
    for name in NAMES:
        (OUT / f"{name}.json").write_text(json.dumps(score(name), indent=1) + "\n")
        print(f"wrote {OUT / name}.json")


if __name__ == "__main__":
    main()
