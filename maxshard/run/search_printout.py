"""The layout search's printout: a ranked table with a line to paste per layout, the same as JSON, a sweep file."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

import yaml

from maxshard.config import yaml_text
from maxshard.planning import hardware
from maxshard.run.search import Candidate, SearchResult
from maxshard.units import format_bytes

__all__ = ["format_search", "nothing_fits", "search_json", "sweep_yaml"]

_GIB = 2**30
_REASONS_SHOWN = 3


def _where(result: SearchResult) -> str:
    t = result.target
    unit = "slice" if t.accelerator == "tpu" else "node"
    return f"{t.name} x {t.num_slices} {unit}{'s' if t.num_slices != 1 else ''} ({t.num_devices} devices)"


def _capacity_text(result: SearchResult) -> str:
    memory, source = hardware.device_memory(result.target.name)
    return f"{format_bytes(result.capacity)} per device ({format_bytes(memory)}: {source}, less " \
           f"{result.headroom * 100:g}% headroom)"


def _mfu(c: Candidate) -> float | None:
    p = c.plan
    return None if p.peak is None or p.step_s is None else p.model_flops / p.step_s / p.peak


def _tokens_per_s(c: Candidate) -> float | None:
    cfg, step = c.plan.cfg, c.plan.step_s
    return None if step is None else cfg.global_batch_size * cfg.max_target_length / step


def _invalid_text(result: SearchResult) -> list[str]:
    if not result.invalid:
        return []
    shown = [f"  {n} x {why}" for why, n in list(result.invalid.items())[:_REASONS_SHOWN]]
    more = len(result.invalid) - _REASONS_SHOWN
    tail = [f"  ... and {more} more reason{'s' if more > 1 else ''}"] if more > 0 else []
    return [f"invalid ({sum(result.invalid.values())}):", *shown, *tail]


def _row(rank: int, c: Candidate, capacity: float) -> str:
    mfu, tokens = _mfu(c), _tokens_per_s(c)
    step = "-" if c.plan.step_s is None else f"{c.step_s:.4g}"
    return (f"{rank:>4}  {step:>8}  {c.peak / _GIB:>8.1f}  {c.peak / capacity:>7.0%}  "
            f"{'-' if mfu is None else f'{mfu:.1%}':>6}  {'-' if tokens is None else f'{tokens:,.0f}':>10}  "
            f"{c.layout.label}")


def format_search(result: SearchResult, argv: Sequence[str], top: int) -> str:
    """The summary, the top layouts as a table, and for each the overrides to append to the user's command."""
    best = result.fitting[:top]
    unrefined = (f"; {result.unrefined} meshes that fit were tried with the first-round policy only (--max-candidates)"
                 if result.unrefined else "")
    lines = [
        f"search: {result.considered} layouts for {_where(result)} in {result.seconds:.0f} s: {result.planned} "
        f"valid, {len(result.fitting)} fit in {_capacity_text(result)}{unrefined}",
        *_invalid_text(result),
        f"rank  {'step s':>8}  {'peak GiB':>8}  {'of cap':>7}  {'MFU':>6}  {'tokens/s':>10}  layout "
        "(step: roofline lower bound; MFU: at most)",
        *(_row(i, c, result.capacity) for i, c in enumerate(best, 1)),
        f"overrides to append to: python -m maxshard.train {shlex.join(argv)}",
        *(f"{i:>4}  {' '.join(c.overrides) or '(none: the config as given)'}" for i, c in enumerate(best, 1)),
    ]
    return "\n".join(lines)


def nothing_fits(result: SearchResult) -> str:
    """One line: the capacity, and the closest layout with how far it misses (or why none was valid)."""
    if result.closest is None:
        why = next(iter(result.invalid), "no candidate layout (pinned knobs that do not divide the devices?)")
        return f"plan: no valid layout among {result.considered} candidates for {_where(result)}; e.g. {why}"
    c = result.closest
    pasted = " ".join(c.overrides) or "the config as given"
    return (f"plan: no layout fits {_capacity_text(result)}; the closest, {c.layout.label} ({pasted}), plans "
            f"{format_bytes(c.peak)}: {format_bytes(c.peak - result.capacity)} over")


def _candidate_json(rank: int | None, c: Candidate, capacity: float) -> dict[str, Any]:
    p, layout = c.plan, c.layout
    return {
        "rank": rank,
        "name": layout.name,
        "layout": layout.label,
        "overrides": list(c.overrides),
        "mesh": p.mesh,
        "ici": p.ici,
        "dcn": p.dcn,
        "remat_policy": layout.remat_policy,
        "num_pipeline_microbatches": layout.microbatches or None,
        "step_s": p.step_s,
        "peak_bytes": c.peak,
        "fits": c.peak <= capacity,
        "bytes_per_device": {"params": p.params, "optimizer": p.optimizer, "gradients": p.gradients,
                             "activations": p.activations},
        "mfu": _mfu(c),
        "tokens_per_s": _tokens_per_s(c),
    }


def search_json(result: SearchResult, top: int) -> dict[str, Any]:
    """The summary and the top layouts, machine-readable; `closest` is set only when none fits."""
    t = result.target
    return {
        "target": t.name,
        "num_slices": t.num_slices,
        "devices": t.num_devices,
        "hbm_bytes": hardware.interconnect(t.name).hbm,
        "headroom": result.headroom,
        "capacity_bytes": result.capacity,
        "considered": result.considered,
        "valid": result.planned,
        "fitting": len(result.fitting),
        "invalid": result.invalid,
        "unrefined": result.unrefined,
        "seconds": result.seconds,
        "candidates": [_candidate_json(i, c, result.capacity) for i, c in enumerate(result.fitting[:top], 1)],
        "closest": None if result.closest is None else _candidate_json(None, result.closest, result.capacity),
    }


def _typed(raw: str) -> Any:
    """A command-line value as YAML would type it, when the sweep runner writes it back exactly as typed
    (`sweep_spec.format_value`); the text otherwise (run_name=007 must stay '007')."""
    try:
        value = yaml_text.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, bool):
        return value if raw == ("true" if value else "false") else raw
    return value if isinstance(value, (int, float, str)) and str(value) == raw else raw


def _mapping(tokens: Sequence[str]) -> dict[str, Any]:
    return {key: _typed(raw) for key, raw in (token.split("=", 1) for token in tokens)}


def sweep_yaml(result: SearchResult, base_config: str, user_overrides: Sequence[str], top: int,
               command: str) -> str:
    """A sweep file (`benchmarks/sweep_spec.py`) of the top layouts: the user's overrides are `fixed`, each layout a
    point named by it, the target the `xpk:` defaults. Planned figures are comments beside the points."""
    best = result.fitting[:top]
    data = {
        "name": f"plan-{result.target.name}-x{result.target.num_slices}",
        "base_config": base_config,
        "fixed": _mapping(user_overrides),
        "xpk": {"device_type": result.target.name, "num_slices": result.target.num_slices},
        "points": [{"name": c.layout.name, **_mapping(c.overrides)} for c in best],
    }
    header = [f"# Written by: {command}",
              f"# The {len(best)} fastest of {len(result.fitting)} layouts that fit {_capacity_text(result)}; planned:"]
    header += [f"#   {c.layout.name}: step >= {c.step_s:.4g} s, peak {c.peak / _GIB:.1f} GiB" for c in best]
    header += ["# Run on the target: python benchmarks/sweep.py THIS_FILE --xpk --cluster C --project P --zone Z "
               "--docker-image IMAGE"]
    return "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
