"""`remat_policy: auto` decided by compiles (run/auto_compile.py, what `maxshard.plan` runs where the target's
compiler is installed): policies in auto's order of preference, those the estimate plans beyond its stated error
over the usable memory never compiled, the first whose compiled peak fits taken. The compiles here are stand-ins
that say which policy fits, so the test is about the order and the pruning; tests/test_plan.py compiles the tiny
preset for a v5e slice through the same path."""

from __future__ import annotations

import pytest

from maxshard.launch import topologies
from maxshard.planning import fit
from maxshard.run import auto_compile
from maxshard.run.target import load_for_target

USABLE = 10 * 2**20


@pytest.fixture(scope="module")
def cfg():
    return load_for_target(["configs/base.yml", "model_name=tiny"], topologies.parse("v5litepod-8", 1))


def _planned(order: tuple[str, ...]) -> dict[str, int]:
    """The estimate: the most preferred policy far over (pruned), the next just over (within PLAN_ERROR: a compile
    could overturn it), the rest under."""
    far, near = int(USABLE * (1 + 2 * fit.PLAN_ERROR)), int(USABLE * (1 + fit.PLAN_ERROR / 2))
    return {p: far if i == 0 else near if i == 1 else USABLE // 2 for i, p in enumerate(order)}


def test_the_first_policy_whose_compile_fits_wins_and_the_pruned_one_is_not_compiled(cfg, monkeypatch):
    order = fit.by_preference(cfg, fit.peaks_by_policy(cfg))
    assert order[0] == "none" and order.index("full") < order.index("offload_full")  # on the device first
    monkeypatch.setattr(fit, "peaks_by_policy", lambda _: _planned(order))
    compiled = {order[1]: USABLE - 1, order[2]: USABLE // 3}  # the estimate was high for order[1]
    calls = []
    chosen, tried = auto_compile.choose(cfg, USABLE, lambda p: calls.append(p) or compiled.get(p, USABLE // 2))
    assert chosen == order[1] and calls == [order[1]] and tried[0].fits(USABLE)


def test_over_the_chip_moves_on_and_nothing_fitting_is_none(cfg, monkeypatch):
    order = fit.by_preference(cfg, fit.peaks_by_policy(cfg))
    monkeypatch.setattr(fit, "peaks_by_policy", lambda _: _planned(order))
    calls = []
    chosen, tried = auto_compile.choose(cfg, USABLE, lambda p: calls.append(p) or (None if p == order[1] else
                                                                                    USABLE // 3 if p == order[3]
                                                                                    else USABLE + 1))
    assert chosen == order[3] and calls == list(order[1:4]) and [t.fits(USABLE) for t in tried] == [False, False, True]
    chosen, tried = auto_compile.choose(cfg, USABLE, lambda p: USABLE + 1)
    assert chosen is None and [t.policy for t in tried] == list(order[1:])


def test_a_policy_chosen_keeps_the_request_and_plans_its_own_peak(cfg):
    changed = auto_compile.with_policy(cfg, "full")
    assert cfg.memory_fit.requested == changed.memory_fit.requested == "auto"
    assert changed.remat_policy == changed.memory_fit.policy == "full"
    assert changed.memory_fit.planned_bytes == fit.planned_peak(changed, "full") != cfg.memory_fit.planned_bytes


def test_of_policies_that_recompute_alike_the_smaller_plan_is_compiled_first():
    """On XLA:CPU without a fused kernel, none and minimal re-run no matmul (equal cost): the one planned smaller
    comes first, as the estimate's own pick takes it (`fit.cheapest`), so with room for every policy the first one
    compiled is the estimate's pick, on any capacity that fits it."""
    from tests.helpers import tiny_config

    cfg = tiny_config("remat_policy=auto")
    peaks = fit.peaks_by_policy(cfg)
    order = fit.by_preference(cfg, peaks)
    assert set(order[:2]) == {"none", "minimal"} and peaks[order[0]] < peaks[order[1]], (order, peaks)
    for usable in (peaks[order[0]] * 1.01, max(peaks.values()) * 2):
        capacity = fit.Capacity(int(usable / (1 - cfg.memory_headroom)) + 1, "test")
        assert fit.decide(cfg, capacity).policy == order[0]
