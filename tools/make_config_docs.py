"""Write the generated parts of the guides: the configuration reference, the logical axis rules and the code map.

    python tools/make_config_docs.py          # rewrite them in place
    python tools/make_config_docs.py --check  # exit 1 and name the files that are out of date

Each fact keeps one home, and the guides are generated from it, so they cannot drift:

- every key's type and default: `maxshard/config/schema.py` (`Config`, model keys inherited from
  `spec/model_config.py`); its one-line comment and its section: `configs/base.yml` (tests/test_config.py keeps the
  two in agreement). -> docs/configuration.md, "Every key".
- the presets: the leading comment of each `configs/models/NAME.yml` and layout file `configs/*.yml`.
  -> docs/configuration.md, "Presets".
- the logical axis rules: the `logical_axis_rules` table of `configs/base.yml`. -> docs/parallelism.md.
- what each package is for: the first paragraph of its `__init__.py` docstring (of a top-level module or a tools/
  script: its docstring's first paragraph). -> docs/code-map.md.

A generated part sits between `<!-- BEGIN GENERATED: NAME ... -->` and `<!-- END GENERATED: NAME -->` in its guide;
the prose around it is written by hand. A user key without a comment in base.yml, a base.yml key the schema does not
know, or a package without a docstring stops the generator with one line naming it (tests/test_docs.py runs it).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the schema imports jax; the docs need no accelerator

from maxshard import config  # noqa: E402  (after the repository joins sys.path)
from maxshard.config import Config  # noqa: E402

BASE_YML = REPO / "configs" / "base.yml"
PACKAGE = REPO / "maxshard"
BLOCK_KEYS = ("logical_axis_rules",)  # a block value in base.yml: its comment is the paragraph above it
COMMAND = "python tools/make_config_docs.py"
RULES_LINK = "[the rules table](parallelism.md#the-logical-axis-rules)"  # the block key's default, in its own guide


class DocsError(Exception):
    """A fact the generator needs is missing at its home (a key's comment, a package's docstring)."""


# --------------------------------------------------------------------------------------------- base.yml


@dataclass(frozen=True)
class Key:
    name: str
    value: str  # as written in base.yml
    comment: str
    section: str


def _section_title(line: str) -> str:
    """`# ---- model` -> `model`; `# ---- grpo (objective grpo): ...` -> `grpo (objective grpo): ...`."""
    return line.split("----", 1)[1].strip()


def read_base_yml(text: str) -> list[Key]:
    """Every top-level key of base.yml with its value, trailing comment and the `# ---- section` above it."""
    keys: list[Key] = []
    section, paragraph = "", []
    for line in text.splitlines():
        if line.startswith("# ----"):
            section, paragraph = _section_title(line), []
        elif line.startswith("#"):
            paragraph.append(line.lstrip("# ").rstrip())
        elif match := re.match(r"^(\w+):\s*(.*)$", line):
            name, rest = match[1], match[2]
            value, _, comment = rest.partition(" #")
            if name in BLOCK_KEYS:
                comment = " ".join(paragraph)
            keys.append(Key(name, value.strip(), comment.strip(), section))
            paragraph = []
        elif not line.strip():
            paragraph = []
    return keys


def logical_rules(text: str) -> list[tuple[str, str, str]]:
    """(logical name, mesh axes as written, the comment line above the rule's group) of base.yml's rules table."""
    rules, note, inside = [], "", False
    for line in text.splitlines():
        if line.startswith("logical_axis_rules:"):
            inside = True
            continue
        if inside and not line.startswith(" "):
            break
        stripped = line.strip()
        if stripped.startswith("#"):
            note = stripped.lstrip("# ")
        elif match := re.match(r"^- \[(\w+),\s*(.*)\](?:\s*#\s*(.*))?$", stripped):
            rules.append((match[1], match[2].strip(), match[3] or note))
    return rules


# --------------------------------------------------------------------------------------------- rendering


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: pipes escaped everywhere (GFM splits cells on them even inside code),
    angle brackets and asterisks outside `code` kept literal rather than read as HTML or emphasis."""
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # outside code spans
        pieces[i] = pieces[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(pieces).replace("|", "\\|")


def type_name(hint: object) -> str:
    """A key's type in words: `int`, `a \\| b` for a choice, `list of str`, ..."""
    if typing.get_origin(hint) is typing.Literal:
        return " \\| ".join(f"`{v}`" if v else '`""`' for v in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            inner = args[0]
            if inner is str:
                return "list of str"
            if typing.get_origin(inner) is tuple and typing.get_args(inner)[0] is str:
                second = typing.get_args(inner)[1]
                if second is float:
                    return "list of [source, weight]"
                if typing.get_args(second) == (str, Ellipsis):
                    return "list of [name, [mesh axes]]"
                return "list of [regex, {key: value}]"
        return "list"
    return getattr(hint, "__name__", str(hint))


def _sections(keys: list[Key]) -> list[tuple[str, list[Key]]]:
    order: dict[str, list[Key]] = {}
    for key in keys:
        order.setdefault(key.section, []).append(key)
    return list(order.items())


def _anchorable(title: str) -> str:
    """A section title as a heading: its first word (`model`, `grpo`, ...) and the rest as a sentence."""
    return title[:1].upper() + title[1:]


def configuration_reference(text: str) -> str:
    """docs/configuration.md's reference: one table per base.yml section, a row per key (type, default, comment)."""
    keys = read_base_yml(text)
    hints = typing.get_type_hints(Config)
    user = set(config.user_keys())
    written = {key.name for key in keys}
    if unknown := sorted(written - user):
        raise DocsError(f"configs/base.yml: {unknown[0]} is not a key of maxshard/config/schema.py")
    if missing := sorted(user - written):
        raise DocsError(f"configs/base.yml lacks {missing[0]}, a key of maxshard/config/schema.py: "
                        "add it with a '# comment'")
    if undocumented := [key.name for key in keys if not key.comment]:
        raise DocsError(f"configs/base.yml: {undocumented[0]} has no '# comment' to document it")
    out = []
    for title, group in _sections(keys):
        out += [f"### {_cell(_anchorable(title))}", "", "| key | type | default | what it does |", "|---|---|---|---|"]
        for key in group:
            default = RULES_LINK if key.name in BLOCK_KEYS else f"`{key.value}`"
            out.append(f"| `{key.name}` | {type_name(hints[key.name])} | {default} | {_cell(key.comment)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def rules_table(text: str) -> str:
    """docs/parallelism.md's table of base.yml's logical axis rules, in the order they are tried."""
    out, previous = ["| logical name | mesh axes (product) | group |", "|---|---|---|"], None
    for name, axes, note in logical_rules(text):
        shown = "replicated" if axes == "null" else f"`{axes}`"
        out.append(f"| `{name}` | {shown} | {_cell(note) if note != previous else ''} |")
        previous = note
    return "\n".join(out) + "\n"


def _leading_comment(path: Path) -> str:
    """The comment lines a YAML file starts with, as one line (a preset says what it is there)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").rstrip())
    if not lines:
        raise DocsError(f"{path.relative_to(REPO).as_posix()} starts with no '# comment' saying what it is")
    return " ".join(lines)


def presets() -> str:
    """docs/configuration.md's table of the presets: `model_name=NAME` (configs/models/) and the layout files."""
    out = ["| preset | use | what it is |", "|---|---|---|"]
    for path in sorted((REPO / "configs" / "models").glob("*.yml")):
        out.append(f"| `{path.stem}` | `model_name={path.stem}` | {_cell(_leading_comment(path))} |")
    for path in sorted((REPO / "configs").glob("*.yml")):
        if path != BASE_YML:
            out.append(f"| `{path.name}` | `configs/{path.name}` | {_cell(_leading_comment(path))} |")
    return "\n".join(out) + "\n"


def _first_paragraph(source: str, where: str) -> str:
    docstring = ast.get_docstring(ast.parse(source))
    if not docstring:
        raise DocsError(f"{where} has no docstring: its first paragraph is the code map's line for it")
    return " ".join(docstring.split("\n\n")[0].split()).rstrip(":")


def code_map() -> str:
    """docs/code-map.md's table: every package (a folder with __init__.py) and top-level module of maxshard/, and
    every script of tools/."""
    out = ["| path | what it is |", "|---|---|"]
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent.relative_to(REPO).as_posix()
        if folder == "maxshard":
            continue
        line = _first_paragraph(init.read_text(encoding="utf-8"), f"{folder}/__init__.py")
        out.append(f"| `{folder}/` | {_cell(line)} |")
    for module in [*sorted(PACKAGE.glob("*.py")), *sorted((REPO / "tools").glob("*.py"))]:
        if module.name == "__init__.py":
            continue
        path = module.relative_to(REPO).as_posix()
        out.append(f"| `{path}` | {_cell(_first_paragraph(module.read_text(encoding='utf-8'), path))} |")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------- the guides


def generated_parts() -> dict[Path, dict[str, str]]:
    """{guide: {part name: generated text}}."""
    text = BASE_YML.read_text(encoding="utf-8")
    docs = REPO / "docs"
    return {
        docs / "configuration.md": {"presets": presets(), "config-keys": configuration_reference(text)},
        docs / "parallelism.md": {"logical-axis-rules": rules_table(text)},
        docs / "code-map.md": {"code-map": code_map()},
    }


def fill(document: str, name: str, body: str, where: str) -> str:
    """`document` with the part between NAME's markers replaced by `body`."""
    pattern = re.compile(rf"(<!-- BEGIN GENERATED: {name}\b[^>]*-->\n).*?(<!-- END GENERATED: {name} -->)", re.S)
    if not pattern.search(document):
        raise DocsError(f"{where} lacks the markers <!-- BEGIN GENERATED: {name} --> ... "
                        f"<!-- END GENERATED: {name} -->")
    return pattern.sub(lambda m: m[1] + "\n" + body + "\n" + m[2], document, count=1)


def updated() -> dict[Path, tuple[str, str]]:
    """{guide: (its text now, its text with every generated part current)}."""
    result = {}
    for path, parts in generated_parts().items():
        now = path.read_text(encoding="utf-8")
        new = now
        for name, body in parts.items():
            new = fill(new, name, body, path.relative_to(REPO).as_posix())
        result[path] = (now, new)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a guide is out of date")
    args = parser.parse_args(argv)
    try:
        guides = updated()
    except DocsError as error:
        print(f"make_config_docs: error: {error}", file=sys.stderr)
        return 2
    stale = [path for path, (now, new) in guides.items() if now != new]
    for path in stale:
        name = path.relative_to(REPO).as_posix()
        if args.check:
            print(f"{name} is out of date: run {COMMAND}", file=sys.stderr)
        else:
            path.write_text(guides[path][1], encoding="utf-8")
            print(f"wrote {name}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
