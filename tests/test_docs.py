"""The guides are tested like code: README.md and docs/*.md cannot drift from the CLI, the config or the packages.

- Runnable commands. A fenced block whose info string is `bash runnable` holds commands, one a line, that must exit
  0; `console runnable` holds `$ command` lines, each followed by the output it must print (every shown line in
  order, `...` standing for anything), and `exit=N` after it names the exit code they must return. They run in one
  temporary directory per guide (a clone's layout: `configs/`, `tests/`, `tools/` linked from the repository,
  outputs under `runs/`), one after another, so a later command may read what an earlier one wrote. Each is a fork
  of the test worker's fork server (`cli_processes`), which has imported the tools already: the handful of commands
  marked runnable cost ~2 s each on CPU, ~15 s in all (2 cores).
- Generated parts. docs/configuration.md (every key), the logical axis rules of docs/parallelism.md and
  docs/code-map.md are what `python tools/make_config_docs.py` writes, so a key added to the schema without its
  comment in configs/base.yml, or a package without its docstring, fails here.
- Shown commands. The commands a guide shows but does not run set only keys the config has and name only files of
  the repository that exist.
- Links. Every relative link of README.md and docs/*.md names a file that exists and, with `#anchor`, a heading
  of it (GitHub's anchors).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from pathlib import Path

import pytest

import cli_processes

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import make_config_docs  # noqa: E402  (tools/ joins sys.path above)

GUIDES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
LINKED_IN = ("configs", "tests", "tools")  # what a guide's commands read from a clone, linked into their directory
FENCE = re.compile(r"^```(\S*)([^\n]*)\n(.*?)^```\s*$", re.M | re.S)


def _name(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# --------------------------------------------------------------------------------------------- runnable blocks


@dataclasses.dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    expected: tuple[str, ...]  # lines it must print, in order ("..." matches anything)
    exit_code: int


def runnable_commands(text: str) -> list[Command]:
    """The commands of a guide's runnable blocks, in order."""
    commands = []
    for match in FENCE.finditer(text):
        language, options, body = match[1], match[2].split(), match[3]
        if "runnable" not in options:
            continue
        exit_code = int(next((o.split("=", 1)[1] for o in options if o.startswith("exit=")), 0))
        if language == "bash":
            commands += [Command(tuple(shlex.split(line)), (), exit_code) for line in body.splitlines() if line.strip()]
        elif language == "console":
            for chunk in re.split(r"^\$ ", body, flags=re.M)[1:]:
                line, *output = chunk.splitlines()
                commands.append(Command(tuple(shlex.split(line)), tuple(output), exit_code))
        else:
            raise AssertionError(f"a runnable block must be bash or console, not {language!r}")
    return commands


def _argv(command: Command) -> list[str]:
    """The command as the guide's reader runs it, with this interpreter for `python`."""
    program, *rest = command.argv
    assert program in ("python", "python3", ".venv/bin/python"), f"a runnable command runs python: {command.argv}"
    assert not set(rest) & {"|", "&&", ";", ">", "<", "&"}, f"one command a line, no shell: {command.argv}"
    return [sys.executable, *rest]


def _prints(expected: tuple[str, ...], output: str) -> str | None:
    """The first expected line the output does not show in order ("..." anywhere in a line matches anything)."""
    lines, at = output.splitlines(), 0
    for want in expected:
        if want.strip() == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.rstrip().split("...")) + r"\s*$")
        found = next((i for i in range(at, len(lines)) if pattern.fullmatch(lines[i].rstrip())), None)
        if found is None:
            return want
        at = found + 1
    return None


def test_the_runnable_marker_parses() -> None:
    text = ("```bash runnable\npython -m maxshard.plan a b\n```\n"
            "```console runnable exit=2\n$ python x.py 'a b'\nout\n...\n```\n")
    assert runnable_commands(text) == [Command(("python", "-m", "maxshard.plan", "a", "b"), (), 0),
                                       Command(("python", "x.py", "a b"), ("out", "..."), 2)]
    assert _prints(("a ... c", "...", "d"), "x\na b c\ny\nd\n") is None
    assert _prints(("d", "a b c"), "a b c\nd\n") == "a b c"  # order counts


RUNNABLE = [path for path in GUIDES if runnable_commands(path.read_text(encoding="utf-8"))]


