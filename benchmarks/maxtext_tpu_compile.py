"""MaxText's `train_compile` and maxshard's train step for the same published recipe and target, compiled ahead of
time with the same XLA:TPU on this CPU: per-device compiled peak, temporaries, arguments and collective bytes, one
JSON line per (recipe, system).

    flock /tmp/tpu_compile.lock python benchmarks/maxtext_tpu_compile.py RECIPE maxtext [--layers N] [--dump DIR]
    flock /tmp/tpu_compile.lock python benchmarks/maxtext_tpu_compile.py RECIPE maxshard [--layers N] [--dump DIR]

RECIPE is one of MaxText's published v6e-256 runs (`benchmarks/maxtext_trillium_model_configs.py` in
AI-Hypercomputer/maxtext, the tpu-recipes READMEs): `llama3.1-8b` (4 x 8192 tokens per chip), `llama3.1-70b`
(5 x 8192), `mixtral-8x7b` (its `mixtral_8x7b_dropped`: 12 x 4096, capacity factor 1.25), each FSDP over the 256
chips with the recipe's offloading remat and splash block sizes. maxshard runs the same shape with the policy that
keeps the same tensors in host memory (`offload_qkv_out_proj`: layer input, q, k, v, attention output;
`offload_qkv_proj`: layer input, q, k, v) and the same splash query block. `--layers N` shortens both models
identically (a per-layer slope and a constant come from two depths).

Both need one venv holding both packages, so that jax and libtpu are the same: MaxText from PyPI needs Python 3.12
(`python3.12 -m venv V && V/bin/pip install "maxtext[tpu]" && V/bin/pip install --no-deps -e .`; docs/toolchains.md,
"Which Python gives which toolchain"). Each system runs in its own process (one full-depth compile at a time is what a
24 GiB machine holds).

MaxText's program is the one its `train_compile.main` compiles (its config, mesh, shardings): the module function
that compiles is wrapped to keep the compiled object, and its `compile_xla_flags` carry the compiler options
maxshard's compile uses (`planning/compiled.py`'s `_FAST`: code generation at the lowest effort; buffer assignment
is unchanged) and the recipe's scoped VMEM limit (`VMEM_KIB`, from its LIBTPU_INIT_ARGS), so both programs go
through the same XLA:TPU with the same options; the recipes' other flags (collective fusion, overlap) are left out
for both. Peaks are `planning/compiled.py`'s (arguments +
temporaries + outputs - donated) and collective bytes per device per step (`planning/collectives.py`, a scanned
body's collectives counted once per layer) for both, from the same `memory_analysis()` and HLO text. A program
over the chip's memory fails to compile on XLA:TPU; its line then carries the figures of the error. FLOPs are not
compared: a scanned loop's body is counted once by `cost_analysis()`, so they are not comparable across programs.
`--dump DIR` adds XLA's dump of the train step to the options of either (its HLO after optimizations, buffer
assignment and memory-usage report: which buffers make the peak).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toolchain_compile  # noqa: E402  (puts the repository on sys.path; JAX_PLATFORMS=cpu)

from maxshard.planning.collectives import count_collectives  # noqa: E402
from maxshard.planning.compiled import _FAST, peak_bytes  # noqa: E402

TOPOLOGY = "v6e-256"
_MAXTEXT_COMMON = ("ici_fsdp_parallelism=-1", "remat_policy=custom", "decoder_layer_input=offload",
                   "query_proj=offload", "key_proj=offload", "value_proj=offload", "attention=flash",
                   "use_iota_embed=true", "dataset_type=synthetic", "enable_checkpointing=false",
                   f"compile_topology={TOPOLOGY}", "compile_topology_num_slices=1", "run_name=maxtext_tpu_compile")
_SPLASH_2048 = tuple(f"sa_block_{b}=2048" for b in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute",
                                                     "q_dq", "kv_dq")) + ("sa_use_fused_bwd_kernel=true",)
# recipe -> (MaxText keys, maxshard keys)
RECIPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llama3.1-8b": (
        ("model_name=llama3.1-8b", "per_device_batch_size=4", "max_target_length=8192", "out_proj=offload",
         *_SPLASH_2048, *_MAXTEXT_COMMON),
        ("model_name=8b", "per_device_batch_size=4", "max_target_length=8192", "remat_policy=offload_qkv_out_proj",
         "attention=splash", "attention_block_q=2048", "attention_block_kv=2048")),
    "llama3.1-70b": (
        ("model_name=llama3.1-70b", "per_device_batch_size=5", "max_target_length=8192", *_SPLASH_2048,
         *_MAXTEXT_COMMON),
        ("model_name=70b", "per_device_batch_size=5", "max_target_length=8192", "remat_policy=offload_qkv_proj",
         "attention=splash", "attention_block_q=2048", "attention_block_kv=2048")),
    "mixtral-8x7b": (
        ("model_name=mixtral-8x7b", "per_device_batch_size=12", "max_target_length=4096", "out_proj=offload",
         "megablox=false", "sparse_matmul=false", "capacity_factor=1.25", "sa_block_q=2048", "sa_block_q_dkv=2048",
         "sa_block_q_dq=2048", *_MAXTEXT_COMMON),
        ("model_name=mixtral_8x7b", "per_device_batch_size=12", "max_target_length=4096", "capacity_factor=1.25",
         "remat_policy=offload_qkv_out_proj", "attention=splash", "attention_block_q=2048",
         "attention_block_kv=512")),
}

# The recipes' scoped VMEM limit (their LIBTPU_INIT_ARGS): without it MaxText's fused splash backward at 2048-row
# blocks does not fit XLA:TPU's default 32 MiB.
VMEM_KIB = {"llama3.1-8b": 98304, "llama3.1-70b": 98304, "mixtral-8x7b": 81920}


def compile_options(recipe: str, dump: str | None) -> dict[str, Any]:
    """maxshard's compile options (`_FAST`) and the recipe's scoped VMEM limit, with XLA's dump of the train step
    (HLO text, buffer assignment, memory usage report) into `dump` when given."""
    dumping = {} if dump is None else {"xla_dump_to": dump, "xla_dump_hlo_as_text": True,
                                       "xla_dump_hlo_module_re": "train_step"}
    return {**_FAST, "xla_tpu_scoped_vmem_limit_kib": VMEM_KIB[recipe], **dumping}


def maxtext_compiled(recipe: str, layers: int | None, options: dict[str, Any]) -> Any:
    """The train step MaxText's `train_compile.main` compiles for `recipe` (at `layers` decoder layers if given)."""
    from maxtext.trainers.pre_train import train_compile

    # libtpu on a machine without a TPU: no metadata server, no chip lock (as maxshard/planning/tpu_compile.py).
    for variable, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                            ("TPU_ACCELERATOR_TYPE", TOPOLOGY), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(variable, value)
    kept, compile_step = [], train_compile.jit_and_compile
    train_compile.jit_and_compile = lambda *a, **k: kept.append(compile_step(*a, **k)) or kept[-1]
    base = os.path.join(os.path.dirname(train_compile.__file__), "..", "..", "configs", "base.yml")
    depth = () if layers is None else ("override_model_config=true", f"base_num_decoder_layers={layers}")
    train_compile.main(["train_compile", os.path.normpath(base), *RECIPES[recipe][0], *depth,
                        "compile_xla_flags=" + " ".join(f"--{k}={v}" for k, v in options.items())])
    return kept[-1]


