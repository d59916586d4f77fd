"""The one-way import rule, as a test: packages sit on levels that follow the data flow (config -> parallel -> data ->
layers -> model -> training -> checkpoint/observe -> planning -> run -> entry points), and a module imports only
lower levels, so a layer never learns about runs, the config loader depends on no model code, and no two packages
depend on each other; nor do two folders (the bottom tables live in `spec/`, below every folder that
reads them).

Imports are read from the source with `ast` (deferred imports inside functions count too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "maxshard"

# The packages in import order, lowest first: a module may import its own package and any package of a lower level,
# never one of its own level or above. Where a package and one of its modules sit on different levels (the model
# description that the run config reads, the layers below the rest of the model, the residual tracer above it, as
# it traces the layers for the planner), the most specific name applies.
LEVELS: tuple[tuple[str, ...], ...] = (
    ("maxshard", "maxshard.errors", "maxshard.units", "maxshard.devices", "maxshard.spec"),
    ("maxshard.spec.model_config", "maxshard.spec.remat", "maxshard.spec.attention_kinds", "maxshard.dataset_types",
     "maxshard.spec.pipeline_tables", "maxshard.parallel.axis_names", "maxshard.perf",
     "maxshard.objectives.kinds"),
    # the token-mixer kinds: a row per kind, arithmetic on ModelConfig (its module named, not imported)
    ("maxshard.spec.mixer_kinds",),
    # the model-family seam: the stacks a ModelConfig describes; the pipeline schedules' seam: the circular order and
    # the tables' figures
    ("maxshard.spec.blocks", "maxshard.spec.pipeline_schedule"),
    ("maxshard.config",),
    ("maxshard.parallel",),
    ("maxshard.objectives",),
    ("maxshard.data", "maxshard.launch"),
    ("maxshard.rewards",),  # scores GRPO's completions of `maxshard.data.prompts` records
    ("maxshard.model.layers",),
    ("maxshard.model",),
    ("maxshard.model.residuals",),
    ("maxshard.training",),
    ("maxshard.checkpoint", "maxshard.observe"),
    ("maxshard.planning",),
    ("maxshard.run",),
    ("maxshard.generation", "maxshard.convert"),
    ("maxshard.evaluation",),  # lm-eval's LM over the scorer and generation's engine
    ("maxshard.cli",),
    ("maxshard.train", "maxshard.generate", "maxshard.plan", "maxshard.eval"),
)
# Leaves import nothing of maxshard but the error type; layers (and what traces them) never import the run config,
# not even through another module (checked on the whole import closure below).
LEAVES = LEVELS[0] + LEVELS[1]
NO_RUN_CONFIG = ("maxshard.model.layers", "maxshard.spec.model_config", "maxshard.spec.remat",
                 "maxshard.spec.pipeline_schedule", "maxshard.spec.pipeline_tables", "maxshard.model.residuals")
# Entry points: nothing of the package imports them (they wire everything together).
ENTRY_POINTS = ("maxshard.train", "maxshard.generate", "maxshard.plan", "maxshard.eval", "maxshard.convert.__main__",
                "maxshard.launch.__main__")


def unit_of(module: str) -> str | None:
    """The most specific LEVELS entry that names `module` or one of its packages (the root package names only its
    own, empty, `__init__`)."""
    names = [name for level in LEVELS for name in level
             if module == name or (name != "maxshard" and module.startswith(name + "."))]
    return max(names, key=len) if names else None


def level_of(module: str) -> int:
    unit = unit_of(module)
    assert unit is not None, f"{module} is on no level of tests/test_imports.py"
    return next(i for i, level in enumerate(LEVELS) if unit in level)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (PACKAGE.parent / relative.with_suffix(".py")).exists() or (PACKAGE.parent / relative).is_dir()


def imports_of(path: Path) -> set[str]:
    """maxshard modules imported anywhere in the file; `from maxshard.a import b` counts `maxshard.a.b` when b is
    a module, else `maxshard.a`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "maxshard"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "maxshard":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if _is_module(full) else node.module)
    return found - {"maxshard"}


