"""An sbatch script for a maxshard run on a SLURM cluster: validate the config, write the script, optionally submit.

    python -m maxshard.launch slurm configs/base.yml steps=1000 --nodes 4 --gpus-per-node 8 --time 4:00:00 --submit

What the script does, and why:
- One task per node by default (each process sees all the node's GPUs, as on XPK), or one per GPU with
  `--tasks-per-node` = `--gpus-per-node` (then `--gpus-per-task` binds one GPU to each).
- Wiring: `JAX_COORDINATOR_ADDRESS` (the job's first host, and the port JAX's own SLURM detection derives from the job
  id), `JAX_PROCESS_COUNT` (`$SLURM_NTASKS`) and, per task, `JAX_PROCESS_ID` (`$SLURM_PROCID`), which
  `maxshard.launch.distributed` reads. JAX's detection (`jax._src.clusters.slurm_cluster`) would find the same three
  facts, but it also pins each process to the one device `$SLURM_LOCALID` names, which hides all but one GPU from a
  process that drives a whole node: so the facts are handed over explicitly (the address as JAX would derive it).
- Preemption: `--signal=TERM@LEAD` asks SLURM for SIGTERM on the job's steps LEAD seconds before the time limit
  (`scancel --signal=TERM JOB` sends the same). The trainer saves and exits 0 on it; the per-task wrapper below knows
  a signal came and exits PREEMPTED_EXIT instead, and the batch script then requeues the job (`--requeue`,
  `scontrol requeue`), which restarts the same command: the run resumes from its checkpoint. A run that completed
  exits 0 and is not requeued.
- Output: `slurm-<job>.out` / `.err` under the run directory (or `--log-dir`), appended across requeues, and
  `slurm-<job>.exit` holding the final exit status (not written by an attempt that requeues).
- Sweeps: several trainer command lines make a job array (`--array=0-N`), index i running line i.

Why nothing a user types can run as shell: every trainer token, path and environment value in the script body is
`shlex.quote`d, and the per-task wrapper is a fixed text that receives the trainer's argv as `"$@"`. Values that go on
`#SBATCH` lines (which sbatch parses, not a shell) must be made of a small set of characters; anything else, a
newline first of all, is one ConfigError line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence

from maxshard import config
from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.launch import xpk

__all__ = [
    "PREEMPTED_EXIT",
    "DEFAULT_SIGNAL_LEAD_S",
    "TASK_WRAPPER",
    "Resources",
    "Job",
    "check_directive_value",
    "parse_time",
    "check_resources",
    "check_env",
    "prepare_trainer_argv",
    "default_log_dir",
    "directives",
    "trainer_lines",
    "render",
    "write_script",
    "sbatch_argv",
    "job_id_of",
    "build_parser",
    "make_job",
    "main",
]

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again"; a task that stopped for a signal, after its save
DEFAULT_SIGNAL_LEAD_S = 120
_DIRECTIVE_RE = re.compile(r"[A-Za-z0-9_.,:@+=/~-]+")
_DIRECTIVE_CHARS = "letters, digits and _.,:@+=/~-"
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TIME_RE = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
_JAX_PORT_BASE = 65535 - 2**12 + 1  # jax._src.clusters.slurm_cluster: job id mod 4096 into the top ephemeral range

# The per-task wrapper: a fixed text (no user value), run by srun as `bash -c WRAPPER maxshard-task TRAINER...`.
# slurmstepd signals every process of the step, the trainer among them; the wrapper only remembers that a signal came
# (and passes it on, in case only it was signalled: a second SIGTERM changes nothing for the trainer).
TASK_WRAPPER = """\
export JAX_PROCESS_ID="$SLURM_PROCID"
signalled=0
child=
trap 'signalled=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM
"$@" &
child=$!
while :; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || break; done
if [ "$signalled" = 1 ]; then exit {preempted}; fi
exit "$rc"
""".format(preempted=PREEMPTED_EXIT)


@dataclasses.dataclass(frozen=True)
class Resources:
    """What the job asks SLURM for."""

    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    partition: str = ""
    time: str = ""  # SLURM's formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
    account: str = ""
    signal_lead_s: int = DEFAULT_SIGNAL_LEAD_S


@dataclasses.dataclass(frozen=True)
class Job:
    """One sbatch script: one trainer argv, or one per array index (a sweep)."""

    name: str
    resources: Resources
    trainers: tuple[tuple[str, ...], ...]  # full command lines (program + config + key=value ...)
    log_dir: str
    workdir: str
    env: tuple[tuple[str, str], ...] = ()

    @property
    def is_array(self) -> bool:
        return len(self.trainers) > 1


# --------------------------------------------------------------------------------------------- checks


def check_directive_value(flag: str, value: str) -> str:
    """A value sbatch reads from an `#SBATCH` line: only characters that need no quoting there."""
    if not _DIRECTIVE_RE.fullmatch(value):
        raise ConfigError(f"{flag} {value!r} cannot go on an #SBATCH line: use only {_DIRECTIVE_CHARS}")
    return value


def parse_time(value: str) -> int:
    """SLURM's time limit formats -> seconds; ConfigError for anything else."""
    match = _TIME_RE.fullmatch(value)
    if not match:
        raise ConfigError(f"--time {value!r}: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS")
    days, a, b, c = match.groups()
    parts = [int(p) for p in (a, b, c) if p is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:  # MM
        return parts[0] * 60
    if len(parts) == 2:  # MM:SS
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]  # HH:MM:SS