def test_the_guides_mark_commands_runnable() -> None:
    """The marker did not silently vanish: the guides whose commands this file runs."""
    assert {"docs/configuration.md", "docs/parallelism.md", "docs/planning.md",
            "docs/models-and-conversion.md"} <= {_name(path) for path in RUNNABLE}


@pytest.mark.parametrize("guide", RUNNABLE, ids=_name)
def test_a_guides_runnable_commands_run_as_written(guide: Path, tmp_path: Path) -> None:
    for name in LINKED_IN:
        (tmp_path / name).symlink_to(REPO / name)
    for command in runnable_commands(guide.read_text(encoding="utf-8")):
        done = cli_processes.run(_argv(command), cwd=tmp_path, capture_output=True, text=True, timeout=300)
        shown = f"{_name(guide)}: {shlex.join(command.argv)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        assert done.returncode == command.exit_code, shown
        assert "Traceback" not in done.stderr, shown
        missing = _prints(command.expected, done.stdout + done.stderr)
        assert missing is None, f"does not print {missing!r}: {shown}"


# --------------------------------------------------------------------------------------------- every command's keys

CONFIGURED = ("maxshard.train", "maxshard.generate", "maxshard.eval", "maxshard.plan")  # take CONFIG key=value ...
REPO_PATH = re.compile(r"^(configs|tests/fixtures|tools|benchmarks)/")


def shown_commands(text: str) -> list[list[str]]:
    """The python command lines of a guide's code blocks that are not runnable (those run above), as tokens:
    fenced blocks and indented ones, `$ ` prompts and `&&` chains split, a trailing `&` dropped."""
    blocks = [m[3] for m in FENCE.finditer(text) if "runnable" not in m[2].split()]
    blocks += re.findall(r"^    (\S.*)$", FENCE.sub("", text), re.M)
    commands = []
    lines = (line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines())
    for line in lines:
        for part in line.removeprefix("$ ").split("&&"):
            part = part.strip().removesuffix("&").strip()
            if re.match(r"^(\.venv/bin/)?python3? ", part):
                commands.append(shlex.split(part))
    return commands


def _settings(argv: list[str]) -> list[str]:
    """The `key=value` tokens a command hands to a maxshard config (after `--` for a launcher)."""
    if len(argv) > 2 and argv[1] == "-m" and argv[2] in CONFIGURED:
        tokens = argv[3:]
    elif len(argv) > 2 and argv[1] == "-m" and argv[2] == "maxshard.launch" and "--" in argv:
        tokens = argv[argv.index("--") + 1:]
    elif len(argv) > 1 and argv[1] == "tools/sharding_report.py":
        tokens = argv[2:]
    else:
        return []
    return [token for token in tokens if re.match(r"^\w+=", token)]


def test_shown_commands_are_found_in_fenced_indented_and_continued_blocks() -> None:
    text = ("```bash\npython -m maxshard.launch xpk --cluster C \\\n    -- configs/base.yml steps=5\n```\n\n"
            "    python -m maxshard.train configs/base.yml a_key=1 &\n\n"
            "```console runnable\n$ python -m maxshard.plan configs/base.yml wrong=1\n```\n")
    commands = shown_commands(text)
    assert [_settings(argv) for argv in commands] == [["steps=5"], ["a_key=1"]]  # the runnable one runs instead


@pytest.mark.parametrize("guide", GUIDES, ids=_name)
def test_every_command_a_guide_shows_sets_real_keys_and_names_real_files(guide: Path) -> None:
    """What is not run is still checked: each `key=value` of a shown command names a config key, and each path of
    this repository it names (configs/, tests/fixtures/, tools/, benchmarks/) exists."""
    keys = set(make_config_docs.config.user_keys())
    wrong = []
    for argv in shown_commands(guide.read_text(encoding="utf-8")):
        wrong += [f"{token} (no such key)" for token in _settings(argv) if token.split("=", 1)[0] not in keys]
        for token in argv:
            path = token.split("=", 1)[-1]
            if REPO_PATH.match(path) and not any(REPO.glob(path)):
                wrong.append(f"{path} (no such file)")
    assert wrong == [], f"{_name(guide)}: {wrong}"


