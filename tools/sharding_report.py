"""Print how every parameter, optimizer moment and the input batch of a config lie on its mesh.

    python tools/sharding_report.py configs/fsdp_tp.yml model_name=8b --num-devices 256
    python tools/sharding_report.py configs/base.yml ici_tensor_parallelism=2 --json

With `--num-devices N` the layout is planned for N devices that need not exist (the mesh rules see "cpu-N", or
`mesh_selector`); without it, for the devices JAX sees (after `cpu_device_count`). Only `jax.eval_shape` runs: no
parameter is allocated, so an 8B model on 256 devices plans in seconds on a laptop. A configuration mistake prints
one line, `sharding_report: error: ...`, and exits 2.
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

from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.observe import report
from maxshard.parallel import mesh
from maxshard.run import loading

__all__ = ["load_config", "make_report", "main"]

PROG = "sharding_report"


def load_config(config_argv: Sequence[str], num_devices: int | None = None) -> Config:
    """`[CONFIG, key=value, ...]` -> finalized Config with the vocabulary resolved; plans for `num_devices` if given."""
    return loading.load_run(config_argv, num_devices=num_devices, check_fit=False)


def make_report(cfg: Config) -> report.Report:
    """The layout of `cfg`'s train state and input batch on its mesh (from the config alone)."""
    return report.build_report(cfg, mesh.axis_sizes(cfg))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a YAML config, e.g. configs/base.yml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for maxshard.train")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--num-devices", type=int, default=None, help="plan for this many devices (need not exist)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.num_devices is not None and args.num_devices < 1:
            raise ConfigError(f"--num-devices must be >= 1, got {args.num_devices}")
        result = make_report(load_config([args.config, *args.overrides], args.num_devices))
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_json()) if args.json else report.format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
