"""Plan a training run for a cluster you do not have: does it fit, and memory, collectives, pipeline bubble and a
roofline step time.

    python -m maxshard.plan configs/base.yml model_name=8b per_device_batch_size=4 --topology v6e-256
    python -m maxshard.plan configs/base.yml model_name=1b max_target_length=8192 --topology h200-141gb-8
    python -m maxshard.plan configs/base.yml model_name=8b --topology v5p-1024 --num-slices 4 --estimate
    python -m maxshard.plan configs/base.yml --topology cpu-8      # this machine, as cpu_device_count=8 runs

The config is validated as the launcher validates it for the target (`maxshard.launch.xpk`): the device count,
device kind and host count of `--topology` x `--num-slices` (TPU slices, or GPU nodes), `num_slices` set to match.
The formula plan comes first, from `jax.eval_shape` alone (`maxshard/planning/`: estimate.py, memory.py,
traffic.py): per-device memory, the collectives of a step per mesh axis, the bubble, the roofline and its MFU bound.

The answer to "does it fit" is the compiler's wherever the target's compiler is installed on this machine: the
run's fresh-run init and train step are compiled ahead of time for the target, with no accelerator, XLA:TPU through
libtpu for a TPU slice (`pip install -e ".[tpu-aot]"`; `maxshard/planning/tpu_compile.py`), XLA:GPU through JAX's
CUDA plugin for a GPU node (`pip install -e ".[gpu-aot]"`; `maxshard/planning/gpu_compile.py`), XLA:CPU (always
installed) for `cpu-N`, N simulated CPU devices of this machine (`maxshard/planning/cpu_compile.py`). It prints
the train step's peak per device (`planning/compiled.peak_bytes`, the one definition the trainer's compile check
uses) split into parameters, optimizer state, batch (their shards' exact bytes), XLA's temporaries and the rest,
against the usable memory (HBM, or on cpu-N a device's share of the host's available memory, less
`memory_headroom`: what the trainer checks the compiled step against on the target); the
last line is the verdict, `compiled: yes, fits ...` or `compiled: no, ...` with exit code 1, also when XLA:TPU
finds a program over the chip (one line, XLA's own figures). This takes the compile's time (minutes for a large
model: benchmarks/README.md); `--estimate` gives the formula's answer in seconds. Under `remat_policy: auto` the
compile also picks the policy: the estimate ranks them and prunes those it plans beyond its stated error over the
usable memory, and the others are compiled in auto's order until one fits (`run/auto_compile.py`; a line for
each that did not).

Where no compiler for the target is installed (or `--estimate` asks), the line before the last says the plan is an
estimate, how close the formulas are checked to be (`fit.PLAN_ERROR`), and the one command that gives the exact
answer; the last line is the formula verdict against the same usable memory: `fit: yes, <planned> of <usable>
(<policy>)`, or `fit: no, <by how much> ...; <what would fit>` with exit code 1. `--compile` insists on the compile:
without the target's compiler it is one error line. A configuration mistake prints one line, `plan: error: ...`, and
exits 2. `--json` prints one object: the plan, `answer` ("compiled" or "estimate") and the verdict's figures;
under `remat_policy: auto`, `compiled.auto` is the trail of the compiles that decided (each policy in order, its
peak and whether it fit; the estimate's choice and the compile's).

`--search` asks that question for every sensible layout instead (`maxshard/run/search.py`: mesh knobs,
remat_policy, pipeline microbatches; never the model or the global batch), by the formulas: it keeps those whose
planned peak fits HBM x (1 - `--headroom`), and prints the `--top` K by planned step time, each with the `key=value`
overrides to append to the same command (keys given on the command line are kept, so none is given twice).
`--search --compile` then compiles the train step of each of those K layouts for the target (the target's compiler
must be installed): a layout whose compiled peak does not fit leaves the ranking, the others keep their order, and a
line for each says what it compiled to:

    python -m maxshard.plan configs/base.yml model_name=8b --search --topology h100-80gb-8
    python -m maxshard.plan configs/base.yml model_name=8b --search --topology v5p-256 --json
    python -m maxshard.plan configs/base.yml model_name=8b --search --topology v6e-256 --top 3 --compile
    python -m maxshard.plan configs/base.yml model_name=8b --search --topology h100-80gb-8 --num-slices 2 \
        --sweep-out plan_8b.yml      # then: python benchmarks/sweep.py plan_8b.yml --xpk ...

It exits 0 when some layout fits, 1 when none does (one line: the closest layout and by how much it misses, by its
compiled peak under --compile), and 2 for a mistake. A progress line goes to stderr every 100 candidates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # planning needs no accelerator (and an installed libtpu is not one)

from maxshard.errors import ConfigError
from maxshard.launch import topologies
from maxshard.planning import fit
from maxshard.planning.estimate import Plan, make_plan
from maxshard.planning.printout import estimate_notice, format_compiled, format_plan, plan_json
from maxshard.planning import cpu_compile, gpu_compile, tpu_compile
from maxshard.run import auto_compile
from maxshard.planning.tpu_compile import CompiledRun, TpuOutOfMemory, compile_run, compile_step
from maxshard.run import search
from maxshard.run.search_printout import format_search, nothing_fits, search_json, sweep_yaml
from maxshard.run.target import load_for_target, target_capacity
from maxshard.units import format_bytes

__all__ = ["load_for_target", "plan_for", "main"]

PROG = "plan"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # sweep files name configs relative to it


def plan_for(config_argv: Sequence[str], topology: str, num_slices: int = 1) -> Plan:
    """The plan of a config on `num_slices` x `topology`; ConfigError (one line) for any mistake. A cpu-N target's
    devices are made first, before the plan starts JAX's backend (`planning/cpu_compile.py`)."""
    target = topologies.parse(topology, num_slices, cpu=True)
    if target.accelerator == "cpu":
        cpu_compile.abstract_devices(target)
    return make_plan(load_for_target(config_argv, target), target)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a YAML config, e.g. configs/base.yml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for maxshard.train")
    parser.add_argument("--topology", required=True, help="XPK device type: v5p-1024, v6e-256, h100-80gb-8, ...; "
                        "or cpu-N, N simulated CPU devices here")
    parser.add_argument("--num-slices", type=int, default=1, help="TPU slices or GPU nodes (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    parser.add_argument("--compile", action="store_true", help="compile init and train step for the target, or "
                        "fail (exit 2) where its compiler is not installed (the default compiles wherever it is: "
                        "XLA:TPU with libtpu, XLA:GPU with JAX's CUDA plugin; ahead of time, no accelerator needed)")
    parser.add_argument("--estimate", action="store_true", help="the formula plan only, compiling nothing (seconds)")
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
    """0 when some layout fits, 1 when none does (one line), ConfigError for a mistake. With --compile the `--top`
    layouts the formulas rank best are compiled for the target: those whose compiled train step does not fit the
    search's capacity leave the ranking (the others keep the formulas' order, ahead of the layouts not compiled),
    and 0 needs one that does."""
    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    argv = [args.config, *args.overrides]
    target = topologies.parse(args.topology, args.num_slices, cpu=True)
    if target.accelerator == "cpu":
        raise ConfigError(f"--search ranks layouts by their roofline step time, and {target.name} has no peak "
                          "FLOP/s or link figures to price one; plan each layout without --search")
    compiler = _compiler(target, asked=True) if args.compile else None  # no compiler: one line before the search
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    result = search.search(argv, target, args.headroom, args.max_candidates, progress=progress)
    checked: list[_Checked] = []
    untried = max(len(result.fitting) - args.top, 0)  # layouts the formulas say fit, past the compiled ones
    if compiler is not None and result.fitting:
        checked = [_check(c, result, compiler, progress) for c in result.fitting[:args.top]]
        confirmed = [k.candidate for k in checked if k.fits]
        result = dataclasses.replace(result, fitting=confirmed and confirmed + result.fitting[args.top:])
    if args.sweep_out and result.fitting:
        command = shlex.join(["python", "-m", "maxshard.plan", *raw_argv])
        with open(args.sweep_out, "w", encoding="utf-8") as f:
            f.write(sweep_yaml(result, _base_config(args.config), args.overrides, args.top, command))
    if args.json:
        print(json.dumps({**search_json(result, args.top),
                          **({"compiled": [k.as_json() for k in checked]} if compiler is not None else {})}))
    elif checked and not result.fitting:
        print(_none_compiles(checked, result.capacity, untried))
    elif not result.fitting:
        print(nothing_fits(result))
    else:
        print(format_search(result, argv, args.top))
        if checked:
            print("\n".join([f"compiled with {compiler.xla}, the {len(checked)} best by planned step time (a layout "
                              f"whose train step does not fit {format_bytes(result.capacity)} left the ranking):",
                              *(k.line() for k in checked)]))
    return 0 if result.fitting else 1


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A layout of the search with its compiled train step's peak (None: XLA:TPU found it over the chip)."""

    candidate: search.Candidate
    peak: int | None
    capacity: float
    error: str = ""

    @property
    def fits(self) -> bool:
        return self.peak is not None and self.peak <= self.capacity

    def line(self) -> str:
        c = self.candidate
        compiled = self.error if self.peak is None else (
            f"train step {format_bytes(self.peak)} per device (planned {format_bytes(c.peak)}), "
            f"{'fits' if self.fits else 'does NOT fit'}")
        return f"  {c.layout.label}: {compiled}"

    def as_json(self) -> dict:
        return {"layout": self.candidate.layout.label, "overrides": list(self.candidate.overrides),
                "planned_peak": self.candidate.peak, "step_peak": self.peak, "fits": self.fits,
                "error": self.error or None}


