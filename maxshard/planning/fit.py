"""Does the run fit its devices? The planned peak per device under each remat policy against the usable memory,
and `remat_policy: auto`: the least recomputation that fits.

Recomputation is counted in FLOPs, as the planner prices a step (`estimate.remat_factors`): the forward matmuls and
attention the backward re-runs. Of policies that recompute equally, the one with the smaller peak is taken: `none`
and `minimal` both re-run no matmul, and `minimal` keeps only the matmul outputs instead of every intermediate, so
it wins unless a fused attention kernel makes it re-run the attention. (On XLA:CPU at benchmarks/maxtext_compare.py's
shape, `minimal` took 0.93x `none`'s CPU time and 0.93x its wall time.)

Capacity per device, in order: `device_memory_gb` (GB = 1e9 bytes); an accelerator's own limit
(`Device.memory_stats()["bytes_limit"]`, what the allocator may use); on CPU, the host's available memory
(`MemAvailable` of /proc/meminfo) shared by the local devices. With several processes the smallest capacity of any
process is used, so every process picks the same policy and compiles the same program.

Usable = capacity x (1 - `memory_headroom`): the planner is checked within 15% of XLA's own buffer assignment
(tests/test_plan_memory.py), and a device also holds what no step plan counts (allocator fragmentation, input
prefetch, a checkpoint's device copy).

The plan decides before anything is compiled: `auto` picks the cheapest policy that fits (the one that recomputes
least), and a policy planned more than PLAN_ERROR over the usable memory is one error line naming the shortfall and
the cheapest policy that fits. Within PLAN_ERROR the compiled program has the last word (`maxshard/compile_check.py`:
XLA's peak of the step that will run), so no policy is refused whose compiled program fits.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from maxshard.config import Config, ConfigError
from maxshard.config_schema import MemoryFit
from maxshard.planning import estimate, memory
from maxshard.units import format_bytes

__all__ = ["Capacity", "cheapest", "configured_capacity", "local_capacity", "peaks_by_policy", "decide", "usable",
           "verdict"]

_GB = 1e9
# How far over the usable memory a plan may be before it alone refuses a policy: the bound within which the planner
# is checked against XLA (tests/test_plan_memory.py); closer calls are left to the compiled step.
PLAN_ERROR = 0.15


@dataclasses.dataclass(frozen=True)
class Capacity:
    bytes: int
    source: str  # for a person: where the figure comes from


def _host_available() -> int:
    """MemAvailable of /proc/meminfo (what the kernel can give without swapping); the free pages elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _agreed(value: int) -> int:
    """The smallest `value` over processes (one process: itself)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.array([value // 2**20], np.int32)))) * 2**20


def configured_capacity(cfg: Config) -> Capacity | None:
    """`device_memory_gb` when set (it overrides whatever a device reports)."""
    if cfg.device_memory_gb > 0:
        return Capacity(int(cfg.device_memory_gb * _GB), f"device_memory_gb={cfg.device_memory_gb:g}")
    return None


def local_capacity(cfg: Config) -> Capacity:
    """The memory one device of this run has (module docstring)."""
    configured = configured_capacity(cfg)
    if configured is not None:
        return configured
    devices = jax.local_devices()
    stats = devices[0].memory_stats() if devices[0].platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return Capacity(_agreed(int(stats["bytes_limit"])), f"{devices[0].device_kind} allocator limit")
    available = _host_available()
    per_device = _agreed(available // len(devices))
    shared = f" / {len(devices)} devices" if len(devices) > 1 else ""
    return Capacity(per_device, f"host available memory {format_bytes(available)}{shared}")


def usable(cfg: Config, capacity: Capacity) -> int:
    return int(capacity.bytes * (1 - cfg.memory_headroom))


def peaks_by_policy(cfg: Config) -> dict[str, int]:
    """The planned peak bytes per device under every remat policy, most memory first. State, gradients and the
    fsdp-gathered weights do not depend on the policy: they are planned once."""
    base = estimate.make_plan(dataclasses.replace(cfg, remat_policy="full"))
    state = base.params + base.optimizer + base.gradients
    return {policy: state + estimate.activations_under(base, policy).total for policy in memory.POLICIES_BY_MEMORY}


def decide(cfg: Config, capacity: Capacity, strict: bool = True) -> MemoryFit:
    """The policy the run uses: `auto` -> the least recompute that fits (`cheapest`); an explicit policy -> itself.
    When it does not fit, the fit with `fits` False (`auto` -> full); with `strict`, a ConfigError (one line) when
    it is planned more than PLAN_ERROR over, beyond what the compiled step could overturn."""
    peaks = peaks_by_policy(cfg)
    decided = _fit(cfg, peaks, capacity)
    if strict and decided.planned_bytes > decided.usable_bytes * (1 + PLAN_ERROR):
        raise ConfigError(_shortfall(cfg, peaks, decided.usable_bytes, capacity))
    return decided


def _fit(cfg: Config, peaks: dict[str, int], capacity: Capacity) -> MemoryFit:
    """`decide` on peaks already planned."""
    limit = usable(cfg, capacity)
    policy = cfg.remat_policy
    if policy == "auto":
        fitting = _fitting(peaks, limit)
        policy = cheapest(cfg, fitting, peaks) if fitting else "full"
    return MemoryFit(cfg.remat_policy, policy, peaks[policy], limit, capacity.bytes, capacity.source,
                     peaks[policy] <= limit)


def _fitting(peaks: dict[str, int], limit: int) -> list[str]:
    return [p for p, b in peaks.items() if b <= limit]


def cheapest(cfg: Config, fitting: list[str], peaks: dict[str, int]) -> str:
    """Of the policies that fit, the one whose backward re-runs the fewest FLOPs; of equal ones, the smallest."""
    factors = estimate.remat_factors(cfg)
    return min(fitting, key=lambda policy: (factors[policy], peaks[policy]))


_SHARD_MORE = "shard more (ici_fsdp_parallelism, ici_tensor_parallelism) or lower per_device_batch_size"


def _shortfall(cfg: Config, peaks: dict[str, int], limit: int, capacity: Capacity) -> str:
    room = (f"the {format_bytes(limit)} usable per device ({capacity.source}, "
            f"memory_headroom={cfg.memory_headroom:g})")
    fitting = _fitting(peaks, limit)
    if fitting:
        policy, best = cfg.remat_policy, cheapest(cfg, fitting, peaks)
        return (f"remat_policy={policy} needs {format_bytes(peaks[policy])} per device (planned peak), "
                f"{format_bytes(peaks[policy] - limit)} more than {room}; the cheapest policy that fits is "
                f"remat_policy={best} ({format_bytes(peaks[best])})")
    least = peaks["full"]
    return (f"remat_policy={cfg.remat_policy}: no remat policy fits; even remat_policy=full needs "
            f"{format_bytes(least)} per device (planned peak), {format_bytes(least - limit)} more than {room}; "
            f"{_SHARD_MORE} or raise device_memory_gb")


def verdict(cfg: Config, capacity: Capacity) -> tuple[bool, str]:
    """(fits, one line) for a planned run: `fit: yes, <planned> of <usable> (<policy>)`, or `fit: no, <by how much>,
    <what would fit>`. `auto` is judged by the policy it chose (`cfg.memory_fit`), an explicit policy by itself."""
    requested = cfg.memory_fit.requested if cfg.memory_fit is not None else cfg.remat_policy
    peaks = peaks_by_policy(cfg)
    decided = _fit(dataclasses.replace(cfg, remat_policy=requested), peaks, capacity)
    planned, limit = format_bytes(decided.planned_bytes), format_bytes(decided.usable_bytes)
    if decided.fits:
        return True, f"fit: yes, {planned} of {limit} usable ({decided.policy})"
    over = format_bytes(decided.planned_bytes - decided.usable_bytes)
    fitting = _fitting(peaks, decided.usable_bytes)
    best = cheapest(cfg, fitting, peaks) if fitting else None
    instead = (f"remat_policy={best} fits ({format_bytes(peaks[best])})" if best else
               f"no remat policy fits: {_SHARD_MORE}")
    return False, f"fit: no, {over} over the {limit} usable ({decided.policy} plans {planned}); {instead}"
