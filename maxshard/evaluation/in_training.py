"""`eval_tasks` in the training loop: lm-eval tasks scored on the train state's parameters every
`eval_tasks_period` steps, their metrics written to TensorBoard and metrics.jsonl as `eval_tasks/TASK/METRIC`.

Nothing the run resumes from is touched: the parameters are only read (before the next step donates them), the
data iterator is never asked, and the global `random` / `numpy.random` states that lm-eval's evaluator seeds are
put back afterwards, so a run's losses are those of the same run without `eval_tasks`. The scorer and the engine
are built once and keep their compiled programs; each evaluation hands them the current parameters, which have the
same shapes and shardings every step. With several processes every one scores every request on the training mesh
(checked alike, processes.py); process 0 prints, and writes the metrics as it writes every other.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np

from maxshard.config import Config
from maxshard.data.tokenizer import make_tokenizer
from maxshard.errors import ConfigError
from maxshard.evaluation import processes, tasks
from maxshard.training.step import Trainer

__all__ = ["TaskEvaluation"]


class TaskEvaluation:
    """The run's `eval_tasks`, found (unknown names are a ConfigError) when the run starts."""

    def __init__(self, cfg: Config, trainer: Trainer) -> None:
        if cfg.model.pipeline is not None:
            raise ConfigError("eval_tasks scores the unpipelined model; a pipelined run (ici/dcn_pipeline_parallelism"
                              " > 1) cannot: evaluate its checkpoints with python -m maxshard.eval instead")
        self.cfg, self.trainer = cfg, trainer
        self.found = tasks.find(tasks.names(cfg.eval_tasks, "eval_tasks"), cfg.eval_tasks_dir)
        self.tokenizer = make_tokenizer(cfg)
        self._lm: Any = None  # harness.MaxshardLM, built at the first evaluation

    @classmethod
    def from_config(cls, cfg: Config, trainer: Trainer) -> TaskEvaluation | None:
        """None unless eval_tasks is set; one of eval_tasks and eval_tasks_period without the other is a ConfigError."""
        if bool(cfg.eval_tasks) != bool(cfg.eval_tasks_period):
            raise ConfigError(f"eval_tasks={cfg.eval_tasks!r} with eval_tasks_period={cfg.eval_tasks_period}: set both "
                              "(task names and every how many steps to score them) or neither")
        return cls(cfg, trainer) if cfg.eval_tasks else None

    def due(self, step: int) -> bool:
        return step % self.cfg.eval_tasks_period == 0

    def __call__(self, params: Any, step: int) -> dict[str, float]:
        """Scores the tasks on `params`; prints one line per task; returns the metrics to write."""
        if self._lm is None:
            from maxshard.evaluation import harness  # deferred: lm-eval is an optional dependency (the eval extra)

            self._lm = harness.build(self.cfg, self.trainer.mesh, self.trainer.rules, params, self.tokenizer)
        self._lm.scorer.params = self._lm.engine.params = params
        with _global_rng_kept():
            results = tasks.evaluate(self._lm, self.found, self.cfg.eval_tasks_limit, self.cfg.seed)
        if processes.is_primary():
            for line in tasks.summary_lines(results):
                print(f"eval_tasks at step {step}: {line}", flush=True)
        return tasks.scalars(results)


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    """lm-eval seeds Python's and NumPy's global generators; the run gets its own states back."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
