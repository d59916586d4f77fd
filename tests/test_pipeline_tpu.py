"""The pipelines' programs on XLA:TPU (libtpu ahead of time, no TPU): the table runner reduces a stage's weight
gradient to its fsdp shards layer by layer, never holding it whole; the circular pipeline hands each stage only its
share of the output.

The runner takes each stage's backward by `jax.vjp` inside its tick loop and `lax.switch`; XLA:TPU's sharding
propagation does not reach the layer scan's backward there unless the runner pins the stage's weights to their
state sharding (`pipeline_runner._pin_fn`). Without the pin the scan accumulates the whole float32 gradient of
the stage's layers (every fsdp shard) before one reduce-scatter: at Llama-3-70B widths, 2 layers per stage, that
is 6.9 GiB per device and put 1F1B's peak 5.2 GiB above circular's (benchmarks/README.md, pipeline schedules).
XLA:CPU propagates the sharding either way, so only an XLA:TPU program shows it; the compiled 1f1b step at a small
shape (v5e-4: stage=2 x fsdp=2) is checked for an array of the whole [layers per stage, emb, mlp] float32 shape.
"""

from __future__ import annotations

import importlib.util
import math

from maxshard.launch import topologies
from maxshard.parallel import mesh
from maxshard.planning import buffer_dump
from maxshard.planning.collectives import collective_arrays
from maxshard.planning.compiled import compile_train_step
from maxshard.planning.tpu_compile import INSTALL, abstract_devices
from maxshard.run.target import load_for_target
from maxshard.spec import pipeline_schedule

if importlib.util.find_spec("libtpu") is None:  # a test dependency: missing means a broken install, not a skip
    raise ImportError(f"tests/test_pipeline_tpu.py needs libtpu: {INSTALL}")

TARGET = topologies.parse("v5litepod-4")
TARGET_8 = topologies.parse("v5litepod-8")
# the smallest shape that showed the whole gradient (40 arrays of it without the pin, none with it); dot_product
# attention: no Mosaic kernel to compile, and attention has no part in the weight gradient's layout
MODEL = ("dataset_type=synthetic", "pipeline_schedule=1f1b", "emb_dim=128", "num_heads=1", "num_kv_heads=1",
         "head_dim=128", "mlp_dim=256", "max_target_length=128", "num_layers=4", "vocab_size=512",
         "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", "num_layers_per_pipeline_stage=2",
         "num_pipeline_microbatches=2", "per_device_batch_size=1", "remat_policy=full", "attention=dot_product")


def test_1f1b_reduces_each_layer_s_weight_gradient_to_its_shard_on_tpu():
    cfg = load_for_target(["configs/base.yml", *MODEL], TARGET)
    text = compile_train_step(cfg, mesh.build(cfg, abstract_devices(TARGET))).as_text()
    layers, emb, mlp, fsdp = cfg.model.pipeline.layers_per_stage, cfg.emb_dim, cfg.mlp_dim, cfg.ici_fsdp_parallelism
    whole, shard = f"f32[{layers},{emb},{mlp}]", f"f32[{layers},{emb // fsdp},{mlp}]"
    assert shard in text  # the stage's gradient, reduced per layer (the test reads the right program)
    assert whole not in text, f"the stage's whole weight gradient {whole} is held before its reduce-scatter"


