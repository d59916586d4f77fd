"""A sweep as XPK submissions: one validated `python -m maxshard.launch xpk ...` dry-run command per point.

Nothing is submitted: each point goes through the launcher's own dry run (in process), which checks its config for
the target slice and prints the `xpk workload create` it would run; a point the launcher rejects becomes a
`# skipped` comment. Adding --execute (after `xpk`) to a printed command submits it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.sweep_spec import REPO, Point, Sweep, SweepError, overrides_argv, run_name

XPK_FLAGS = ("cluster", "project", "zone", "device_type", "num_slices", "docker_image", "base_docker_image")


def xpk_settings(sweep: Sweep, args: argparse.Namespace) -> dict[str, Any]:
    """The sweep file's `xpk:` defaults overridden by the command line; SweepError if a required one is missing."""
    unknown = set(sweep.xpk) - set(XPK_FLAGS)
    if unknown:
        raise SweepError(f"unknown key(s) {sorted(unknown)} under xpk:; allowed: {', '.join(XPK_FLAGS)}")
    given = {k: getattr(args, k) for k in XPK_FLAGS if getattr(args, k) is not None}
    if "docker_image" in given or "base_docker_image" in given:
        given.setdefault("docker_image", None)
        given.setdefault("base_docker_image", None)
    settings = {**sweep.xpk, **given}
    missing = [k for k in ("cluster", "project", "zone", "device_type") if not settings.get(k)]
    if not (settings.get("docker_image") or settings.get("base_docker_image")):
        missing.append("docker_image (or base_docker_image)")
    if missing:
        raise SweepError("--xpk needs " + ", ".join("--" + m.replace("_", "-") for m in missing))
    return settings


def launcher_argv(settings: Mapping[str, Any], trainer_argv: Sequence[str]) -> list[str]:
    """`python -m maxshard.launch xpk` flags (dry run: no --execute) then `--` and the trainer's argv."""
    image = ("--docker-image", settings["docker_image"]) if settings.get("docker_image") else (
        "--base-docker-image", settings["base_docker_image"])  # fmt: skip
    flags = ["--cluster", settings["cluster"], "--project", settings["project"], "--zone", settings["zone"],
             "--device-type", settings["device_type"], "--num-slices", str(settings.get("num_slices") or 1),
             *image]  # fmt: skip
    return ["xpk", *map(str, flags), "--", *trainer_argv]


def xpk_point(sweep: Sweep, point: Point, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Validates one point through the launcher's dry run (in process, nothing executed)."""
    from maxshard.launch.__main__ import main as launch_main

    trainer = [sweep.base_config, *overrides_argv(sweep.merged(point)), f"run_name={run_name(sweep, point)}"]
    argv = launcher_argv(settings, trainer)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = launch_main(argv)
    row = {"index": point.index, "name": point.name, "overrides": " ".join(overrides_argv(point.overrides)),
           "command": shlex.join(["python", "-m", "maxshard.launch", *argv])}  # fmt: skip
    if code != 0:
        return {**row, "status": "skipped", "error": (stderr.getvalue().strip().splitlines() or ["?"])[-1]}
    return {**row, "status": "ok", "xpk_command": stdout.getvalue().strip()}


def run_xpk(sweep: Sweep, settings: Mapping[str, Any], out: str) -> list[dict[str, Any]]:
    """Prints one launcher command per valid point (a `# skipped` comment for the others) and saves them."""
    rows = [xpk_point(sweep, point, settings) for point in sweep.points]
    lines = [f"# sweep {sweep.name}: {len(rows)} points; each command validates and prints `xpk workload create`,"
             " add --execute (after xpk) to submit"]  # fmt: skip
    for row in rows:
        if row["status"] == "ok":
            lines.append(row["command"])
        else:
            lines.append(f"# skipped {row['name']}: {row['error']}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "xpk_commands.sh"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(out, "xpk.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"sweep": sweep.name, **row}) + "\n" for row in rows)
    return rows
