"""`remat_policy: auto` decided by compiles, by the planner where the target's compiler is installed
(`maxshard.plan`) and by the trainer before its first step (`run/compile_check.py`) alike: the estimate ranks the
policies in auto's order of preference (`fit.by_preference`: on the device first, then the fewest FLOPs re-run,
then the smaller planned peak) and prunes those planned beyond what a compile could overturn (over the usable
memory by more than `fit.PLAN_ERROR`); the others are compiled in that order and the first whose compiled peak fits
is the answer. The estimate's own pick is one of them, so a plan whose estimate is conservative for a compiler
release gets the policy with less recomputation that the compile shows fitting, and one whose estimate is low gets
the next that compiles within the chip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from maxshard.config import Config
from maxshard.planning import fit
from maxshard.run import loading

__all__ = ["Tried", "choose", "with_policy"]


@dataclasses.dataclass(frozen=True)
class Tried:
    """One policy compiled: its train step's peak per device (None: the compiler found it over the chip)."""

    policy: str
    peak: int | None

    def fits(self, usable: int) -> bool:
        return self.peak is not None and self.peak <= usable


def with_policy(cfg: Config, policy: str) -> Config:
    """`cfg` running `policy`; its fit record keeps the request (`auto`) with the policy's planned peak."""
    changed = loading.replace(cfg, remat_policy=policy)
    if cfg.memory_fit is None:
        return changed
    planned = fit.planned_peak(changed, policy)
    return dataclasses.replace(changed, memory_fit=dataclasses.replace(cfg.memory_fit, policy=policy,
                                                                       planned_bytes=planned, fits=True))


def choose(cfg: Config, usable: int, compile_peak: Callable[[str], int | None]) -> tuple[str | None, list[Tried]]:
    """(the first policy in auto's order whose compile fits `usable` bytes per device, or None; every policy
    compiled on the way, in order). `compile_peak(policy)` compiles the train step under it. A policy the
    estimate plans over `usable` by more than PLAN_ERROR is not compiled."""
    planned, bound = fit.peaks_by_policy(cfg), usable * (1 + fit.PLAN_ERROR)
    tried = []
    for policy in fit.by_preference(cfg, planned):
        if planned[policy] > bound:
            continue
        tried.append(Tried(policy, compile_peak(policy)))
        if tried[-1].fits(usable):
            return policy, tried
    return None, tried
