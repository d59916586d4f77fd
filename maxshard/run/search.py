"""Layout search: every sensible way to lay a run out on a target, planned, kept if it fits, ranked by step time.

Why: the planner answers "how does this layout do on that cluster" in a fraction of a second, so it can answer
"which layout should I use" by asking that question a few hundred times, before any hardware is reserved.

A layout is what the search may change (`run/layouts.py` enumerates them: the ici/dcn mesh knobs and pipeline
microbatches) and `remat_policy`: every policy of the schema except `auto`, which is what a search resolves, the
offload policies only when nothing else fits (below). Keys given on the command line stay as given, so the
overrides of a suggestion can be appended to the user's own command without naming a key twice.

Two rounds, so that the remat policies multiply only the meshes that can use them. First every mesh (with each of
its microbatch counts) under `remat_policy=full`, which saves the least of all policies (only each layer's input);
its backward holds more than `save_out_proj`'s, though (planning/memory.py: the whole layer is recomputed at
once), which can plan a few % lower. So a mesh whose `full` peak exceeds the capacity by more than
FIRST_ROUND_SLACK (10%) is not tried again; the others go to the second round (and `full` itself still has to
fit). Then the other policies for the meshes that fit, fastest first, while the budget (`max_candidates`)
lasts; on one 8-GPU node it always lasts, so that search is exhaustive. A first round larger than the budget is
refused with a hint to pin keys.

The offload policies (maxshard/spec/remat.py) are the last resort, as for `remat_policy: auto` (planning/fit.py:
their host transfers are not priced): only when no layout fits under the others, and the target's compiler moves values
to host memory (TPU, GPU: `memory.policies`), the two rounds run again with them, `offload_full` first.

Each candidate is loaded exactly as `python -m maxshard.plan` loads a config (`target.load_for_target`: validated
as the launcher validates it for the target). A ConfigError makes it invalid, counted by its reason; so does a
dimension that would not split evenly over its mesh axes (heads, batch, length, ...: the planner's bytes assume
even shards). Then `make_plan`. A candidate fits when its planned peak (`Plan.peak_bytes`) is at most the
capacity, HBM x (1 - headroom); the fitting ones are ranked by `Plan.step_s`, then by planned peak (many layouts
share a compute-bound step time, and the one with more memory left is the safer pick).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import time
import typing
from collections.abc import Callable, Sequence

from maxshard import config
from maxshard.config import Config
from maxshard.config.schema import RematPolicy
from maxshard.errors import ConfigError
from maxshard.launch.topologies import Target
from maxshard.spec import remat
from maxshard.parallel import axis_names as ax
from maxshard.parallel import mesh
from maxshard.planning import hardware, memory
from maxshard.planning.axes import rule_axes
from maxshard.planning.estimate import Plan, make_plan
from maxshard.run import layouts
from maxshard.run.layouts import Layout
from maxshard.run.target import load_for_target, trainer_argv

__all__ = [
    "Candidate",
    "SearchResult",
    "capacity_bytes",
    "remat_policies",
    "search",
]

DEFAULT_HEADROOM = 0.1
MAX_CANDIDATES = 5000  # ~0.02-0.05 s each: a few minutes at most
LEAST_MEMORY_POLICY = "full"  # the first round's policy (module docstring)
OFFLOAD_LEAST_MEMORY_POLICY = "offload_full"  # ... when the search turns to the offload policies
PROGRESS_EVERY = 100
FIRST_ROUND_SLACK = 1.1  # a `full` peak this much over the capacity may still fit under another policy


def capacity_bytes(target: Target, headroom: float = DEFAULT_HEADROOM) -> float:
    """Device memory a layout may plan to use: HBM less the fraction kept free (fragmentation, XLA's buffers)."""
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom must be in [0, 1) (a fraction of device memory kept free), got {headroom}")
    return hardware.device_memory(target.name)[0] * (1 - headroom)


def remat_policies() -> tuple[str, ...]:
    """The schema's remat policies, less `auto` (what a search resolves)."""
    return tuple(p for p in typing.get_args(RematPolicy) if p != "auto")


def _policy_groups(user: Config) -> list[tuple[str, list[str]]]:
    """(first-round policy, the others) of each search pass: the policies that keep everything on the device, then,
    where the compiler offloads, the offload ones (module docstring)."""
    runnable = memory.policies(memory.compiler(user))
    groups = []
    for offloads, first in ((False, LEAST_MEMORY_POLICY), (True, OFFLOAD_LEAST_MEMORY_POLICY)):
        names = [p for p in remat_policies() if p in runnable and remat.policy(p).offloads == offloads]
        if first in names:
            groups.append((first, [p for p in names if p != first]))
    return groups


# --------------------------------------------------------------------------------------------- checks


def _check_resolved(cfg: Config, layout: Layout) -> None:
    """The loaded config is the layout (a guard: mesh_rules or a pinned -1 could have made it another)."""
    shape = mesh.resolve_shape(cfg)
    pipe = cfg.model.pipeline if cfg.model is not None else None
    microbatches = pipe.microbatches if pipe is not None else 0
    if (shape.ici, shape.dcn, cfg.remat_policy, microbatches) != (
        layout.ici, layout.dcn, layout.remat_policy, layout.microbatches
    ):
        raise ConfigError("the overrides did not load as the layout they describe (mesh_rules?)")


def _check_even(cfg: Config) -> None:
    """Activation dimensions split evenly over their mesh axes (parameters are checked by the planner's report)."""
    sizes = mesh.axis_sizes(cfg)
    batch = cfg.global_batch_size // cfg.gradient_accumulation_steps
    dims = (
        ("num_heads", cfg.num_heads, ax.ACT_HEADS),
        ("num_kv_heads", cfg.num_kv_heads, ax.ACT_KV_HEADS),
        ("global_num_kv_heads", cfg.global_num_kv_heads or cfg.num_kv_heads, ax.ACT_KV_HEADS),
        ("mlp_dim", cfg.mlp_dim, ax.ACT_MLP),
        ("vocab_size", cfg.vocab_size, ax.ACT_VOCAB),
        ("max_target_length", cfg.max_target_length, ax.LENGTH),
        ("the batch of a model call", batch, ax.BATCH),
        ("the batch of a model call", batch, ax.EMBED_AND_LOGITS_BATCH),
    )
    for what, size, logical in dims:
        axes = rule_axes(cfg, logical, sizes)
        shards = math.prod(sizes[a] for a in axes)
        if size % shards:
            raise ConfigError(f"{what}={size} does not split evenly over {mesh.describe({a: sizes[a] for a in axes})}")


def _check_host(plan: Plan, host_capacity: float | None) -> None:
    """An offload layout whose host bytes exceed the host memory per device (less the same headroom) is invalid."""
    if host_capacity is not None and plan.host_bytes > host_capacity:
        raise ConfigError(f"remat_policy={plan.cfg.remat_policy} moves {plan.host_bytes / 2**30:.0f} GiB per device "
                          f"to host memory, over the {host_capacity / 2**30:.0f} GiB usable")


def _reason(error: ConfigError) -> tuple[str, str]:
    """(group, message) of an invalid candidate: the target suffix dropped; messages that differ only in their
    numbers share a group, which is shown by its first message."""
    text = re.sub(r" \(target [^)]*\)$", "", str(error))
    return re.sub(r"\d+", "N", text), text


# --------------------------------------------------------------------------------------------- search


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    overrides: tuple[str, ...]  # key=value to append to the user's command
    plan: Plan

    @property
    def peak(self) -> int:
        return self.plan.peak_bytes

    @property
    def step_s(self) -> float:
        """The planned step time; infinite when the device kind has no known peak FLOP/s."""
        return math.inf if self.plan.step_s is None else self.plan.step_s


@dataclasses.dataclass(frozen=True)
class SearchResult:
    target: Target
    headroom: float
    capacity: float  # bytes per device
    fitting: list[Candidate]  # best first
    closest: Candidate | None  # when none fits: the one with the smallest planned peak
    considered: int  # candidate layouts tried, valid or not
    planned: int  # the valid ones
    invalid: dict[str, int]  # reason (the first message of its group): candidates, most first
    unrefined: int  # meshes that fit but were not tried with the other remat policies (the budget ran out)
    seconds: float


def _rank(candidates: list[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.step_s, c.peak, c.layout.name))


def _user_config(argv: Sequence[str], target: Target) -> tuple[Config, set[str]]:
    """The user's config finalized for the target (mesh_rules applied, mesh not checked), and the keys the command
    line pins."""
    parsed, prepared = trainer_argv(argv, target)
    user = config.finalize(config.parse(prepared), target.num_devices, target.device_kind, target.num_hosts)
    return user, set(parsed.explicit_keys)


class _Planner:
    """Plans candidates of one search, keeping the valid ones and counting the invalid ones by reason."""

    def __init__(self, argv: Sequence[str], target: Target, user: Config, pinned: set[str], capacity: float,
                 progress: Callable[[str], None] | None) -> None:
        self.argv, self.target, self.user, self.pinned, self.capacity = argv, target, user, pinned, capacity
        host = hardware.interconnect(target.name).host
        self.host_capacity = None if host is None else host * capacity / hardware.device_memory(target.name)[0]
        self.progress, self.start = progress, time.perf_counter()
        self.planned: list[Candidate] = []
        self.invalid: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}
        self.tried = 0

    def plan(self, layout: Layout) -> Candidate | None:
        """The candidate of `layout`, or None (counted) when it is invalid."""
        extra = layouts.overrides(layout, self.user, self.pinned)
        self.tried += 1
        try:
            cfg = load_for_target([*self.argv, *extra], self.target)
            _check_resolved(cfg, layout)
            _check_even(cfg)
            candidate = Candidate(layout, extra, make_plan(cfg, self.target))
            _check_host(candidate.plan, self.host_capacity)
        except ConfigError as e:
            group, message = _reason(e)
            self.invalid[group] += 1
            self.examples.setdefault(group, message)
            return None
        self.planned.append(candidate)
        return candidate

    def round(self, what: str, layouts: list[Layout]) -> list[Candidate]:
        """The valid candidates of `layouts`, with a progress line every `PROGRESS_EVERY` and at the end."""
        out = []
        for i, layout in enumerate(layouts, 1):
            candidate = self.plan(layout)
            if candidate is not None:
                out.append(candidate)
            if self.progress is not None and (i % PROGRESS_EVERY == 0 or i == len(layouts)):
                fit = sum(c.peak <= self.capacity for c in self.planned)
                self.progress(f"search: {what} {i}/{len(layouts)}; {len(self.planned)} valid, {fit} fit, "
                              f"{time.perf_counter() - self.start:.0f} s")
        return out

    def result(self, headroom: float, unrefined: int) -> SearchResult:
        fitting = _rank([c for c in self.planned if c.peak <= self.capacity])
        misses = sorted((c for c in self.planned if c.peak > self.capacity), key=lambda c: (c.peak, c.step_s))
        invalid = {self.examples[group]: n for group, n in self.invalid.most_common()}
        closest = None if fitting or not misses else misses[0]
        return SearchResult(self.target, headroom, self.capacity, fitting, closest, self.tried, len(self.planned),
                            invalid, unrefined, time.perf_counter() - self.start)