def _check(c: search.Candidate, result: search.SearchResult, compiler: _Compiler,
           progress: Callable[[str], None]) -> _Checked:
    """`c`'s train step compiled for the search's target (no init: the step is what must fit)."""
    try:
        step, _ = compile_step(c.plan.cfg, result.target, compiler.devices, progress, compiler.name)
    except TpuOutOfMemory as e:
        return _Checked(c, None, result.capacity, str(e))
    except Exception as e:
        reason = gpu_compile.why_not_compiled(e) if result.target.accelerator == "gpu" else None
        if reason is None:
            raise
        raise ConfigError(f"cannot compile {c.layout.label} for {result.target.name} here: {reason}") from None
    return _Checked(c, step.peak, result.capacity)


def _none_compiles(checked: list[_Checked], capacity: float, untried: int) -> str:
    """One line: none of the layouts compiled fits, the closest by its compiled peak, and how to compile more of the
    ranking where the formulas put `untried` more layouts within the capacity."""
    best = min((k for k in checked if k.peak is not None), key=lambda k: k.peak, default=None)
    more = f"; {untried} more layouts plan within it: --top {2 * len(checked)} compiles more of them" if untried else ""
    if best is None:
        return f"plan: none of the {len(checked)} best layouts compiles within the chip: {checked[0].error}{more}"
    pasted = " ".join(best.candidate.overrides) or "the config as given"
    return (f"plan: none of the {len(checked)} best layouts compiles within {format_bytes(capacity)} per device; the "
            f"closest, {best.candidate.layout.label} ({pasted}), compiles to {format_bytes(best.peak)}: "
            f"{format_bytes(best.peak - capacity)} over{more}")


