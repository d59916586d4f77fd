"""`xpk workload create` for a maxshard run: validate the trainer config for the target, then print or run the command.

    python -m maxshard.launch xpk --cluster C --project P --zone Z --device-type v5p-256 --num-slices 2 \\
        --docker-image IMG -- configs/base.yml steps=1000

Why validate here: a mesh that does not fit the target (`ici_fsdp_parallelism=3` on 128 chips) should fail in one
second on a laptop, not after the workload waited in a queue for hardware. The config is checked with the device count,
device kind and host count the target will report, so `mesh_rules` and the mesh knobs resolve as they will there.

Why every token is `shlex.quote`d: XPK hands `--command` to a shell in the container. A value with spaces, quotes,
`;`, `$()` or backticks must reach the trainer as typed and never run as shell. Newlines are refused: XPK places the
command inside a YAML block, where a newline would change its meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from maxshard import config
from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.launch import topologies
from maxshard.launch.topologies import Target
from maxshard.parallel import mesh, stages

__all__ = [
    "TRAINER",
    "PRIORITIES",
    "Request",
    "validate_workload_name",
    "make_workload_name",
    "check_tokens",
    "prepare_trainer_argv",
    "make_request",
    "validate_for_target",
    "trainer_command",
    "xpk_argv",
    "build_parser",
    "main",
]

TRAINER = ("python", "-m", "maxshard.train")
PRIORITIES = ("very-low", "low", "medium", "high", "very-high")  # XPK's --priority choices
MAX_WORKLOAD_NAME = 40  # XPK's limit; JobSet derives longer pod and host names from it
_NAME_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # a Kubernetes DNS-1123 label that starts with a letter
_DEFAULT_RUN_NAME = Config.run_name


@dataclasses.dataclass(frozen=True)
class Request:
    """Everything `xpk workload create` needs for one maxshard run."""

    cluster: str
    project: str
    zone: str
    target: Target
    workload: str
    trainer_argv: tuple[str, ...]  # config file and key=value overrides, as the trainer will receive them
    docker_image: str = ""  # used as is
    base_docker_image: str = ""  # XPK layers the current directory on top of it
    priority: str = "medium"
    max_restarts: int = 0


# --------------------------------------------------------------------------------------------- workload names


def validate_workload_name(name: str) -> str:
    """XPK and Kubernetes accept lowercase letters, digits and '-', starting with a letter, at most 40 characters."""
    if not _NAME_RE.fullmatch(name) or len(name) > MAX_WORKLOAD_NAME:
        raise ConfigError(
            f"--workload {name!r} must be lowercase letters, digits and '-', start with a letter, end with a letter "
            f"or digit, and have at most {MAX_WORKLOAD_NAME} characters"
        )
    return name


def make_workload_name(run_name: str, suffix: str) -> str:
    """A unique, valid name: the run name made DNS-safe (or 'maxshard'), cut to fit, then '-' + suffix."""
    stem = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")
    if not stem or run_name == _DEFAULT_RUN_NAME:
        stem = "maxshard"
    if not stem[0].isalpha():
        stem = f"run-{stem}"
    stem = stem[: MAX_WORKLOAD_NAME - len(suffix) - 1].rstrip("-")
    return validate_workload_name(f"{stem}-{suffix}")


def default_suffix() -> str:
    """'1121-2345-a3f0': month, day, time and 4 random hex digits, so two submissions in a minute still differ."""
    return f"{time.strftime('%m%d-%H%M')}-{secrets.token_hex(2)}"


# --------------------------------------------------------------------------------------------- trainer config


def _unit(target: Target) -> str:
    return "slices" if target.accelerator == "tpu" else "nodes"


def check_tokens(user_argv: Sequence[str]) -> None:
    """A config file first; no token XPK could not carry (a newline would break the YAML block it goes into)."""
    if not user_argv:
        raise ConfigError("give the trainer's config after --: ... -- configs/base.yml key=value ...")
    for token in user_argv:
        if "\n" in token or "\r" in token or "\0" in token:
            raise ConfigError(f"trainer argument {token!r} contains a newline or NUL, which XPK cannot pass on")


def prepare_trainer_argv(user_argv: Sequence[str], cfg: Config, target: Target, workload: str) -> tuple[str, ...]:
    """The user's trainer argv (`cfg` is it parsed) plus `num_slices` of the target and `run_name` = the workload.

    A `num_slices` the user gave (on the command line, or a non-default one in a config file) must match the target;
    a run name the user gave (either way) is kept.
    """
    given = set(cfg.explicit_keys)  # keys set on the command line
    if ("num_slices" in given or cfg.num_slices != 1) and cfg.num_slices != target.num_slices:
        raise ConfigError(
            f"num_slices={cfg.num_slices} does not match the target's {target.num_slices} {_unit(target)} "
            "(--num-slices)"
        )
    extra = [] if "num_slices" in given else [f"num_slices={target.num_slices}"]
    if "run_name" not in given and cfg.run_name == _DEFAULT_RUN_NAME:
        extra.append(f"run_name={workload}")
    return (*user_argv, *extra)


def validate_for_target(trainer_argv: Sequence[str], target: Target) -> Config:
    """Parses and finalizes the config as the trainer will on the target, and resolves the mesh; ConfigError if not."""
    cfg = config.parse(trainer_argv)
    try:
        cfg = config.finalize(cfg, target.num_devices, target.device_kind, target.num_hosts)
        stages.resolve(cfg, mesh.axis_sizes(cfg))  # the pipeline's shape and batch split on the target's mesh
    except ConfigError as e:
        where = f"target {target.name} x {target.num_slices} {_unit(target)}: {target.num_devices} devices"
        raise ConfigError(f"{e} ({where})") from None
    return cfg


# --------------------------------------------------------------------------------------------- commands


def trainer_command(trainer_argv: Sequence[str], program: Sequence[str] = TRAINER) -> str:
    """One shell line that runs `program` with `trainer_argv` exactly as given (every token quoted)."""
    return shlex.join([*program, *trainer_argv])


def xpk_argv(request: Request, program: Sequence[str] = TRAINER) -> list[str]:
    """The `xpk workload create` argv; `program` replaces `python -m maxshard.train` (tests run a stand-in)."""
    target = request.target
    count_flag = "--num-slices" if target.accelerator == "tpu" else "--num-nodes"
    image_flag = "--docker-image" if request.docker_image else "--base-docker-image"
    return [
        "xpk", "workload", "create",
        "--cluster", request.cluster,
        "--project", request.project,
        "--zone", request.zone,
        "--workload", request.workload,
        "--device-type", target.name,
        count_flag, str(target.num_slices),
        image_flag, request.docker_image or request.base_docker_image,
        "--priority", request.priority,
        "--max-restarts", str(request.max_restarts),
        "--command", trainer_command(request.trainer_argv, program),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m maxshard.launch xpk",
        description="Validate a maxshard config for a GKE target and print (or run) its `xpk workload create`.",
        epilog="Everything after -- is the trainer's argv: CONFIG.yml key=value ...",
    )
    parser.add_argument("--cluster", required=True, help="GKE cluster created with `xpk cluster create`")
    parser.add_argument("--project", required=True, help="Google Cloud project")
    parser.add_argument("--zone", required=True, help="zone of the cluster, e.g. us-east5-a")
    parser.add_argument("--device-type", required=True, help="v5p-256, v5litepod-16, v6e-256, h100-80gb-8, ...")
    parser.add_argument("--num-slices", type=int, default=1, help="TPU slices, or GPU nodes (default 1)")
    image = parser.add_mutually_exclusive_group(required=True)
    image.add_argument("--docker-image", help="image built from this repo's Dockerfile, used as is")
    image.add_argument("--base-docker-image", help="image with maxshard's dependencies; XPK adds this directory")
    parser.add_argument("--priority", choices=PRIORITIES, default="medium", help="Kueue priority (default medium)")
    parser.add_argument("--max-restarts", type=int, default=0, help="JobSet restarts on failure (default 0)")
    parser.add_argument("--workload", help="workload name (default: run name + timestamp + random suffix)")
    parser.add_argument("--execute", action="store_true", help="run xpk instead of printing the command")
    return parser


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Launcher flags before `--`, the trainer's argv after it."""
    if "--" not in argv:
        return list(argv), []
    cut = list(argv).index("--")
    return list(argv[:cut]), list(argv[cut + 1 :])


