"""Finding, running and reporting lm-eval tasks: lm-eval's own TaskManager, evaluator and EvaluationTracker do the
work; this module only says which tasks, where their local data sit, and what is printed and logged.

Tasks are looked up in `eval_tasks_dir` first (lm-eval task YAMLs over local files: no hub access on clusters);
lm-eval's own catalogue (about 15,000 YAMLs, several seconds to index) is read only when a name is not found there.
A local task's relative `data_files` are read beside its YAML (lm_eval itself would read them from the working
directory), so a task directory can be shipped anywhere, e.g. configs/eval_tasks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from maxshard.errors import ConfigError

__all__ = ["names", "Tasks", "find", "evaluate", "summary_lines", "scalars"]


def names(value: str, key: str) -> tuple[str, ...]:
    """`a,b` -> ("a", "b"); an empty entry is a ConfigError naming `key`."""
    parts = tuple(part.strip() for part in value.split(","))
    if not value or not all(parts):
        raise ConfigError(f"{key} expects lm-eval task names separated by commas (e.g. {key}=local_choice,"
                          f"local_rolling), got {value!r}")
    return parts


@dataclasses.dataclass(frozen=True)
class Tasks:
    """What lm-eval's evaluator takes: the task specs (a name, or a name with its local data paths resolved) and
    the TaskManager that knows them."""

    names: tuple[str, ...]
    specs: tuple[Any, ...]
    manager: Any


def find(task_names: Sequence[str], tasks_dir: str) -> Tasks:
    """The tasks named, from `tasks_dir` first, then lm-eval's catalogue; an unknown name is a ConfigError, before
    any model is loaded."""
    _quiet()
    try:
        from lm_eval.tasks import TaskManager  # deferred: importing lm_eval takes seconds; training may not need it
    except ImportError:
        raise ConfigError("lm-eval tasks need the lm-eval package: pip install -e '.[eval]'") from None

    if tasks_dir and not os.path.isdir(tasks_dir):
        raise ConfigError(f"eval_tasks_dir={tasks_dir} is not a directory of lm-eval task YAMLs")
    manager = TaskManager(include_path=tasks_dir or None, include_defaults=False) if tasks_dir else None
    if manager is None or any(name not in manager.all_tasks for name in task_names):
        manager = TaskManager(include_path=tasks_dir or None)
    missing = [name for name in task_names if name not in manager.all_tasks]
    if missing:
        where = f"eval_tasks_dir={tasks_dir} nor " if tasks_dir else ""
        raise ConfigError(f"unknown lm-eval task {missing[0]!r}: neither {where}lm-eval's own tasks define it "
                          "(`lm_eval ls tasks` lists them)")
    return Tasks(tuple(task_names), tuple(_spec(manager, name) for name in task_names), manager)


def _spec(manager: Any, name: str) -> Any:
    """`name`, or, for a YAML task with relative data_files, its whole config with them made absolute beside the
    YAML (lm-eval builds a task given as a dict from that dict alone, so the dict is the YAML as lm-eval reads it,
    includes and `!function`s resolved, by its own loader)."""
    from lm_eval.tasks._yaml_loader import load_yaml  # private: the loader TaskManager itself uses (lm-eval pinned)

    entry = manager.task_index[name]
    files = ((entry.cfg or {}).get("dataset_kwargs") or {}).get("data_files")
    if entry.yaml_path is None or not files:
        return name
    here = os.path.dirname(os.path.abspath(entry.yaml_path))

    def resolved(path: Any) -> Any:
        if isinstance(path, str):
            return path if "://" in path or os.path.isabs(path) else os.path.join(here, path)
        if isinstance(path, Mapping):
            return {split: resolved(p) for split, p in path.items()}
        return [resolved(p) for p in path]

    cfg = load_yaml(entry.yaml_path, resolve_func=True)
    cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": resolved(files)}
    return cfg


def evaluate(lm: Any, tasks: Tasks, limit: int, seed: int, model_name: str = "maxshard", output: str = ""
             ) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of `lm` on `tasks` (`limit` documents per task, 0: all); with `output`, what
    `lm_eval --output_path OUTPUT --log_samples` writes, by lm-eval's own EvaluationTracker: the results JSON and
    one samples JSONL per task under OUTPUT/<model_name sanitized>/. No bootstrap: the standard errors lm-eval
    computes by resampling take longer than a small task itself."""
    _quiet()
    from lm_eval import evaluator
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=output) if output else None
    results = evaluator.simple_evaluate(model=lm, model_args={"model": model_name}, tasks=list(tasks.specs),
                                        task_manager=tasks.manager, limit=limit or None, log_samples=bool(output),
                                        bootstrap_iters=0, evaluation_tracker=tracker, random_seed=seed,
                                        numpy_random_seed=seed, fewshot_random_seed=seed)
    if results is None:  # only processes other than 0 of a distributed harness get None; ours never is one
        raise RuntimeError("lm-eval returned no results")
    if tracker is not None:
        samples = results.pop("samples")
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"]:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    return results


def _metrics(results: Mapping[str, Any], task: str) -> dict[str, float]:
    """{metric: value} of one task: lm-eval's "acc,none" keys without the filter when it is "none"."""
    out = {}
    for key, value in results["results"][task].items():
        if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
            continue
        metric, filt = key.split(",", 1)
        out[metric if filt == "none" else f"{metric}_{filt}"] = float(value)
    return out


def summary_lines(results: Mapping[str, Any]) -> list[str]:
    """One line per task: its metrics and how many documents it scored."""
    lines = []
    for task in sorted(results["results"]):
        shown = ", ".join(f"{metric} {value:.4f}" for metric, value in _metrics(results, task).items())
        docs = results.get("n-samples", {}).get(task, {}).get("effective")
        lines.append(f"{task}: {shown}" + (f" ({docs} documents)" if docs is not None else ""))
    return lines


def scalars(results: Mapping[str, Any]) -> dict[str, float]:
    """{"eval_tasks/TASK/METRIC": value}: the figures training writes to TensorBoard and metrics.jsonl."""
    return {f"eval_tasks/{task}/{metric}": value for task in sorted(results["results"])
            for metric, value in _metrics(results, task).items()}


def _quiet() -> None:
    """lm-eval and datasets log every step at INFO/WARNING (progress bars, defaults filled in); maxshard prints
    its own one line per task."""
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
