"""Plan a training run for a cluster you do not have: memory, collectives, pipeline bubble and a roofline step time.

    python -m maxshard.plan configs/base.yml model_name=8b --topology v5p-1024 --num-slices 4
    python -m maxshard.plan configs/fsdp_tp.yml model_name=8b --topology h100-80gb-8 --num-slices 16 --json

The config is validated as the launcher validates it for the target (`maxshard.launch.xpk`): the device count,
device kind and host count of `--topology` x `--num-slices` (TPU slices, or GPU nodes), `num_slices` set to match.
Then only `jax.eval_shape` runs: no mesh of that size is built and nothing is compiled, so an 8B model on 2048 chips
plans in seconds on a laptop. The last line is the verdict against one device's usable memory (allocatable HBM less
`memory_headroom`): `fit: yes, <planned> of <usable> (<policy>)`, or `fit: no, <by how much> ...; <what would fit>`
with exit code 1. A configuration mistake prints one line, `plan: error: ...`, and exits 2.
The model behind every number is written out in `maxshard/planning/` (memory.py, traffic.py, estimate.py).

`--search` asks that question for every sensible layout instead (`maxshard/run/search.py`: mesh knobs,
remat_policy, pipeline microbatches; never the model or the global batch), keeps those whose planned peak fits
HBM x (1 - `--headroom`), and prints the `--top` K by planned step time, each with the `key=value` overrides to
append to the same command (keys given on the command line are kept, so none is given twice):

    python -m maxshard.plan configs/base.yml model_name=8b --search --topology h100-80gb-8
    python -m maxshard.plan configs/base.yml model_name=8b --search --topology v5p-256 --json
    python -m maxshard.plan configs/base.yml model_name=8b --search --topology h100-80gb-8 --num-slices 2 \
        --sweep-out plan_8b.yml      # then: python benchmarks/sweep.py plan_8b.yml --xpk ...

It exits 0 when some layout fits, 1 when none does (one line: the closest layout and by how much it misses), and 2
for a mistake. A progress line goes to stderr every 100 candidates.

`--compile` also compiles the run's fresh-run init and train step for the target ahead of time, on this machine,
with no accelerator: XLA:TPU through libtpu for a TPU slice (`pip install -e ".[tpu-aot]"`;
`maxshard/planning/tpu_compile.py`), XLA:GPU through JAX's CUDA plugin for a GPU node (`pip install -e
".[gpu-aot]"`; `maxshard/planning/gpu_compile.py`). It prints each program's compiled peak per device beside the
plan, then a verdict against the usable memory (HBM less memory_headroom, what the trainer checks the compiled step
against on the target). It exits 1 when the step's compiled peak is over that, or when XLA:TPU finds a program over
the chip (one line, XLA's own figures). Compile times are in benchmarks/README.md.

    python -m maxshard.plan configs/base.yml model_name=8b per_device_batch_size=4 --topology v6e-256 --compile
    python -m maxshard.plan configs/base.yml model_name=1b max_target_length=8192 --topology h200-141gb-8 --compile
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # planning needs no accelerator (and an installed libtpu is not one)

from maxshard.errors import ConfigError
from maxshard.launch import topologies
from maxshard.planning import fit
from maxshard.planning.estimate import Plan, make_plan
from maxshard.planning.printout import format_plan, plan_json
from maxshard.planning import gpu_compile, tpu_compile
from maxshard.planning.tpu_compile import TpuOutOfMemory, compile_run
from maxshard.run import search
from maxshard.run.search_printout import format_search, nothing_fits, search_json, sweep_yaml
from maxshard.run.target import load_for_target, target_capacity
from maxshard.units import format_bytes

__all__ = ["load_for_target", "plan_for", "main"]

PROG = "plan"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # sweep files name configs relative to it


def plan_for(config_argv: Sequence[str], topology: str, num_slices: int = 1) -> Plan:
    """The plan of a config on `num_slices` x `topology`; ConfigError (one line) for any mistake."""
    target = topologies.parse(topology, num_slices)
    return make_plan(load_for_target(config_argv, target), target)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a YAML config, e.g. configs/base.yml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for maxshard.train")
    parser.add_argument("--topology", required=True, help="XPK device type: v5p-1024, v6e-256, h100-80gb-8, ...")
    parser.add_argument("--num-slices", type=int, default=1, help="TPU slices or GPU nodes (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    parser.add_argument("--compile", action="store_true", help="also compile init and train step for the target "
                        "(XLA:TPU with libtpu, XLA:GPU with JAX's CUDA plugin; ahead of time, no accelerator needed) "
                        "and print their compiled peaks")
    found = parser.add_argument_group("layout search")
    found.add_argument("--search", action="store_true", help="rank every layout that fits by planned step time")
    found.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    found.add_argument("--headroom", type=float, default=search.DEFAULT_HEADROOM,
                       help="fraction of device memory a layout must leave free (default 0.1)")
    found.add_argument("--max-candidates", type=int, default=search.MAX_CANDIDATES,
                       help=f"refuse larger searches (default {search.MAX_CANDIDATES}); pin keys to narrow one")
    found.add_argument("--sweep-out", metavar="FILE.yml", help="also write the top layouts as a sweep file for "
                       "benchmarks/sweep.py")
    return parser


def _base_config(path: str) -> str:
    """The config path as a sweep file wants it: relative to the repository root when inside it."""
    full = os.path.abspath(path)
    inside = os.path.commonpath([full, REPO]) == REPO
    return os.path.relpath(full, REPO) if inside else full


def _search(args: argparse.Namespace, raw_argv: Sequence[str]) -> int:
    """0 when some layout fits, 1 when none does (one line), ConfigError for a mistake."""
    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    argv = [args.config, *args.overrides]
    target = topologies.parse(args.topology, args.num_slices)
    result = search.search(argv, target, args.headroom, args.max_candidates,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.sweep_out and result.fitting:
        command = shlex.join(["python", "-m", "maxshard.plan", *raw_argv])
        with open(args.sweep_out, "w", encoding="utf-8") as f:
            f.write(sweep_yaml(result, _base_config(args.config), args.overrides, args.top, command))
    if args.json:
        print(json.dumps(search_json(result, args.top)))
    elif not result.fitting:
        print(nothing_fits(result))
    else:
        print(format_search(result, argv, args.top))
    return 0 if result.fitting else 1


def main(argv: Sequence[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_intermixed_args(raw_argv)
    try:
        if args.sweep_out and not args.search:
            raise ConfigError("--sweep-out writes the layouts of --search; add --search")
        if args.compile and args.search:
            raise ConfigError("--compile compiles one layout; run it on a layout --search printed")
        if args.search:
            return _search(args, raw_argv)
        plan = plan_for([args.config, *args.overrides], args.topology, args.num_slices)
        if args.compile:
            return _compiled(plan, args.json)
    except (ConfigError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return _verdict(plan, args.json)


def _verdict(plan: Plan, as_json: bool) -> int:
    """The plan and its one verdict line against the target's usable memory: 0 when it fits, 1 when not."""
    fits, line = fit.verdict(plan.cfg, target_capacity(plan.cfg, plan.target))
    print(json.dumps({**plan_json(plan), "fit": {"fits": fits, "line": line}}) if as_json else
          f"{format_plan(plan)}\n{line}")
    return 0 if fits else 1


