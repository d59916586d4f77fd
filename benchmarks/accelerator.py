"""What the accelerator benchmarks (attention_gpu.py, remat_gpu.py, gpu_kernels.py) set up the same way.

Unlike `common.py` (8 simulated CPU devices, JAX_PLATFORMS=cpu), these run on whatever devices JAX finds, so
importing this module changes no JAX setting. It puts the repository on `sys.path`, builds a run's config from
default keys that the command line's overrides replace, prepares one compiled train step with its state and batch
as the trainer would, times a callable by its median and turns a step time into tokens/s and MFU.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "base.yml")
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import jax  # noqa: E402

from maxshard import data  # noqa: E402
from maxshard.config import Config  # noqa: E402
from maxshard.model import flops, quantization
from maxshard import perf
from maxshard.parallel import mesh
from maxshard.run import loading
from maxshard.training.step import Trainer  # noqa: E402


def load(defaults: Sequence[str], overrides: Sequence[str]) -> Config:
    """configs/base.yml + `defaults` + `overrides` as the trainer loads them; an override replaces the default of
    the same key (the CLI refuses a key given twice)."""
    given = {o.split("=", 1)[0] for o in overrides}
    kept = [o for o in defaults if o.split("=", 1)[0] not in given]
    return loading.load_run([BASE, *kept, *overrides])


@dataclasses.dataclass
class CompiledStep:
    """A run's train step compiled for its state and one batch; `run()` takes one step and returns its loss."""

    cfg: Config
    step: Any  # jax.stages.Compiled
    state: Any
    batch: Any

    def run(self) -> jax.Array:
        self.state, metrics = self.step(self.state, self.batch)
        return metrics["loss"]


def compile_step(cfg: Config) -> CompiledStep:
    """Init the state in its sharded layout, take the first synthetic (or configured) batch, compile the step."""
    trainer = Trainer(cfg, mesh.build(cfg))
    state = trainer.init_state()
    batch = next(data.make_input(cfg, trainer.mesh))
    step = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh)).lower(state, batch).compile()
    return CompiledStep(cfg, step, state, batch)


def median_seconds(fn: Callable[[], object], steps: int) -> float:
    """Median wall time of `steps` calls of `fn` (each waited for), after one untimed call that warms it up."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput(cfg: Config, seconds: float) -> dict[str, Any]:
    """A step of `seconds`: its time in ms, tokens/s per device and MFU (model FLOPs; None on a device kind with no
    known peak)."""
    tokens = cfg.global_batch_size * cfg.max_target_length
    figures = perf.step_perf(tokens, flops.flops_per_token(cfg.model) * tokens, seconds, cfg.num_devices,
                             quantization.peak_flops(cfg))
    return {"step_ms": seconds * 1e3, "tokens_per_sec": figures["tokens_per_sec_per_device"], "mfu": figures["mfu"]}