def check_resources(res: Resources) -> Resources:
    """Counts >= 1 (GPUs >= 0, a whole number per task), directive-safe names, a signal that comes before the limit."""
    for flag, count, least in (("--nodes", res.nodes, 1), ("--tasks-per-node", res.tasks_per_node, 1),
                               ("--gpus-per-node", res.gpus_per_node, 0), ("--signal-lead", res.signal_lead_s, 1)):
        if count < least:
            raise ConfigError(f"{flag} must be >= {least}, got {count}")
    if res.gpus_per_node and res.gpus_per_node % res.tasks_per_node:
        raise ConfigError(f"--gpus-per-node {res.gpus_per_node} does not split into --tasks-per-node "
                          f"{res.tasks_per_node} equal shares")
    for flag, value in (("--partition", res.partition), ("--account", res.account), ("--time", res.time)):
        if value:
            check_directive_value(flag, value)
    if res.time and parse_time(res.time) <= res.signal_lead_s:
        raise ConfigError(f"--signal-lead {res.signal_lead_s}s must be shorter than --time {res.time}")
    return res


def check_env(pairs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`--env NAME=VALUE` items: a shell variable name; the value is free (it is quoted)."""
    out = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME_RE.fullmatch(name):
            raise ConfigError(f"--env {pair!r}: use NAME=VALUE, NAME made of letters, digits and _")
        out.append((name, value))
    return tuple(out)


# --------------------------------------------------------------------------------------------- trainer config


def prepare_trainer_argv(user_argv: Sequence[str], nodes: int, job_name: str) -> tuple[tuple[str, ...], Config]:
    """The user's trainer argv plus `num_slices` = nodes (a GPU node is a slice, as on XPK) unless given, and
    `run_name` = the job name unless given (so every requeue resumes the same run); and the parsed config."""
    if not user_argv:
        raise ConfigError("give the trainer's config: python -m maxshard.launch slurm CONFIG.yml key=value ...")
    cfg = config.parse(user_argv)
    given = set(cfg.explicit_keys)
    extra = []
    if nodes > 1 and "num_slices" not in given and cfg.num_slices == 1:
        extra.append(f"num_slices={nodes}")
    if "run_name" not in given and cfg.run_name == Config.run_name:
        extra.append(f"run_name={job_name}")
    argv = (*user_argv, *extra)
    return argv, config.resolve_paths(config.parse(argv))


def default_log_dir(cfg: Config) -> str:
    """The run directory; a remote one (gs://...) cannot hold SLURM's output files, so --log-dir is needed then."""
    run_dir = os.path.join(cfg.base_output_directory, cfg.run_name)
    if "://" in run_dir:
        raise ConfigError(f"the run directory {run_dir} is not a file system path SLURM can write its output to; "
                          "give --log-dir")
    return run_dir


# --------------------------------------------------------------------------------------------- the script


def _log_stem(job: Job) -> tuple[str, str]:
    """The output files' name as an sbatch pattern and as the shell sees it inside the job."""
    if job.is_array:
        return "slurm-%A_%a", "slurm-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
    return "slurm-%j", "slurm-${SLURM_JOB_ID}"


def directives(job: Job) -> list[str]:
    """The `#SBATCH` lines; every value was checked by check_directive_value."""
    res = job.resources
    log_dir = check_directive_value("--log-dir", job.log_dir.rstrip("/") or "/")
    pattern, _ = _log_stem(job)
    lines = [f"--job-name={check_directive_value('--job-name', job.name)}", f"--nodes={res.nodes}",
             f"--ntasks-per-node={res.tasks_per_node}"]
    if res.gpus_per_node and res.tasks_per_node > 1:
        lines.append(f"--gpus-per-task={res.gpus_per_node // res.tasks_per_node}")
    elif res.gpus_per_node:
        lines.append(f"--gpus-per-node={res.gpus_per_node}")
    lines += [f"--{flag}={value}" for flag, value in (("partition", res.partition), ("time", res.time),
                                                       ("account", res.account)) if value]
    if job.is_array:
        lines.append(f"--array=0-{len(job.trainers) - 1}")
    lines += [f"--output={log_dir}/{pattern}.out", f"--error={log_dir}/{pattern}.err", "--open-mode=append",
              f"--signal=TERM@{res.signal_lead_s}", "--requeue"]
    return [f"#SBATCH {line}" for line in lines]


def trainer_lines(job: Job) -> list[str]:
    """`trainer=(...)`: the one command line, or a `case` on the array index."""
    if not job.is_array:
        return [f"trainer=({shlex.join(job.trainers[0])})"]
    lines = ['case "${SLURM_ARRAY_TASK_ID:-}" in']
    lines += [f"  {i}) trainer=({shlex.join(argv)}) ;;" for i, argv in enumerate(job.trainers)]
    lines += ['  *) echo "maxshard: error: no command line for array index ${SLURM_ARRAY_TASK_ID:-unset}" >&2; '
              "exit 2 ;;", "esac"]
    return lines


def render(job: Job) -> str:
    """The whole sbatch script."""
    log_dir = shlex.quote(job.log_dir)
    _, stem = _log_stem(job)
    env = [f"export {name}={shlex.quote(value)}" for name, value in (("PYTHONUNBUFFERED", "1"), *job.env)]
    body = [
        "#!/bin/bash",
        *directives(job),
        "# Written by `python -m maxshard.launch slurm` (maxshard/launch/slurm.py says what each part is for).",
        "set -u",
        f"cd {shlex.quote(job.workdir)} || exit 1",
        *env,
        *trainer_lines(job),
        'first_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'export JAX_COORDINATOR_ADDRESS="$first_host:$(( SLURM_JOB_ID % 4096 + {_JAX_PORT_BASE} ))"',
        'export JAX_PROCESS_COUNT="$SLURM_NTASKS"',
        f"srun bash -c {shlex.quote(TASK_WRAPPER)} maxshard-task \"${{trainer[@]}}\"",
        "rc=$?",
        f'if [ "$rc" -eq {PREEMPTED_EXIT} ]; then',
        '  echo "maxshard: stopped for a signal after saving; requeueing job $SLURM_JOB_ID '
        '(restart ${SLURM_RESTART_COUNT:-0})" >&2',
        '  scontrol requeue "$SLURM_JOB_ID" && exit 0',
        '  echo "maxshard: error: scontrol requeue failed; submit the script again to resume" >&2',
        "fi",
        f'printf "%s\\n" "$rc" > {log_dir}/"{stem}.exit"',
        'exit "$rc"',
    ]
    return "\n".join(body) + "\n"


def write_script(job: Job, path: str) -> str:
    """Writes the script (and the log directory sbatch needs to exist); returns the path. Nothing is created for a
    job that does not render."""
    text = render(job)
    os.makedirs(job.log_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def sbatch_argv(script: str, *extra: str) -> list[str]:
    """`sbatch --parsable [extra...] SCRIPT`: prints `JOBID` or `JOBID;CLUSTER`."""
    return ["sbatch", "--parsable", *extra, script]


def job_id_of(sbatch_stdout: str) -> str:
    """The job id from `sbatch --parsable` output."""
    text = sbatch_stdout.strip().splitlines()
    job = text[-1].split(";")[0].strip() if text else ""
    if not job.isdigit():
        raise ConfigError(f"sbatch printed no job id: {sbatch_stdout.strip()!r}")
    return job


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m maxshard.launch slurm",
        description="Check a maxshard config and write (or submit) an sbatch script that trains it, requeueing "
                    "itself when preempted.",
    )
    parser.add_argument("trainer", nargs="*", metavar="CONFIG key=value", help="the trainer's argv")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1); num_slices defaults to it")
    parser.add_argument("--tasks-per-node", type=int, default=1,
                        help="processes per node (default 1: one per node; = --gpus-per-node: one per GPU)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0: none asked)")
    parser.add_argument("--partition", default="", help="SLURM partition")
    parser.add_argument("--time", default="", help="time limit, e.g. 4:00:00 or 2-00:00:00")
    parser.add_argument("--account", default="", help="SLURM account")
    parser.add_argument("--signal-lead", type=int, default=DEFAULT_SIGNAL_LEAD_S,
                        help=f"seconds before the time limit SLURM sends SIGTERM (default {DEFAULT_SIGNAL_LEAD_S})")
    parser.add_argument("--job-name", help="job name (default: the run name + timestamp + random suffix)")
    parser.add_argument("--log-dir", help="where SLURM's output files go (default: the run directory)")
    parser.add_argument("--script", help="where the script is written (default: LOG_DIR/JOB_NAME.sbatch)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="exported for the run")
    parser.add_argument("--python", default=sys.executable, help="the interpreter on the nodes (default: this one)")
    parser.add_argument("--submit", action="store_true", help="run sbatch and print the job id")
    return parser


def make_job(args: argparse.Namespace, suffix: str | None = None) -> Job:
    """Checks every flag and the trainer config; raises ConfigError with one line."""
    resources = check_resources(Resources(args.nodes, args.tasks_per_node, args.gpus_per_node, args.partition,
                                          args.time, args.account, args.signal_lead))
    env = check_env(args.env)
    if args.job_name is not None:
        name = check_directive_value("--job-name", args.job_name)
    else:
        name = xpk.make_workload_name(config.parse(args.trainer).run_name if args.trainer else "",
                                      suffix or xpk.default_suffix())
    argv, cfg = prepare_trainer_argv(args.trainer, resources.nodes, name)
    if args.log_dir:
        log_dir = check_directive_value("--log-dir", os.path.abspath(args.log_dir))
    else:
        log_dir = check_directive_value("the run directory (give --log-dir for SLURM's files)", default_log_dir(cfg))
    program = (args.python, "-m", "maxshard.train")
    return Job(name, resources, ((*program, *argv),), log_dir, os.getcwd(), env)


def main(
    argv: Sequence[str], *, suffix: str | None = None, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
) -> int:
    """Writes the script and says where; with --submit runs sbatch and prints the job id. Exit 2 for every user
    mistake, with one line."""
    try:
        args = build_parser().parse_intermixed_args(argv)
        job = make_job(args, suffix)
        script = write_script(job, args.script or os.path.join(job.log_dir, f"{job.name}.sbatch"))
    except ConfigError as e:
        print(f"maxshard: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse printed usage and its message
        return e.code if isinstance(e.code, int) else 2
    if not args.submit:
        print(f"wrote {script}; submit it with: sbatch {shlex.quote(script)}")
        return 0
    try:
        done = run(sbatch_argv(script), capture_output=True, text=True, check=False)
    except FileNotFoundError:
        print("maxshard: error: sbatch is not on PATH; run this on a SLURM login node, or drop --submit",
              file=sys.stderr)
        return 2
    if done.returncode != 0:
        print(f"maxshard: error: sbatch failed: {done.stderr.strip() or done.stdout.strip()}", file=sys.stderr)
        return 1
    print(job_id_of(done.stdout))
    return 0