def main(argv: Sequence[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_intermixed_args(raw_argv)
    try:
        if args.sweep_out and not args.search:
            raise ConfigError("--sweep-out writes the layouts of --search; add --search")
        if args.compile and args.estimate:
            raise ConfigError("--compile and --estimate ask for opposite answers; give one")
        if args.search:
            return _search(args, raw_argv)
        plan = plan_for([args.config, *args.overrides], args.topology, args.num_slices)
        if args.estimate:
            return _estimate(plan, args.json)
        compiler = _compiler(plan.target, asked=args.compile)
        if isinstance(compiler, _NoCompiler):
            return _verdict(plan, args.json, compiler.reason, compiler.command, compiler.exact)
        return _compiled(plan, args.json, compiler, asked=args.compile)
    except (ConfigError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


@dataclasses.dataclass(frozen=True)
class _Compiler:
    """What compiles for the target here: its compile-only devices, who builds them, the XLA backend."""

    devices: list
    name: str  # "libtpu", "JAX's CUDA plugin"
    xla: str  # "XLA:TPU", "XLA:GPU"


@dataclasses.dataclass(frozen=True)
class _NoCompiler:
    """Why nothing compiles for the target here, and the one command that would let it (None: none would)."""

    reason: str
    command: str | None
    exact: str | None  # for a person: what gives the compiler's answer (None: the reason says it)


# what compiles for each accelerator, and its names for a person: (module, who builds the devices, the XLA backend)
_COMPILERS = {"tpu": (tpu_compile, "libtpu", "XLA:TPU"), "gpu": (gpu_compile, "JAX's CUDA plugin", "XLA:GPU"),
              "cpu": (cpu_compile, "jaxlib", "XLA:CPU")}


def _module(target: topologies.Target):  # noqa: ANN202 (a module)
    """The module that compiles for the target's accelerator: planning/{tpu,gpu,cpu}_compile.py."""
    return _COMPILERS[target.accelerator][0]


def _after_install(command: str) -> str:
    return f"{command}, then this command again"


def _compiler(target: topologies.Target, asked: bool) -> _Compiler | _NoCompiler:
    """The target's compiler: libtpu's devices for a TPU slice, JAX's CUDA plugin's for a GPU node. Where it is not
    installed or cannot describe the target: ConfigError (one line) when `--compile` asked for it, else why not."""
    module, name, xla = _COMPILERS[target.accelerator]
    missing = module.missing()
    if missing is not None and not asked:
        return _NoCompiler(f"{missing}, which is not installed here", module.INSTALL, _after_install(module.INSTALL))
    try:
        return _Compiler(module.abstract_devices(target), name, xla)
    except ConfigError as e:
        if asked:
            raise
        return _NoCompiler(str(e), None, None)


def _estimate(plan: Plan, as_json: bool) -> int:
    """The formula's answer, asked for with --estimate: the exact one is this command without it, or after the
    target's compiler is installed."""
    module = _module(plan.target)
    if module.missing() is None:
        return _verdict(plan, as_json, "--estimate", None, "this command without --estimate")
    return _verdict(plan, as_json, "--estimate", module.INSTALL, _after_install(module.INSTALL))


def _verdict(plan: Plan, as_json: bool, reason: str, command: str | None, exact: str | None,
             printed: bool = False) -> int:
    """The plan, the line that says it is an estimate, why, and what gives the exact answer (`command`: an install
    line, or None), and its one verdict line against the target's usable memory (last): 0 when it fits, 1 when not.
    `printed`: the plan's text is already out."""
    fits, line = fit.verdict(plan.cfg, target_capacity(plan.cfg, plan.target))
    if as_json:
        estimate = {"reason": reason, "exact": command, "error_bound": fit.PLAN_ERROR}
        print(json.dumps({**plan_json(plan), "answer": "estimate", "estimate": estimate,
                          "fit": {"fits": fits, "line": line}}))
    else:
        notice = estimate_notice(reason, exact, fit.PLAN_ERROR)
        print(f"{notice}\n{line}" if printed else f"{format_plan(plan)}\n{notice}\n{line}")
    return 0 if fits else 1


def _compiled(plan: Plan, as_json: bool, compiler: _Compiler, asked: bool) -> int:
    """The plan, then the target compiler's peaks beside it, the train step's peak split, and a verdict: 0 when the
    train step's compiled peak fits the usable memory (the trainer's own check on the target,
    `maxshard/run/compile_check.py`), 1 when it does not or when XLA:TPU finds a program over the chip (one line with
    XLA's own figures). A compile that cannot be done here (`gpu_compile.why_not_compiled`) is one line (exit 2)
    when `--compile` asked for it, else the estimate's verdict with the reason."""
    if not as_json:
        print(format_plan(plan), flush=True)
    try:
        plan, run, trail = _compile_deciding(plan, compiler, as_json)
    except TpuOutOfMemory as e:
        print(json.dumps({**plan_json(plan), "answer": "compiled", "compiled": {"fits": False, "error": str(e)}})
              if as_json else f"compiled: no, {e}")
        return 1
    except Exception as e:
        reason = gpu_compile.why_not_compiled(e) if plan.target.accelerator == "gpu" else None
        if reason is None:
            raise
        why = f"cannot compile attention={plan.cfg.model.attention} for {plan.target.name} here: {reason}"
        if asked:
            raise ConfigError(why) from None
        return _verdict(plan, as_json, why, None, None, printed=not as_json)
    usable, source = _usable(plan)
    fits = run.step_peak <= usable
    if as_json:
        auto = {} if trail is None else {"auto": trail}
        print(json.dumps({**plan_json(plan), "answer": "compiled",
                          "compiled": {"fits": fits, "usable_bytes": usable, **run.as_json(), **auto}}))
        return 0 if fits else 1
    print("\n".join(format_compiled(plan, run, compiler.xla, usable, source)))
    verdict = "yes, fits" if fits else "no, does NOT fit"
    refused = "" if fits else f"; the trainer's compile check would not run remat_policy={plan.cfg.remat_policy}"
    memory, which = _device_memory(plan)
    print(f"compiled: {verdict} the {format_bytes(usable)} usable ({source}): the train step needs "
          f"{run.step_peak / memory:.0%} of {format_bytes(memory)} {which}{refused}")
    return 0 if fits else 1


def _compile_deciding(plan: Plan, compiler: _Compiler,
                      as_json: bool) -> tuple[Plan, CompiledRun, dict | None]:
    """(the plan of the policy the compile decides on, its compiled run, auto's trail). `remat_policy: auto`
    compiles the policies the estimate does not rule out in auto's order and takes the first that fits
    (run/auto_compile.py), a line for each that did not; the trail (for --json, None without auto) holds the
    estimate's choice, the compile's (None: none fits) and each policy compiled in order with its train step's peak
    (None and XLA's line where it is over the chip). Another policy, or none left to compile, is compiled as
    planned. TpuOutOfMemory where the last compiled is over the chip."""
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    fit_record, (usable, _) = plan.cfg.memory_fit, _usable(plan)
    if fit_record is None or fit_record.requested != "auto":
        return plan, compile_run(plan.cfg, plan.target, compiler.devices, progress=progress,
                                 compiler=compiler.name), None
    outcomes: dict[str, CompiledRun | TpuOutOfMemory] = {}

    def compile_peak(policy: str) -> int | None:
        try:
            outcomes[policy] = compile_run(auto_compile.with_policy(plan.cfg, policy), plan.target, compiler.devices,
                                           progress=progress, compiler=compiler.name)
        except TpuOutOfMemory as e:
            outcomes[policy] = e
            return None
        return outcomes[policy].step_peak

    chosen, tried = auto_compile.choose(plan.cfg, usable, compile_peak)
    trail = {"estimate_chose": plan.cfg.remat_policy, "chose": chosen,
             "compiled": [{"policy": t.policy, "step_peak": t.peak, "fits": t.fits(usable),
                           "error": str(outcomes[t.policy]) if t.peak is None else None} for t in tried]}
    for t in tried[:-1] if chosen is not None else tried:
        over = (f"over the chip ({outcomes[t.policy]})" if t.peak is None else
                f"{format_bytes(t.peak)} per device, over the {format_bytes(usable)} usable")
        if not as_json:
            print(f"remat_policy={t.policy} compiles to {over}")
    if chosen is None:  # nothing fits: the estimate's own pick is the answer to show
        last = outcomes.get(plan.cfg.remat_policy) or compile_run(plan.cfg, plan.target, compiler.devices,
                                                                     progress=progress, compiler=compiler.name)
        if isinstance(last, TpuOutOfMemory):
            raise last
        return plan, last, trail
    if not as_json:
        print(f"remat_policy: auto chose {chosen} by compile ({len(tried)} compiled; the estimate chose "
              f"{plan.cfg.remat_policy})")
    return make_plan(auto_compile.with_policy(plan.cfg, chosen), plan.target), outcomes[chosen], trail


def _device_memory(plan: Plan) -> tuple[float, str]:
    """(bytes, what they are) of one device's memory on the target: the chip's HBM, or a cpu-N device's share of
    this host's available memory."""
    if plan.link is not None:
        return plan.link.hbm, "HBM"
    return target_capacity(plan.cfg, plan.target).bytes, "host memory share"


def _usable(plan: Plan) -> tuple[int, str]:
    """(bytes, where they come from) of the memory the trainer lets a compiled step use on the target: HBM less
    `memory_headroom`, as `maxshard/run/compile_check.py` checks it before the first step."""
    memory_fit = plan.cfg.memory_fit
    if memory_fit is None:  # an explicit policy: the trainer's check_memory records the same capacity, less headroom
        capacity = target_capacity(plan.cfg, plan.target)
        return fit.usable(plan.cfg, capacity), f"{capacity.source}, memory_headroom={plan.cfg.memory_headroom:g}"
    return memory_fit.usable_bytes, f"{memory_fit.capacity_source}, memory_headroom={plan.cfg.memory_headroom:g}"


if __name__ == "__main__":
    sys.exit(main())
