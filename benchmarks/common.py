"""What every CPU benchmark script sets up the same way; import it first (`import common`), before anything that
might query JAX's devices.

- 8 simulated CPU devices: `jax_num_cpu_devices` only takes effect before JAX starts a backend, so this module
  sets it on import; JAX_PLATFORMS defaults to cpu so that a machine with an accelerator still measures the
  simulated devices the numbers in benchmarks/README.md were taken on.
- the repository on sys.path: the scripts run as `python benchmarks/NAME.py`, which puts only benchmarks/ there.
- the models the scripts share, as key=value overrides of configs/base.yml, and `load`, so that every script
  builds its config the way the trainer does (`maxshard.run.loading.load_run`) for the same 8 devices.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "base.yml")
DEVICES = 8

if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", DEVICES)  # before the first device query

from maxshard.config import Config  # noqa: E402
from maxshard.run import loading  # noqa: E402

# Synthetic batches and no eval: only the train step (or the pipeline) is measured, never data or evaluation.
STEP_ONLY = ("dataset_type=synthetic", "eval_period=0")

# Small enough to compile in seconds on 2 cores, 8 heads so tensor=8 divides them; global batch 16 x 128.
SMALL_MODEL = (
    *STEP_ONLY, "emb_dim=128", "num_layers=2", "num_heads=8", "num_kv_heads=8", "head_dim=16", "mlp_dim=512",
    "max_target_length=128", "per_device_batch_size=2", "enable_tensorboard=false",
)  # fmt: skip

# The 256-wide model of the compile-time and memory benchmarks; global batch 16 x 128. The depth and the layout
# are each script's own.
WIDE_MODEL = (
    *STEP_ONLY, "emb_dim=256", "num_heads=8", "num_kv_heads=8", "head_dim=32", "mlp_dim=1024",
    "max_target_length=128", "per_device_batch_size=2",
)  # fmt: skip


def load(argv: Sequence[str]) -> Config:
    """`[CONFIG.yml, key=value, ...]` -> the complete Config of a run on the 8 simulated devices."""
    return loading.load_run(argv, num_devices=DEVICES, check_fit=False)  # benchmarks compile shapes they never allocate
