"""lm-eval-harness tasks through maxshard's own sharded model: the batched, sharded scorer of token rows
(scoring), the harness's `LM` on top of it and the generation engine (harness), and finding, running and reporting
tasks (tasks). `python -m maxshard.eval` runs them on a checkpoint; training runs them at `eval_tasks_period`."""
