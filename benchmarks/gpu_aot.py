"""A run's init and train step compiled with XLA:GPU for NVIDIA GPUs on a machine without one
(`maxshard/planning/gpu_compile.py`): the compiled peak per device, the plan's estimate beside it, compile seconds.

    pip install -e ".[gpu-aot]"
    python benchmarks/gpu_aot.py                                   # the 1b preset, 8,192 x 2 tokens, one H200
    python benchmarks/gpu_aot.py --gpus 8 --device-type h100-80gb-8 model_name=8b per_device_batch_size=1

`--gpus 1` describes one GPU of the node type (as the runs of "On one H200" used it); more compile for that many GPUs
of one node. The compiled peak is the figure to compare with a run's own `memory_analysis()` on the device (the
trainer prints it at startup).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from maxshard.launch.topologies import Target, parse  # noqa: E402
from maxshard.planning import gpu_compile  # noqa: E402
from maxshard.planning.tpu_compile import compile_run  # noqa: E402
from maxshard.run.target import load_for_target  # noqa: E402
from maxshard.units import format_bytes  # noqa: E402

ONE_H200_RUN = ["model_name=1b", "override_model_config=true", "dataset_type=synthetic", "max_target_length=8192",
                "per_device_batch_size=2", "attention=cudnn"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-type", default="h200-141gb-8")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of one node to compile for")
    parser.add_argument("overrides", nargs="*", help="key=value (default: the 1b preset as the H200 run ran it)")
    args = parser.parse_args()
    node = parse(args.device_type, 1)
    target = Target(node.name, "gpu", node.device_kind, args.gpus, 1, 1)
    cfg = load_for_target(["configs/base.yml", *(args.overrides or ONE_H200_RUN)], target)
    started = time.perf_counter()
    run = compile_run(cfg, target, gpu_compile.abstract_devices(target), compiler="JAX's CUDA plugin")
    planned = cfg.memory_fit.planned_bytes if cfg.memory_fit else None
    print(f"{args.gpus} x {node.device_kind}, attention={cfg.model.attention}, remat_policy={cfg.remat_policy}: "
          f"train step {format_bytes(run.step_peak)} per device compiled ({run.step_seconds:.0f}s), init "
          f"{format_bytes(run.init_peak)} ({run.init_seconds:.0f}s); planned "
          f"{'-' if planned is None else format_bytes(planned)}; {time.perf_counter() - started:.0f}s in all")


if __name__ == "__main__":
    main()
