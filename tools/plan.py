"""Plan a training run for a cluster you do not have: memory, collectives, pipeline bubble and a roofline step time.

    python tools/plan.py configs/base.yml model_name=8b --topology v5p-1024 --num-slices 4
    python tools/plan.py configs/fsdp_tp.yml model_name=8b --topology h100-80gb-8 --num-slices 16 --json

The config is validated as the launcher validates it for the target (`maxshard.launch.xpk`): the device count,
device kind and host count of `--topology` x `--num-slices` (TPU slices, or GPU nodes), `num_slices` set to match.
Then only `jax.eval_shape` runs: no mesh of that size is built and nothing is compiled, so an 8B model on 2048 chips
plans in seconds on a laptop. A configuration mistake prints one line, `plan: error: ...`, and exits 2.
The model behind every number is written out in `maxshard/planning/` (memory.py, traffic.py, estimate.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

try:
    import maxshard  # noqa: F401 - installed (pip install -e .)
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxshard import config, loading
from maxshard.config import Config, ConfigError
from maxshard.launch import topologies, xpk
from maxshard.launch.topologies import Target
from maxshard.planning.estimate import Plan, make_plan
from maxshard.planning.printout import format_plan, plan_json

__all__ = ["load_for_target", "plan_for", "main"]

PROG = "plan"


def load_for_target(config_argv: Sequence[str], target: Target) -> Config:
    """`[CONFIG, key=value, ...]` finalized as the trainer will see it on `target` (mesh resolved, vocab set)."""
    xpk.check_tokens(config_argv)
    parsed = config.parse(config_argv)
    argv = xpk.prepare_trainer_argv(config_argv, parsed, target, workload="plan")
    return loading.complete(xpk.validate_for_target(argv, target))


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else list(argv))
    try:
        plan = plan_for([args.config, *args.overrides], args.topology, args.num_slices)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_json(plan)) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
