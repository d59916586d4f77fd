"""`python -m maxshard.plan --search --compile`: the formulas rank the layouts, the compiler decides which of the best
`--top` fit. The re-ranking with faked compiled peaks (nothing compiled), and one real XLA:TPU compile of the best
tiny layout for a v5e 2x4 slice (libtpu)."""

from __future__ import annotations

import json

import pytest

from maxshard import plan as plan_cli
from maxshard.planning.compiled import StepMemory
from tests.test_plan_search import TINY_PINNED

SEARCH = [*TINY_PINNED, "--search", "--topology", "v5litepod-8"]


def _faked(peaks: list[int]):
    """compile_step giving these train step peaks in the order the layouts are compiled."""
    given = iter(peaks)
    return lambda *args, **kwargs: (StepMemory(1, 1, 0, 1, 1, next(given)), 0.1)


def test_a_layout_whose_compiled_step_does_not_fit_leaves_the_ranking(capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The formulas' best 3 compiled; the compiler says the best does not fit the search's capacity: the other two
    lead in the formulas' order, then the layouts not compiled; when none of the 3 fits, one line and exit 1."""
    assert plan_cli.main([*SEARCH, "--top", "5", "--json"]) == 0
    formula = json.loads(capsys.readouterr().out)
    layouts, capacity = [c["layout"] for c in formula["candidates"]], int(formula["capacity_bytes"])
    assert len(layouts) == 5

    monkeypatch.setattr(plan_cli, "compile_step", _faked([capacity + 1, capacity, 100]))
    assert plan_cli.main([*SEARCH, "--top", "3", "--compile", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [c["layout"] for c in printed["candidates"]] == layouts[1:4]
    assert [(k["layout"], k["step_peak"], k["fits"]) for k in printed["compiled"]] == [
        (layouts[0], capacity + 1, False), (layouts[1], capacity, True), (layouts[2], 100, True)]
    assert printed["fitting"] == formula["fitting"] - 1

    monkeypatch.setattr(plan_cli, "compile_step", _faked([capacity + 1, capacity, 100]))
    assert plan_cli.main([*SEARCH, "--top", "3", "--compile"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    at = out.index(next(line for line in out if line.startswith("compiled with XLA:TPU, the 3 best by planned step")))
    assert out[at + 1].startswith(f"  {layouts[0]}: train step ") and out[at + 1].endswith("does NOT fit")
    assert out[at + 2].endswith(", fits") and len(out) == at + 4

    monkeypatch.setattr(plan_cli, "compile_step", _faked([capacity + 1, capacity + 2]))
    assert plan_cli.main([*SEARCH, "--top", "2", "--compile"]) == 1
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.startswith("plan: none of the 2 best layouts compiles within "), line
    assert f"the closest, {layouts[0]} " in line
    untried = formula["fitting"] - 2
    assert line.rstrip().endswith(f"; {untried} more layouts plan within it: --top 4 compiles more of them"), line


def test_the_best_layout_compiles_for_the_slice(capsys: pytest.CaptureFixture[str]) -> None:
    """The real path: libtpu's devices for the slice, the best layout's train step compiled by XLA:TPU; the tiny
    model fits."""
    assert plan_cli.main([*SEARCH, "--top", "1", "--compile", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    (compiled,) = printed["compiled"]
    assert compiled["fits"] and 0 < compiled["step_peak"] <= printed["capacity_bytes"], compiled
    assert printed["candidates"][0]["layout"] == compiled["layout"]


def test_search_compile_needs_the_targets_compiler(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from maxshard.planning import gpu_compile

    monkeypatch.setattr(gpu_compile, "_installed", lambda module: False)
    assert plan_cli.main([*TINY_PINNED, "--search", "--topology", "h100-80gb-8", "--compile"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == ("plan: error: compiling for a GPU without one needs JAX's CUDA plugin, which "
                                         'is not installed: pip install -e ".[gpu-aot]"')