def maxshard_compiled(recipe: str, layers: int | None, options: dict[str, Any]) -> Any:
    """maxshard's train step for the same recipe on the same target (`planning/compiled.compile_train_step`, with
    `options`)."""
    from maxshard import data
    from maxshard.launch import topologies
    from maxshard.parallel import mesh
    from maxshard.planning.compiled import abstract_inputs
    from maxshard.planning.tpu_compile import abstract_devices
    from maxshard.run.target import load_for_target
    from maxshard.training.step import Trainer

    target = topologies.parse(TOPOLOGY, 1)
    depth = () if layers is None else ("override_model_config=true", f"num_layers={layers}")
    cfg = load_for_target([os.path.join(toolchain_compile.REPO, "configs", "base.yml"), *RECIPES[recipe][1], *depth],
                          target)
    trainer = Trainer(cfg, mesh.build(cfg, abstract_devices(target)))
    batch_sharding = data.batch_sharding(cfg, trainer.mesh)
    return trainer.jit_train_step(batch_sharding).lower(*abstract_inputs(trainer, batch_sharding)).compile(options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("system", choices=("maxtext", "maxshard"))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of both models (default: the model's)")
    parser.add_argument("--dump", default=None, help="a folder for XLA's dump of the train step (HLO, buffers)")
    args = parser.parse_args()
    row: dict[str, Any] = {"recipe": args.recipe, "system": args.system, "layers": args.layers or "full",
                           **{p: toolchain_compile.metadata.version(p) for p in toolchain_compile.PACKAGES},
                           "topology": TOPOLOGY}
    build = maxtext_compiled if args.system == "maxtext" else maxshard_compiled
    started = time.perf_counter()
    try:
        compiled = build(args.recipe, args.layers, compile_options(args.recipe, args.dump))
    except Exception as e:  # XLA:TPU's refusal of a program over the chip: its figures are the result
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        lines = [line.strip() for line in str(e).splitlines() if re.search(r"\d+(\.\d+)?[KMG]\b", line)]
        print(json.dumps({**row, "error": "RESOURCE_EXHAUSTED", "figures": lines[:12],
                          "seconds": round(time.perf_counter() - started, 1)}))
        return
    seconds = time.perf_counter() - started
    stats, collectives = compiled.memory_analysis(), count_collectives(compiled.as_text())
    gib = lambda n: round(n / 2**30, 2)  # noqa: E731
    print(json.dumps({
        **row, "peak_gib": gib(peak_bytes(stats)), "temp_gib": gib(stats.temp_size_in_bytes),
        "argument_gib": gib(stats.argument_size_in_bytes), "output_gib": gib(stats.output_size_in_bytes),
        "alias_gib": gib(stats.alias_size_in_bytes), "host_temp_gib": gib(stats.host_temp_size_in_bytes),
        "collective_gib": gib(sum(c["bytes"] for c in collectives.values())),
        "collectives_gib": {k: gib(c["bytes"]) for k, c in collectives.items() if c["count"]},
        "seconds": round(seconds, 1),
    }))


if __name__ == "__main__":
    main()