def make_request(args: argparse.Namespace, trainer: Sequence[str], suffix: str | None = None) -> Request:
    """Checks every launcher flag and the trainer config; raises ConfigError with one line."""
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    target = topologies.parse(args.device_type, args.num_slices)
    gpu = topologies.GPU_TYPES.get(target.name)
    if gpu is not None and not gpu.xpk:
        launchable = ", ".join(n for n, g in topologies.GPU_TYPES.items() if g.xpk)
        raise ConfigError(f"--device-type {target.name} is a node type for planning (python -m maxshard.plan), not "
                          f"one XPK creates; XPK's GPU types: {launchable}")
    check_tokens(trainer)
    cfg = config.parse(trainer)
    if args.workload is not None:
        workload = validate_workload_name(args.workload)
    else:
        workload = make_workload_name(cfg.run_name, suffix or default_suffix())
    trainer_argv = prepare_trainer_argv(trainer, cfg, target, workload)
    validate_for_target(trainer_argv, target)
    return Request(
        args.cluster, args.project, args.zone, target, workload, trainer_argv,
        docker_image=args.docker_image or "", base_docker_image=args.base_docker_image or "",
        priority=args.priority, max_restarts=args.max_restarts,
    )  # fmt: skip


def main(
    argv: Sequence[str],
    *,
    suffix: str | None = None,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> int:
    """Dry run by default: prints the command on one line. Exit 2 for every user mistake, with one line."""
    try:
        flags, trainer = _split(argv)
        args = build_parser().parse_args(flags)  # --help, or a flag argparse rejects: SystemExit below
        command = xpk_argv(make_request(args, trainer, suffix))
    except ConfigError as e:
        print(f"maxshard: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse printed usage and its message
        return e.code if isinstance(e.code, int) else 2
    if not args.execute:
        print(shlex.join(command))
        return 0
    if which(command[0]) is None:
        print("maxshard: error: xpk is not on PATH; pip install xpk, or drop --execute", file=sys.stderr)
        return 2
    return run(command, check=False).returncode
