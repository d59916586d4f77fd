"""What splitting the residual stream over the tensor group costs and saves: `tensor` vs `tensor_sequence`.

    python benchmarks/tensor_sequence.py [--tpu]

Both axes split heads, MLP width and vocabulary; `tensor_sequence` also splits the residual stream's length between
attention and MLP (maxshard/model/layers/decoder.py). For a small model on 8 devices, each layout's train step is
compiled (on the simulated CPU devices, or with `--tpu` for a v5e 2x4 slice through libtpu, ahead of time) and
printed: the collectives' bytes per device by kind (`count_collectives` on the compiled HLO) and the compiled
peak, for the pure tensor layouts and for sequence x tensor, where the two splits of the length meet.
"""

from __future__ import annotations

import argparse

import common  # noqa: F401 - 8 simulated devices, before anything queries JAX

from maxshard.parallel import mesh
from maxshard.planning import compiled
from maxshard.planning.collectives import count_collectives
from maxshard.units import format_bytes

MODEL = (*common.SMALL_MODEL, "remat_policy=none", "loss_chunks=1")
LAYOUTS = {
    "tensor=8": ("ici_tensor_parallelism=8",),
    "tensor_sequence=8": ("ici_tensor_sequence_parallelism=8",),
    "fsdp=2 sequence=2 tensor=2": ("ici_sequence_parallelism=2", "ici_tensor_parallelism=2"),
    "fsdp=2 sequence=2 tensor_sequence=2": ("ici_sequence_parallelism=2", "ici_tensor_sequence_parallelism=2"),
}
KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def measure(layout: tuple[str, ...], tpu: bool, dtype: str) -> tuple[dict[str, float], int]:
    """(bytes per collective kind, compiled peak) of one layout's train step."""
    cfg = common.load([common.BASE, *MODEL, f"dtype={dtype}", *layout, "ici_fsdp_parallelism=-1"])
    devices = None
    if tpu:
        from maxshard.launch import topologies
        from maxshard.planning.tpu_compile import abstract_devices

        devices = abstract_devices(topologies.parse("v5litepod-8"))
    step = compiled.compile_train_step(cfg, mesh.build(cfg, devices))
    counts = count_collectives(step.as_text())
    return {k: counts[k]["bytes"] for k in KINDS}, compiled.peak_bytes(step.memory_analysis())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpu", action="store_true", help="compile for a v5e 2x4 slice with libtpu (bfloat16)")
    args = parser.parse_args()
    dtype = "bfloat16" if args.tpu else "float32"
    print(f"{'layout':<38}" + "".join(f"{k:>20}" for k in KINDS) + f"{'total':>12}{'peak':>12}")
    for name, layout in LAYOUTS.items():
        kinds, peak = measure(layout, args.tpu, dtype)
        row = "".join(f"{format_bytes(kinds[k]):>20}" for k in KINDS)
        print(f"{name:<38}{row}{format_bytes(sum(kinds.values())):>12}{format_bytes(peak):>12}", flush=True)


if __name__ == "__main__":
    main()
