"""Does the run fit its devices? The planned peak per device under each remat policy against the usable memory,
and `remat_policy: auto`: the least recomputation that fits.

Recomputation is counted in FLOPs, as the planner prices a step (`estimate.remat_factors`): the forward matmuls and
attention the backward re-runs. Of policies that recompute equally, the one with the smaller peak is taken: `none`
and `minimal` both re-run no matmul, and `minimal` keeps only the matmul outputs instead of every intermediate, so
it wins unless a fused attention kernel makes it re-run the attention (and it is no slower: benchmarks/README.md,
"MaxText").

An offload policy (maxshard/spec/remat.py) is the last resort, taken only when no policy that keeps everything on the
device fits: it moves every layer's saved activations over the host link twice a step, a cost no FLOP count shows
and no bandwidth figure of the planner prices. Offload policies are candidates only where the compiler moves values
to host memory (XLA:TPU, XLA:GPU; `memory.policies`); on XLA:CPU each would be the policy it is `like`. Its host
bytes must fit the host memory per device less `memory_headroom` (`Capacity.host`: the target's from
`hardware.interconnect`, or this host's available memory shared by its accelerators), where that is known.

Capacity per device, in order: `device_memory_gb` (GB = 1e9 bytes); an accelerator's own limit
(`Device.memory_stats()["bytes_limit"]`, what the allocator may use); on CPU, the host's available memory
(`MemAvailable` of /proc/meminfo) shared by the local devices. With several processes the smallest capacity of any
process is used, so every process picks the same policy and compiles the same program.

Usable = capacity x (1 - `memory_headroom`): the planner is checked within 15% of XLA's own buffer assignment
(tests/test_plan_memory.py), and a device also holds what no step plan counts (allocator fragmentation, input
prefetch, a checkpoint's device copy).

The plan decides before anything is compiled: `auto` picks the cheapest policy that fits (the one that recomputes
least), and a policy planned more than PLAN_ERROR over the usable memory is one error line naming the shortfall and
the cheapest policy that fits. Within PLAN_ERROR the compiled program has the last word
(`maxshard/run/compile_check.py`: XLA's peak of the step that will run), so no policy is refused whose compiled
program fits.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Iterator, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from maxshard.config import Config
from maxshard.config.schema import MemoryFit
from maxshard.errors import ConfigError
from maxshard.spec import remat
from maxshard.planning import estimate, memory
from maxshard.units import format_bytes

__all__ = ["Capacity", "by_preference", "cheapest", "configured_capacity", "host_share", "local_capacity",
           "peaks_by_policy", "planned_peak", "decide", "usable", "verdict", "check_host_memory", "host_by_policy"]

_GB = 1e9
# How far over the usable memory a plan may be before it alone refuses a policy: the bound within which the planner
# is checked against XLA (tests/test_plan_memory.py); closer calls are left to the compiled step.
PLAN_ERROR = 0.15


@dataclasses.dataclass(frozen=True)
class Capacity:
    bytes: int
    source: str  # for a person: where the figure comes from
    host: int | None = None  # host memory per device for an offload policy (None: unknown, not checked)


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
    if stats and stats.get("bytes_limit"):  # an accelerator: the host's memory is what offloading may use
        return Capacity(_agreed(int(stats["bytes_limit"])), f"{devices[0].device_kind} allocator limit",
                        _agreed(_host_available() // len(devices)))
    return host_share(len(devices))


def host_share(devices: int) -> Capacity:
    """One of `devices` CPU devices' memory: this host's available memory shared by them, the smallest share of any
    process (the capacity of a CPU run, and of the planner's cpu-N target)."""
    available = _host_available()
    shared = f" / {devices} devices" if devices > 1 else ""
    return Capacity(_agreed(available // devices), f"host available memory {format_bytes(available)}{shared}")


def usable(cfg: Config, capacity: Capacity) -> int:
    return int(capacity.bytes * (1 - cfg.memory_headroom))


def usable_host(cfg: Config, capacity: Capacity) -> int | None:
    """Host memory per device an offload policy may fill: the host's less `memory_headroom` (None: unknown)."""
    return None if capacity.host is None else int(capacity.host * (1 - cfg.memory_headroom))


class _ByPolicy(Mapping):
    """Planned bytes by remat policy (`plan_one`, called when a policy is asked for). Planning a policy may trace one
    unit of the model (`residuals.option_bytes`, for layer options the formula does not count): `auto` usually
    settles on the first policies it asks about (`_cheapest_fitting`), so a run's start pays for those, not all."""

    def __init__(self, names: tuple[str, ...], plan_one: Callable[[str], int]):
        self._names, self._plan_one = names, plan_one

    def __getitem__(self, policy: str) -> int:
        if policy not in self._names:
            raise KeyError(policy)
        return self._plan_one(policy)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _planned(cfg: Config) -> tuple[Mapping[str, int], Mapping[str, int]]:
    """(device peaks, host bytes) per device by policy (`_planned_names`), each policy planned once, when first asked
    for. State, gradients and the fsdp-gathered weights do not depend on the policy: they are planned with the first."""

    @functools.cache
    def base() -> estimate.Plan:
        return estimate.make_plan(dataclasses.replace(cfg, remat_policy="full"))

    @functools.cache
    def activations(policy: str) -> memory.ActivationTerms:
        return estimate.activations_under(base(), policy)

    def peak(policy: str) -> int:
        plan = base()
        return plan.params + plan.optimizer + plan.reference + plan.working(activations(policy).total)

    offloading = any(remat.policy(p).offloads for p in memory.policies(memory.compiler(cfg)))
    names = _planned_names(cfg)
    return _ByPolicy(names, peak), _ByPolicy(names, lambda p: int(activations(p).host) if offloading else 0)


def peaks_by_policy(cfg: Config) -> dict[str, int]:
    """The planned device peak bytes per device under every remat policy the config's compiler runs as such
    (`memory.policies`), most memory first, and the config's own policy if it is not one of them (an offload policy
    on XLA:CPU)."""
    return dict(_planned(cfg)[0])


def planned_peak(cfg: Config, policy: str) -> int:
    """The planned device peak bytes per device under `policy` alone (one of `_planned_names`)."""
    return _planned(cfg)[0][policy]


def host_by_policy(cfg: Config) -> dict[str, int]:
    """The host bytes per device an offload policy moves there, by policy as `peaks_by_policy` (0 for the rest, and
    for every policy where the compiler offloads nothing)."""
    return dict(_planned(cfg)[1])


def _planned_names(cfg: Config) -> tuple[str, ...]:
    """The compiler's policies (`memory.policies`), and the config's own if it is not one of them."""
    names = memory.policies(memory.compiler(cfg))
    if cfg.remat_policy in remat.NAMES and cfg.remat_policy not in names:
        names += (cfg.remat_policy,)
    return names


def _candidates(cfg: Config) -> tuple[str, ...]:
    """The policies `auto` chooses from, most device memory first: the compiler's (`memory.policies`)."""
    return memory.policies(memory.compiler(cfg))


def by_preference(cfg: Config, peaks: Mapping[str, int]) -> tuple[str, ...]:
    """The policies `auto` chooses from in the order it prefers them (`_cost`: on the device first, then the fewest
    FLOPs re-run; of equal cost, the smaller planned peak in `peaks`, as `cheapest` picks), the order in which
    compiles decide (`run/auto_compile.py`)."""
    return tuple(sorted(_candidates(cfg), key=_preference(cfg, peaks)))


def decide(cfg: Config, capacity: Capacity, strict: bool = True) -> MemoryFit:
    """The policy the run uses: `auto` -> the least recompute that fits (`cheapest`); an explicit policy -> itself.
    When it does not fit, the fit with `fits` False (`auto` -> the candidate with the least on the device: full, or
    offload_full where the compiler offloads); with `strict`, a ConfigError (one line) when it is planned more than
    PLAN_ERROR over the device's usable memory, beyond what the compiled step could overturn, or over the host's
    (which no compiled step checks)."""
    peaks, hosts = _planned(cfg)
    decided = _fit(cfg, peaks, hosts, capacity)
    host_limit = usable_host(cfg, capacity)
    host_over = host_limit is not None and hosts[decided.policy] > host_limit
    if strict and (host_over or decided.planned_bytes > decided.usable_bytes * (1 + PLAN_ERROR)):
        raise ConfigError(_shortfall(cfg, peaks, hosts, capacity))
    return decided


def _fit(cfg: Config, peaks: Mapping[str, int], hosts: Mapping[str, int], capacity: Capacity) -> MemoryFit:
    """`decide` on peaks already planned."""
    limit, host_limit = usable(cfg, capacity), usable_host(cfg, capacity)
    policy = cfg.remat_policy
    if policy == "auto":
        policy = _cheapest_fitting(cfg, peaks, hosts, limit, host_limit) or _candidates(cfg)[-1]
    fits = _fits(policy, peaks, hosts, limit, host_limit)
    return MemoryFit(cfg.remat_policy, policy, peaks[policy], limit, capacity.bytes, capacity.source, fits)


def _fitting(cfg: Config, peaks: Mapping[str, int], hosts: Mapping[str, int], limit: int,
             host_limit: int | None) -> list[str]:
    """The candidates (`_candidates`) planned within `limit` on the device and `host_limit` on the host."""
    return [p for p in _candidates(cfg) if _fits(p, peaks, hosts, limit, host_limit)]


def _fits(policy: str, peaks: Mapping[str, int], hosts: Mapping[str, int], limit: int, host_limit: int | None) -> bool:
    """Whether `policy` is planned within `limit` on the device and `host_limit` (None: unknown) on the host."""
    return peaks[policy] <= limit and (host_limit is None or hosts[policy] <= host_limit)


def _cost(cfg: Config) -> Callable[[str], tuple[bool, float]]:
    """How `auto` ranks a policy: keeping everything on the device first (module docstring), then the fewest FLOPs
    its backward re-runs."""
    factors = estimate.remat_factors(cfg)
    return lambda policy: (remat.policy(policy).offloads, factors[policy])


def _cheapest_fitting(cfg: Config, peaks: Mapping[str, int], hosts: Mapping[str, int], limit: int,
                      host_limit: int | None) -> str | None:
    """`cheapest` of `_fitting`, planning as few policies as it can: the candidates by `_cost`, one cost at a time;
    the first cost at which any fits decides, its smallest peak wins (None: none fits)."""
    cost = _cost(cfg)
    for _, same_cost in itertools.groupby(sorted(_candidates(cfg), key=cost), key=cost):
        fitting = [p for p in same_cost if _fits(p, peaks, hosts, limit, host_limit)]
        if fitting:
            return cheapest(cfg, fitting, peaks)
    return None


def _preference(cfg: Config, peaks: Mapping[str, int]) -> Callable[[str], tuple[tuple[bool, float], int]]:
    """auto's order of policies (the sort key of `by_preference` and `cheapest`): `_cost`, then the planned peak."""
    cost = _cost(cfg)
    return lambda policy: (cost(policy), peaks[policy])


def cheapest(cfg: Config, fitting: list[str], peaks: Mapping[str, int]) -> str:
    """Of the policies that fit, the one of least `_cost`; of equal ones, the smallest."""
    return min(fitting, key=_preference(cfg, peaks))


_SHARD_MORE = "shard more (ici_fsdp_parallelism, ici_tensor_parallelism) or lower per_device_batch_size"


def _dropless_instead(cfg: Config, capacity: Capacity) -> str:
    """Where no policy fits an MoE that drops tokens: the dropless grouped path (`capacity_factor=-1`) and the
    policy `auto` would pick for it, when that fits. It holds fewer rows per token than capacity 1.25 with whole-
    sequence groups (Mixtral 8x7B at 12 x 4096 tokens per v6e chip: benchmarks/README.md), and drops nothing."""
    if not cfg.model.is_moe or cfg.capacity_factor <= 0:
        return ""
    dropless = dataclasses.replace(cfg, capacity_factor=-1.0, remat_policy="auto",
                                   model=dataclasses.replace(cfg.model, capacity_factor=-1.0))
    peaks, hosts = _planned(dropless)
    fitting = _fitting(dropless, peaks, hosts, usable(cfg, capacity), usable_host(cfg, capacity))
    if not fitting:
        return ""
    policy = cheapest(dropless, fitting, peaks)
    return (f"; capacity_factor=-1 (dropless: no token dropped) fits with remat_policy={policy} "
            f"({format_bytes(peaks[policy])})")


def _shortfall(cfg: Config, peaks: Mapping[str, int], hosts: Mapping[str, int], capacity: Capacity) -> str:
    limit, host_limit = usable(cfg, capacity), usable_host(cfg, capacity)
    room = (f"the {format_bytes(limit)} usable per device ({capacity.source}, "
            f"memory_headroom={cfg.memory_headroom:g})")
    fitting = _fitting(cfg, peaks, hosts, limit, host_limit)
    best = f"the cheapest policy that fits is remat_policy={cheapest(cfg, fitting, peaks)}" if fitting else ""
    policy = cfg.remat_policy
    if host_limit is not None and policy in hosts and hosts[policy] > host_limit:
        return (f"remat_policy={policy} moves {format_bytes(hosts[policy])} per device to host memory, "
                f"{format_bytes(hosts[policy] - host_limit)} more than the {format_bytes(host_limit)} of host memory "
                f"usable per device; {best or _SHARD_MORE}")
    if fitting:
        best_policy = cheapest(cfg, fitting, peaks)
        return (f"remat_policy={policy} needs {format_bytes(peaks[policy])} per device (planned peak), "
                f"{format_bytes(peaks[policy] - limit)} more than {room}; {best} "
                f"({format_bytes(peaks[best_policy])})")
    smallest = _candidates(cfg)[-1]  # the policy that keeps the least on the device
    least = peaks[smallest]
    return (f"remat_policy={policy}: no remat policy fits; even remat_policy={smallest} needs "
            f"{format_bytes(least)} per device (planned peak), {format_bytes(least - limit)} more than {room}; "
            f"{_SHARD_MORE} or raise device_memory_gb{_dropless_instead(cfg, capacity)}")


def verdict(cfg: Config, capacity: Capacity) -> tuple[bool, str]:
    """(fits, one line) for a planned run: `fit: yes, <planned> of <usable> (<policy>)`, or `fit: no, <by how much>,
    <what would fit>`. `auto` is judged by the policy it chose (`cfg.memory_fit`), an explicit policy by itself. An
    offload policy also needs its host bytes within the host's usable memory, where the target's is known."""
    requested = cfg.memory_fit.requested if cfg.memory_fit is not None else cfg.remat_policy
    peaks, hosts = _planned(cfg)
    decided = _fit(dataclasses.replace(cfg, remat_policy=requested), peaks, hosts, capacity)
    planned, limit = format_bytes(decided.planned_bytes), format_bytes(decided.usable_bytes)
    host_limit = usable_host(cfg, capacity)
    host = (f", {format_bytes(hosts[decided.policy])} of {format_bytes(host_limit)} host memory"
            if hosts[decided.policy] and host_limit is not None else "")
    if decided.fits:
        return True, f"fit: yes, {planned} of {limit} usable{host} ({decided.policy})"
    fitting = _fitting(cfg, peaks, hosts, decided.usable_bytes, host_limit)
    best = cheapest(cfg, fitting, peaks) if fitting else None
    instead = (f"remat_policy={best} fits ({format_bytes(peaks[best])})" if best else
               f"no remat policy fits: {_SHARD_MORE}{_dropless_instead(cfg, capacity)}")
    if decided.planned_bytes <= decided.usable_bytes:  # the device fits: the host does not
        over = format_bytes(hosts[decided.policy] - host_limit)
        return False, (f"fit: no, {over} over the {format_bytes(host_limit)} of host memory usable per device "
                       f"({decided.policy} offloads {format_bytes(hosts[decided.policy])}); {instead}")
    over = format_bytes(decided.planned_bytes - decided.usable_bytes)
    return False, f"fit: no, {over} over the {limit} usable ({decided.policy} plans {planned}); {instead}"


def check_host_memory(cfg: Config, devices: list | None = None) -> None:
    """A policy that offloads needs host memory its devices can move values to (the 'pinned_host' memory kind):
    one error line naming remat_policy and what is allowed where they have none (default: this process's devices).
    XLA:CPU's devices have one (and keep the values where they are: maxshard/spec/remat.py)."""
    policy = cfg.remat_policy
    if policy not in remat.NAMES or not remat.policy(policy).offloads:
        return
    device = (devices or jax.local_devices())[0]
    kinds = sorted({memory_space.kind for memory_space in device.addressable_memories()})
    if "pinned_host" in kinds:
        return
    requested = cfg.memory_fit.requested if cfg.memory_fit is not None else policy
    chose = f" chose {policy}, which" if requested != policy else ""
    allowed = ", ".join(p.name for p in remat.POLICIES if not p.offloads)
    raise ConfigError(f"remat_policy={requested}{chose} moves saved activations to host memory ('pinned_host'), "
                      f"which the {device.platform} devices here do not have (memory kinds: {', '.join(kinds)}); "
                      f"use one of {allowed}")