def test_circular_hands_each_stage_only_its_share_of_the_output_on_tpu():
    """The circular pipeline's output is stage 0's slot of its buffer, all M microbatches; the batch's sharding
    puts M / S of them on each stage. Taken as `buffer[0]`, XLA:TPU moved the whole slot to every stage first, in
    the forward and again in the backward (1 GiB per device at Llama-3-70B widths, 8 stages, 16 microbatches:
    benchmarks/README.md); `layers/pipeline._finished` hands each stage its share. Two collectives hold all M
    microbatches' tokens by the schedule: the inputs gathered into every stage's slot of the buffer, and the
    output's cotangent gathered into stage 0's (5 with `buffer[0]` at this shape)."""
    model = [m for m in MODEL if not m.startswith(("pipeline_schedule", "num_pipeline_microbatches",
                                                   "per_device_batch_size", "max_target_length"))]
    cfg = load_for_target(["configs/base.yml", *model, "pipeline_schedule=circular", "num_pipeline_microbatches=4",
                           "per_device_batch_size=2", "max_target_length=256"], TARGET)
    text = compile_train_step(cfg, mesh.build(cfg, abstract_devices(TARGET))).as_text()
    shape = cfg.model.pipeline
    rows = cfg.global_batch_size // shape.microbatches // cfg.ici_fsdp_parallelism  # a microbatch's rows per device
    microbatch = rows * cfg.max_target_length * cfg.emb_dim
    sizes = [math.prod(dims) for dtype, dims in collective_arrays(text)
             if dtype == "bf16" and dims[-2:] == (cfg.max_target_length, cfg.emb_dim)]
    assert shape.microbatches // shape.stages * microbatch in sizes, sizes  # each stage's share handed over
    whole = [n for n in sizes if n >= shape.microbatches * microbatch]
    assert len(whole) <= 2, f"{len(whole)} collectives hold every microbatch's tokens: {sizes}"


# stage=4 x fsdp=2, one layer a stage, M=16 microbatches of one 2048-token sequence per fsdp shard: 4 MiB stage
# inputs, enough of them that what the schedules hold for the backward is most of the heap
IN_FLIGHT = ("dataset_type=synthetic", "emb_dim=1024", "num_heads=8", "num_kv_heads=8", "head_dim=128",
             "mlp_dim=2048", "max_target_length=2048", "num_layers=4", "vocab_size=512", "ici_pipeline_parallelism=4",
             "ici_fsdp_parallelism=2", "num_layers_per_pipeline_stage=1", "num_pipeline_microbatches=16",
             "per_device_batch_size=4", "remat_policy=full", "attention=dot_product")


def test_1f1b_holds_less_than_circular_by_what_its_table_says_on_tpu(tmp_path):
    """1F1B's in-flight activations, as XLA:TPU keeps them: the bytes live where the step's heap is fullest (the
    buffer assignment's own live ranges, planning/buffer_dump.py) fall below circular's by the stage inputs the
    two schedules hold by their tables (circular: 19 kept, a buffer of 16 and its output share of 4; 1F1B: a stash
    of 4 and one cotangent; 34 of 4 MiB here; 1.034 of it measured on libtpu 0.0.42.1, 0.960 on 0.0.52). The
    heap's size adds its placement gaps, which differ by schedule; benchmarks/pipeline_memory.py measures the same
    at Llama-3-70B widths (benchmarks/README.md, pipeline schedules)."""
    live, held = {}, {}
    for schedule in ("circular", "1f1b"):
        cfg = load_for_target(["configs/base.yml", *IN_FLIGHT, f"pipeline_schedule={schedule}"], TARGET_8)
        dump = str(tmp_path / schedule)
        compile_train_step(cfg, mesh.build(cfg, abstract_devices(TARGET_8)), buffer_dump.options(dump))
        live[schedule] = sum(size for size, _, _ in buffer_dump.live_at_peak(dump)[1])
        held[schedule] = pipeline_schedule.held_at_peak(pipeline_schedule.of(cfg.model.pipeline))
    shape = cfg.model.pipeline
    stage_input = cfg.global_batch_size // shape.microbatches // cfg.ici_fsdp_parallelism \
        * cfg.max_target_length * cfg.emb_dim * 2  # bfloat16 activations
    predicted = (held["circular"] - held["1f1b"]) * stage_input
    measured = live["circular"] - live["1f1b"]
    print(f"\n1f1b below circular: {measured / 2**20:.1f} MiB live, the tables say {predicted / 2**20:.1f}")
    assert abs(measured - predicted) <= 0.1 * predicted, (measured, predicted, live)
