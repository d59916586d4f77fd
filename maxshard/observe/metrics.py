"""What a run records about itself: TensorBoard scalars, one JSON line per logged step, and the console line.

Three rules shape this module:
- Every figure that is printed is also written, to TensorBoard for people and to `metrics.jsonl` for
  tools (`tools/plot_metrics.py`, benchmarks) that should not need TensorBoard to read a run.
- Only the primary process writes; on the others the writer is a no-op, so the training loop needs no `if`.
- Reading a metric must never stall the device: `DeferredMetrics` turns step N's device arrays into Python floats
  only after step N+1 has been dispatched, so the host waits for work that is already done or nearly so.

The throughput arithmetic (tokens/s, TFLOP/s, MFU) lives in `maxshard/perf.py`, each chip's peak in the
device registry `maxshard/devices.py`; trace capture lives in `maxshard/observe/profiling.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import yaml

# JSON key -> TensorBoard tag. Keys not listed here that contain a "/" ("moe/dropped_fraction",
# "pipeline/bubble_fraction") are used as their own tag; any other key goes under "misc/".
TAGS: Mapping[str, str] = {
    "loss": "learning/loss",
    "learning_rate": "learning/learning_rate",
    "grad_norm": "learning/grad_norm",
    "param_norm": "learning/param_norm",
    "step_time": "perf/step_time",
    "tokens_per_sec_per_device": "perf/tokens_per_sec_per_device",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "bytes_in_use": "memory/bytes_in_use",
    "peak_bytes_in_use": "memory/peak_bytes_in_use",
    "bytes_limit": "memory/bytes_limit",
    "eval_loss": "eval/loss",
}

Scalar = float | int
Value = Scalar | Sequence[Scalar] | None

METRICS_FILE = "metrics.jsonl"
# tensorboardX writes events from a background thread and flushes the file every `flush_secs` (default 120 s);
# 1 s bounds what a killed process can lose at the cost of at most one small flush per second.
TB_FLUSH_SECS = 1


def tag_for(key: str) -> str:
    """The TensorBoard tag of a metric key; grouping by prefix keeps the TensorBoard page readable."""
    if key in TAGS:
        return TAGS[key]
    return key if "/" in key else f"misc/{key}"


def _json_value(value: Value) -> Any:
    """Strict JSON has no NaN/inf; a diverged loss is recorded as null rather than corrupting the file."""
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, np.generic):  # numpy scalars from a host-side computation
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Writes scalars to TensorBoard and `run_dir/metrics.jsonl`; a no-op unless `is_primary`.

    A JSON line is in the file when `write` returns (line-buffered: a killed process loses none); TensorBoard
    events follow within about `TB_FLUSH_SECS`. `close` (or leaving the `with` block, also on an exception)
    drains both completely.
    """

    def __init__(self, run_dir: str, tensorboard_dir: str, is_primary: bool, enable_tensorboard: bool = True):
        self.is_primary = is_primary
        self._jsonl = None
        self._tb = None
        if not is_primary:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.jsonl_path = os.path.join(run_dir, METRICS_FILE)
        self._jsonl = open(self.jsonl_path, "a", buffering=1, encoding="utf-8")  # line-buffered
        if enable_tensorboard:
            from tensorboardX import SummaryWriter  # deferred: only the primary process needs it

            self._tb = SummaryWriter(logdir=tensorboard_dir, flush_secs=TB_FLUSH_SECS)

    @classmethod
    def from_config(cls, cfg: Any, is_primary: bool) -> MetricsWriter:
        """From a finalized Config: `run_dir`, `tensorboard_dir`, `enable_tensorboard`."""
        return cls(cfg.run_dir, cfg.tensorboard_dir, is_primary, cfg.enable_tensorboard)

    def write(self, step: int, metrics: Mapping[str, Value]) -> None:
        """Records one step. None values (e.g. MFU on an unknown device) are left out of both sinks."""
        if not self.is_primary:
            return
        present = {k: v for k, v in metrics.items() if v is not None}
        record = {"step": int(step), "time": time.time(), **{k: _json_value(v) for k, v in present.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in present.items():
                self._add_scalars(tag_for(key), value, step)

    def _add_scalars(self, tag: str, value: Value, step: int) -> None:
        """A sequence (e.g. per-expert load) becomes one scalar per index: `tag/0`, `tag/1`, ..."""
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self._tb.add_scalar(f"{tag}/{i}", float(v), step)
        else:
            self._tb.add_scalar(tag, float(value), step)

    def write_startup(self, figures: Mapping[str, Any]) -> None:
        """The run's startup figures (console.startup_figures) as one `{"step": 0, "startup": {...}}` JSON line.

        Written at every start, so a resumed run's file holds one such record per start; tools take the last."""
        if not self.is_primary:
            return
        record = {"step": 0, "time": time.time(), "startup": json.loads(json.dumps(figures, default=_json_value))}
        self._jsonl.write(json.dumps(record) + "\n")

    def write_config(self, config: Any) -> None:
        """The run's config as YAML text under the `config` tag, so a TensorBoard page says what it shows."""
        if not self.is_primary or self._tb is None:
            return
        text = config_to_yaml(config)
        self._tb.add_text("config", "    " + text.replace("\n", "\n    "), 0)  # indented: Markdown code block

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def config_to_yaml(config: Any) -> str:
    """A dataclass Config or a mapping as YAML; tuples become lists so `yaml.safe_dump` accepts them."""
    data = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    return yaml.safe_dump(_plain(data), sort_keys=False, default_flow_style=None)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------- deferred fetch


class StepValues(NamedTuple):
    """One step's metrics as Python values; `ready_time` is `time.perf_counter()` when they were fetched."""

    step: int
    values: dict[str, Value]
    ready_time: float


class DeferredMetrics:
    """Keeps one step's device metrics in flight and fetches the previous step's.

    Usage in the loop:
        state, m = train_step(state, batch)      # dispatched, not finished
        done = deferred.push(step, m)            # blocks on step-1 only, while `step` runs on the device
        if done: log(done)
        ...
        done = deferred.flush()                  # after the loop: the last step

    Fetching step N right after its dispatch would make the host wait for the whole step while the device has
    nothing queued; fetching one step late keeps the device busy. Consecutive `ready_time`s are also a good
    steady-state step time, since each fetch returns as soon as that step has finished on the device.
    """

    def __init__(self) -> None:
        self._pending: tuple[int, Mapping[str, Any]] | None = None

    def push(self, step: int, metrics: Mapping[str, Any]) -> StepValues | None:
        """Holds `metrics` (device arrays) and returns the previously held step as Python values."""
        previous, self._pending = self._pending, (step, dict(metrics))
        return _fetch(previous)

    def flush(self) -> StepValues | None:
        """The held step, fetched now (end of training or before an evaluation)."""
        previous, self._pending = self._pending, None
        return _fetch(previous)


def _fetch(pending: tuple[int, Mapping[str, Any]] | None) -> StepValues | None:
    if pending is None:
        return None
    step, arrays = pending
    host = jax.device_get(arrays)  # one transfer for the whole dict
    values = {k: _to_python(v) for k, v in host.items()}
    return StepValues(step, values, time.perf_counter())


def _to_python(value: Any) -> Value:
    """0-d arrays become float (int for integer dtypes); larger arrays become flat lists of floats."""
    if value is None:
        return None
    array = np.asarray(value)
    if array.ndim == 0:
        return int(array) if np.issubdtype(array.dtype, np.integer) else float(array)
    return [float(v) for v in array.reshape(-1)]


# --------------------------------------------------------------------------------------------- device memory


def memory_stats(device: Any = None) -> dict[str, int] | None:
    """Bytes in use / peak / limit of one local device, or None where the backend reports nothing (CPU).

    One device stands for all: under SPMD every device holds the same shapes, so their usage differs little.
    """
    device = device if device is not None else jax.local_devices()[0]
    stats = device.memory_stats()
    if not stats or "bytes_in_use" not in stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(stats[k]) for k in keys if k in stats}