def search(
    argv: Sequence[str],
    target: Target,
    headroom: float = DEFAULT_HEADROOM,
    max_candidates: int = MAX_CANDIDATES,
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """Plans the candidate layouts of `[CONFIG, key=value, ...]` on `target` in two rounds (module docstring).

    ConfigError for a mistake in the user's own config or flags, or for a first round larger than
    `max_candidates`. `progress` receives a line every `PROGRESS_EVERY` candidates and at the end of each round."""
    capacity = capacity_bytes(target, headroom)
    with config.reading_files_once():
        user, pinned = _user_config(argv, target)
        planner = _Planner(argv, target, user, pinned, capacity, progress)
        groups = [(user.remat_policy, [])] if "remat_policy" in pinned else _policy_groups(user)
        unrefined = 0
        for policy, others in groups:
            unrefined = _rounds(planner, policy, others, max_candidates)
            if any(c.peak <= capacity for c in planner.planned):
                break
    return planner.result(headroom, unrefined)


def _rounds(planner: _Planner, policy: str, others: list[str], max_candidates: int) -> int:
    """The two rounds of the module docstring for one group of policies; the meshes that fit but were left
    untried with `others` (the budget ran out)."""
    first = layouts.meshes(planner.user, planner.target, planner.pinned, policy)
    if len(first) > max_candidates:
        raise ConfigError(f"{len(first)} candidate meshes (more than --max-candidates {max_candidates}); pin "
                          "some knobs on the command line (e.g. ici_tensor_parallelism=1 dcn_data_parallelism=N) "
                          "or raise --max-candidates")
    slack = planner.capacity * (FIRST_ROUND_SLACK if others else 1)
    fit = _rank([c for c in planner.round(f"meshes (remat_policy={policy})", first) if c.peak <= slack])
    refined = fit[: (max_candidates - len(first)) // len(others)] if others else []
    second = [dataclasses.replace(c.layout, remat_policy=p) for c in refined for p in others]
    if second:
        planner.round("other remat policies", second)
    return len(fit) - len(refined) if others else 0