def test_every_convertible_family_has_its_row_in_the_families_table() -> None:
    from maxshard.convert import families

    table = (REPO / "docs" / "models-and-conversion.md").read_text(encoding="utf-8").split("## Families", 1)[1]
    missing = [f.architecture for f in families.FAMILIES if f"`{f.architecture}`" not in table]
    assert missing == [], f"docs/models-and-conversion.md, Families: no row names {missing}"


def _in_code(name: str, text: str) -> bool:
    return re.search(rf"`[^`\n]*(?<![\w.]){re.escape(name)}(?![\w])[^`\n]*`", text) is not None


@pytest.mark.parametrize(("guide", "table"), [("data.md", "dataset_types"), ("alignment-and-rl.md", "objectives")])
def test_every_reader_and_objective_is_in_its_guide(guide: str, table: str) -> None:
    """The rows of maxshard/dataset_types.py and objectives/kinds.py, each named (in code) in its guide."""
    from maxshard import dataset_types
    from maxshard.objectives import kinds

    names = dataset_types.NAMES if table == "dataset_types" else kinds.NAMES
    text = (REPO / "docs" / guide).read_text(encoding="utf-8")
    assert [name for name in names if not _in_code(name, text)] == [], f"docs/{guide} does not name them"


# --------------------------------------------------------------------------------------------- generated parts


def test_the_generated_parts_are_current() -> None:
    stale = [_name(path) for path, (now, new) in make_config_docs.updated().items() if now != new]
    assert stale == [], f"{stale} out of date: run python tools/make_config_docs.py"


def _base_yml() -> str:
    return make_config_docs.BASE_YML.read_text(encoding="utf-8")


def test_a_schema_key_without_documentation_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = make_config_docs.config.user_keys()
    monkeypatch.setattr(make_config_docs.config, "user_keys", lambda: (*keys, "a_new_key"))
    with pytest.raises(make_config_docs.DocsError, match="lacks a_new_key"):
        make_config_docs.configuration_reference(_base_yml())


def test_a_key_whose_comment_is_gone_fails() -> None:
    text = re.sub(r"^(steps: \d+)\s+#.*$", r"\1", _base_yml(), flags=re.M)
    with pytest.raises(make_config_docs.DocsError, match="steps has no '# comment'"):
        make_config_docs.configuration_reference(text)


def test_the_reference_has_every_key_with_its_type_default_and_comment() -> None:
    reference = make_config_docs.configuration_reference(_base_yml())
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `(\w+)` \|.*$", reference, re.M)}
    assert set(rows) == set(make_config_docs.config.user_keys())
    assert rows["steps"] == "| `steps` | int | `300` | number of optimizer steps to train |"
    assert rows["remat_policy"].startswith("| `remat_policy` | `auto` \\| `none` \\| `minimal`")


def test_a_package_without_a_docstring_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "maxshard" / "newpkg").mkdir(parents=True)
    (tmp_path / "maxshard" / "newpkg" / "__init__.py").write_text("")
    (tmp_path / "tools").mkdir()
    monkeypatch.setattr(make_config_docs, "REPO", tmp_path)
    monkeypatch.setattr(make_config_docs, "PACKAGE", tmp_path / "maxshard")
    with pytest.raises(make_config_docs.DocsError, match="maxshard/newpkg/__init__.py has no docstring"):
        make_config_docs.code_map()


# --------------------------------------------------------------------------------------------- links


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """A Markdown file's heading anchors; a repeated heading gets -1, -2, ... as on GitHub."""
    found, count = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text), re.M):
        slug = anchor(heading)
        found.add(slug if slug not in count else f"{slug}-{count[slug]}")
        count[slug] = count.get(slug, 0) + 1
    return found


def links(text: str) -> list[str]:
    """The targets of a Markdown file's links and images, outside code blocks and code spans."""
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose)


def test_the_anchor_rule_is_githubs() -> None:
    assert anchor("Layout search (`--search`)") == "layout-search---search"
    assert anchor("Fitting memory: `remat_policy: auto`") == "fitting-memory-remat_policy-auto"
    assert anchor("libtpu releases and the planner's constants") == "libtpu-releases-and-the-planners-constants"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


@pytest.mark.parametrize("guide", GUIDES, ids=_name)
def test_every_relative_link_resolves(guide: Path) -> None:
    broken = []
    for target in links(guide.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (guide.parent / path).resolve() if path else guide
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading #{fragment} in {file.name})")
    assert broken == [], f"{_name(guide)}: {broken}"
