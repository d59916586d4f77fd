"""Score a run on lm-eval-harness tasks: `python -m maxshard.eval CONFIG.yml tasks=NAME,... key=value ...`.

The command line that trained a run (or the config.yml `python -m maxshard.convert from_hf` wrote) evaluates it:
the checkpoint, its model and tokenizer are found and restored as `maxshard.generate` does
(maxshard/generation/inference.py: trained, converted and LoRA runs alike), laid out on the mesh the command line
names, and lm-eval's evaluator runs the tasks through maxshard/evaluation/harness.py. One line per task on the
console; `eval_output=DIR` also writes what `lm_eval --output_path DIR --log_samples` writes. Unknown tasks and every
other user mistake are one line and exit code 2, before the parameters are read.

Multi-host: every host runs the same command (joining the others as `maxshard.train` does: coordinator_address,
process_count, process_id or the launcher's variables); every process scores every request on the mesh over all of
them and checks that the others were given the same (evaluation/processes.py); process 0 alone prints the scores and
writes eval_output.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import jax

from maxshard import cli
from maxshard.checkpoint import format as checkpoint_format
from maxshard.config import Config
from maxshard.data.tokenizer import make_tokenizer
from maxshard.errors import ConfigError
from maxshard.evaluation import processes, tasks
from maxshard.generation import inference
from maxshard.model.transformer import count_params
from maxshard.parallel import mesh, sharding
from maxshard.run import loading

__all__ = ["main", "run", "load", "USAGE"]

USAGE = """usage: python -m maxshard.eval CONFIG.yml tasks=NAME[,NAME...] [key=value ...]

Scores the latest checkpoint of base_output_directory/run_name (or load_parameters_path) on lm-eval-harness tasks,
e.g. a model converted from Hugging Face on the example tasks shipped in configs/eval_tasks:
  python -m maxshard.eval OUT/config.yml tasks=local_choice,local_rolling,local_generate \\
      eval_tasks_dir=configs/eval_tasks eval_output=eval_results
Keys: eval_tasks_dir (task YAMLs over local files), eval_tasks_limit (documents per task), eval_batch_size,
eval_output (results + samples as lm_eval writes them), seed; the model comes from the checkpoint, the mesh knobs
from the command line (no pipeline). Multi-host: the same command on every host (coordinator_address, process_count,
process_id, or the launcher's variables); process 0 prints and writes. Needs lm-eval: pip install -e ".[eval]"."""


def load(argv: Sequence[str], devices: Sequence[jax.Device] | None = None) -> tuple[Config, str, Any, Any]:
    """(config, checkpoint step directory, the tasks found, lm-eval's LM on the restored parameters): everything
    but the evaluation itself. `devices` (default: all of this process's) is what the mesh is laid over."""
    num_devices = None if devices is None else len(devices)
    cfg = loading.load_run(argv, num_devices, join_processes=devices is None, check_fit=False)  # no train step
    inference.refuse_pipeline(cfg)
    if not cfg.tasks:
        raise ConfigError("set tasks=NAME[,NAME...]: the lm-eval tasks to score (e.g. tasks=local_choice with "
                          "eval_tasks_dir=configs/eval_tasks)")
    found = tasks.find(tasks.names(cfg.tasks, "tasks"), cfg.eval_tasks_dir)
    step_dir = inference.find_checkpoint(cfg)
    saved = checkpoint_format.read_config(step_dir)
    cfg = inference.with_saved_model(cfg, saved)
    tokenizer = make_tokenizer(cfg)
    eval_mesh, rules = mesh.build(cfg, devices), sharding.flax_rules(cfg)
    params = inference.restore_params(step_dir, cfg, eval_mesh, rules, saved.get("load_parameters_path", ""))
    from maxshard.evaluation import harness  # deferred: lm-eval is optional; tasks.find said so in one line

    if processes.is_primary():
        print(f"checkpoint: {step_dir} ({count_params(params) / 1e6:.2f}M parameters), mesh: "
              f"{mesh.describe(eval_mesh)}, tasks: {', '.join(found.names)}", flush=True)

    return cfg, step_dir, found, harness.build(cfg, eval_mesh, rules, params, tokenizer)


def run(argv: Sequence[str], devices: Sequence[jax.Device] | None = None) -> int:
    """The command, on `devices` (default: all of this process's)."""
    cfg, step_dir, found, lm = load(argv, devices)
    output = cfg.eval_output if processes.is_primary() else ""
    results = tasks.evaluate(lm, found, cfg.eval_tasks_limit, cfg.seed, model_name=step_dir, output=output)
    if not processes.is_primary():
        return 0
    for line in tasks.summary_lines(results):
        print(line, flush=True)
    if output:
        print(f"wrote lm-eval results and samples under {os.path.relpath(output)}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.entry(argv, USAGE, run)


if __name__ == "__main__":
    sys.exit(main())
