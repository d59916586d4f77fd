"""The one-way import rule, as a test: imports follow the data flow (config -> mesh -> sharding -> layers -> model
-> step -> train), so a layer never learns about meshes or runs and the config loader depends on nothing.

Imports are read from the source with `ast` (deferred imports inside functions count too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "maxshard"

CONFIG = ("maxshard.config", "maxshard.config_schema", "maxshard.config_ranges", "maxshard.config_structures",
          "maxshard.model_config", "maxshard.remat")
LEAVES = ("maxshard.axis_names", "maxshard.units", "maxshard.perf", "maxshard.model_config", "maxshard.remat")
LAYER_DEPS = ("maxshard.axis_names", "maxshard.sharding", "maxshard.model_config", "maxshard.remat", "maxshard.layers")

# module (or package) -> the only maxshard modules it may import (prefixes). The most specific entry applies.
ALLOWED: dict[str, tuple[str, ...]] = {
    **{leaf: () for leaf in LEAVES},
    "maxshard.config_schema": ("maxshard.model_config", "maxshard.remat"),
    "maxshard.config_ranges": ("maxshard.config_schema", "maxshard.model_config"),
    "maxshard.config_structures": ("maxshard.config_schema", "maxshard.model_config"),
    "maxshard.config": CONFIG,
    "maxshard.mesh": CONFIG,
    "maxshard.sharding": CONFIG,
    "maxshard.elastic": CONFIG,
    "maxshard.layers": LAYER_DEPS,
    "maxshard.model": LAYER_DEPS,
    "maxshard.data": (*CONFIG, "maxshard.axis_names", "maxshard.sharding", "maxshard.data"),
}

# Entry points: nothing of the package imports them (they wire everything together).
ENTRY_POINTS = ("maxshard.train",)


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


def allowed_for(module: str) -> tuple[str, ...] | None:
    """The most specific rule of ALLOWED for `module`, None when no rule names it."""
    matches = [key for key in ALLOWED if module == key or module.startswith(key + ".")]
    return ALLOWED[max(matches, key=len)] if matches else None


def violations(module: str, imported: set[str]) -> list[str]:
    problems = [f"{module} imports the entry point {name}" for name in sorted(imported) if name in ENTRY_POINTS]
    allowed = allowed_for(module)
    if allowed is not None:
        for name in sorted(imported):
            if not any(name == ok or name.startswith(ok + ".") for ok in allowed):
                problems.append(f"{module} imports {name}; it may import only {', '.join(allowed) or 'nothing'}")
    return problems


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_follow_the_data_flow(path: Path) -> None:
    assert violations(module_name(path), imports_of(path)) == []


def test_the_rule_table_bites() -> None:
    """The rules name real modules, and a forbidden import is reported (a layer importing the mesh, the config
    importing the model, data importing the model, anything importing train)."""
    names = {module_name(p) for p in MODULES}
    assert all(key in names for key in ALLOWED)
    assert violations("maxshard.layers.attention", {"maxshard.mesh"})
    assert violations("maxshard.layers.pipeline", {"maxshard.config"})
    assert violations("maxshard.config", {"maxshard.model"})
    assert violations("maxshard.data.sources", {"maxshard.model"})
    assert violations("maxshard.checkpoint", {"maxshard.train"})
    assert not violations("maxshard.layers.attention", {"maxshard.sharding", "maxshard.layers.linears"})