def violations(module: str, imported: set[str]) -> list[str]:
    """Upward or sideways imports of `module` (to another unit of its own level or a higher one), imports of an
    entry point, and anything a leaf imports beyond the error type."""
    problems = [f"{module} imports the entry point {name}" for name in sorted(imported) if name in ENTRY_POINTS]
    own, mine = unit_of(module), level_of(module)
    for name in sorted(imported):
        if unit_of(name) == own or name in ENTRY_POINTS:
            continue
        if own in NO_RUN_CONFIG and (name == "maxshard.config" or name.startswith("maxshard.config.")):
            problems.append(f"{module} imports the run config {name}")
        elif own in LEAVES and name != "maxshard.errors":
            problems.append(f"{module} is a leaf and imports {name}")
        elif level_of(name) >= mine:
            problems.append(f"{module} (level {mine}) imports {name} (level {level_of(name)})")
    return problems


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_follow_the_data_flow(path: Path) -> None:
    assert violations(module_name(path), imports_of(path)) == []


def import_closure(module: str) -> set[str]:
    """Every maxshard module `module` imports, directly or through others."""
    paths = {module_name(p): p for p in MODULES}
    seen, todo = set(), [module]
    while todo:
        for name in imports_of(paths[todo.pop()]) - seen:
            if name in paths:
                seen.add(name)
                todo.append(name)
    return seen


@pytest.mark.parametrize("path", [p for p in MODULES if unit_of(module_name(p)) in NO_RUN_CONFIG],
                         ids=lambda p: module_name(p))
def test_layers_never_reach_the_run_config(path: Path) -> None:
    reached = sorted(name for name in import_closure(module_name(path)) if name.startswith("maxshard.config"))
    assert reached == []


def test_every_module_has_a_level() -> None:
    assert [name for name in map(module_name, MODULES) if unit_of(name) is None] == []


def test_the_rule_table_bites() -> None:
    """The levels name real modules, and forbidden imports are reported: a layer importing the mesh or the config,
    the config importing the model, data importing the model, the planner importing how a run loads, a checkpoint
    importing the planner, anything importing an entry point, a leaf importing anything."""
    names = {module_name(p) for p in MODULES}
    assert all(unit in names for level in LEVELS for unit in level)
    assert violations("maxshard.model.layers.attention", {"maxshard.parallel.mesh"}) == []  # parallel is below
    assert violations("maxshard.model.layers.pipeline", {"maxshard.config"})
    assert violations("maxshard.model.residuals", {"maxshard.config"})
    assert violations("maxshard.model.transformer", {"maxshard.model.residuals"})
    assert violations("maxshard.model.layers.attention", {"maxshard.model.transformer"})
    assert violations("maxshard.config.loader", {"maxshard.model.transformer"})
    assert violations("maxshard.data.sources", {"maxshard.model.transformer"})
    assert violations("maxshard.data.sources", {"maxshard.launch.xpk"})  # same level, another package
    assert violations("maxshard.planning.fit", {"maxshard.run.loading"})
    assert violations("maxshard.checkpoint.manager", {"maxshard.planning.memory"})
    assert violations("maxshard.checkpoint.manager", {"maxshard.train"})
    assert violations("maxshard.spec.remat", {"maxshard.units"})
    assert not violations("maxshard.spec.remat", {"maxshard.errors"})
    assert not violations("maxshard.run.loading", {"maxshard.planning.fit", "maxshard.training.step"})


def folder_of(module: str) -> str | None:
    """The top-level folder (subpackage) of `module`, None for the package's own top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def test_no_two_folders_import_each_other() -> None:
    """Folders match levels: were folder A to import folder B and B to import A, a module would sit on a level its
    folder does not (as the model description once did inside model/, read by config/ and parallel/)."""
    edges: dict[str, set[str]] = {}
    for path in MODULES:
        source = folder_of(module_name(path))
        for name in imports_of(path):
            target = folder_of(name)
            if source and target and target != source:
                edges.setdefault(source, set()).add(target)
    assert sorted((a, b) for a in edges for b in edges[a] if a < b and a in edges.get(b, set())) == []
