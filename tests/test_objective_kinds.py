"""Objectives are named in their registry only (`maxshard/objectives/kinds.py`): code elsewhere reads a property of
the objective's Kind row (samples, pairs, documents, reference, reference_key, reference_weight_key), never
compares `cfg.objective` with a name. Read from the source with `ast`, as tests/test_imports.py reads imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import tiny_config

from maxshard.objectives import kinds

PACKAGE = Path(__file__).resolve().parent.parent / "maxshard"


def _names_in(node: ast.expr) -> list[str]:
    """The objective names a comparison operand spells: a string constant, or one inside a tuple/list/set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and i.value in kinds.NAMES]


def compared_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every comparison (==, !=, in, not in) with an objective's name in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, name) for name in _names_in(operand)]
    return found


def test_no_objective_name_is_compared_outside_the_registry():
    outside = [path for path in PACKAGE.rglob("*.py") if PACKAGE / "objectives" not in path.parents]
    assert len(outside) > 50  # the walk found the package
    hits = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name!r}" for path in outside
            for line, name in compared_names(path.read_text())]
    assert not hits, "compare a Kind property (maxshard/objectives/kinds.py) instead:\n" + "\n".join(hits)


def test_the_rule_bites():
    assert compared_names('if cfg.objective == "grpo" and x:\n    pass') == [(1, "grpo")]
    assert compared_names('ok = cfg.objective in ("dpo", "simpo")') == [(1, "dpo"), (1, "simpo")]
    assert compared_names('name = "grpo"\nk = kind(name).samples') == []


@pytest.mark.parametrize("keys, source", [
    (("objective=lm",), ""),
    (("objective=dpo", "dataset_type=synthetic"), "auto"),
    (("objective=dpo", "dataset_type=synthetic", "dpo_reference=precomputed"), "precomputed"),
    (("objective=simpo", "dataset_type=synthetic"), ""),
    (("objective=grpo", "dataset_type=prompts"), "auto"),
    (("objective=grpo", "dataset_type=prompts", "grpo_kl_beta=0"), ""),
])
def test_the_reference_source_comes_from_the_kind_row(keys, source):
    """Where a reference comes from, read from the row's reference / reference_key / reference_weight_key."""
    assert kinds.reference_source(tiny_config(*keys)) == source


def test_the_kind_properties():
    assert kinds.names_where("samples") == ("grpo",)
    assert kinds.names_where("pairs") == ("dpo", "simpo", "orpo", "reward_model")
    assert kinds.names_where("scores") == ("reward_model",)
    assert kinds.names_where("documents") == ("lm",)
    assert set(kinds.rollout_fields()) == {*kinds.FIELDS, "old_logps", "advantages"}
    for kind in kinds.KINDS:  # the keys a row names are config keys of that objective
        assert {kind.reference_key, kind.reference_weight_key} - {""} <= set(kind.keys), kind.name