def _compiled(plan: Plan, as_json: bool) -> int:
    """The plan, then the target compiler's peaks beside it and a verdict: 0 when the train step's compiled peak fits
    the usable memory (the trainer's own check on the target, `maxshard/run/compile_check.py`), 1 when it does not or
    when XLA:TPU finds a program over the chip (one line with XLA's own figures)."""
    devices, compiler, xla = _compile_only_devices(plan)  # no compiler installed: one line before anything printed
    if not as_json:
        print(format_plan(plan), flush=True)
    try:
        run = compile_run(plan.cfg, plan.target, devices,
                          progress=lambda line: print(line, file=sys.stderr, flush=True), compiler=compiler)
    except TpuOutOfMemory as e:
        print(json.dumps({**plan_json(plan), "compiled": {"fits": False, "error": str(e)}}) if as_json else
              f"compiled: no, {e}")
        return 1
    except Exception as e:
        reason = gpu_compile.why_not_compiled(e) if plan.target.accelerator == "gpu" else None
        if reason is None:
            raise
        raise ConfigError(f"cannot compile attention={plan.cfg.model.attention} for {plan.target.name} here: "
                          f"{reason}") from None
    usable, source = _usable(plan)
    fits = run.step_peak <= usable
    if as_json:
        print(json.dumps({**plan_json(plan), "compiled": {"fits": fits, "usable_bytes": usable, **vars(run)}}))
        return 0 if fits else 1
    host = (f"; host memory {format_bytes(run.step_host)} per device, planned {format_bytes(plan.host_bytes)}"
            if run.step_host or plan.host_bytes else "")
    print(f"compiled with {xla} for {plan.target.name}: init peak {format_bytes(run.init_peak)} per device "
          f"({run.init_seconds:.0f}s), train step peak {format_bytes(run.step_peak)} per device "
          f"({run.step_seconds:.0f}s); planned {format_bytes(plan.peak_bytes)}, "
          f"{run.step_peak / plan.peak_bytes:.2f}x the plan{host}")
    verdict = "yes, fits" if fits else "no, does NOT fit"
    refused = "" if fits else f"; the trainer's compile check would not run remat_policy={plan.cfg.remat_policy}"
    print(f"compiled: {verdict} the {format_bytes(usable)} usable ({source}): the train step needs "
          f"{run.step_peak / plan.link.hbm:.0%} of {format_bytes(plan.link.hbm)} HBM{refused}")
    return 0 if fits else 1


def _compile_only_devices(plan: Plan) -> tuple[list, str, str]:
    """(the target's compile-only devices, what compiles for them, the XLA backend): libtpu's for a TPU slice, JAX's
    CUDA plugin's for a GPU node."""
    if plan.target.accelerator == "gpu":
        return gpu_compile.abstract_devices(plan.target), "JAX's CUDA plugin", "XLA:GPU"
    return tpu_compile.abstract_devices(plan.target), "libtpu", "XLA:TPU"


def _usable(plan: Plan) -> tuple[int, str]:
    """(bytes, where they come from) of the memory the trainer lets a compiled step use on the target: HBM less
    `memory_headroom`, as `maxshard/run/compile_check.py` checks it before the first step."""
    memory_fit = plan.cfg.memory_fit
    if memory_fit is None:
        return plan.link.hbm, f"{plan.target.name} HBM"
    return memory_fit.usable_bytes, f"{memory_fit.capacity_source}, memory_headroom={plan.cfg.memory_headroom:g}"


if __name__ == "__main__":
    sys.exit(main())
