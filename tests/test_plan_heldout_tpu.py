"""The planner against XLA:TPU on shapes that fitted none of its constants: a pipeline, a context-parallel and a LoRA
run, each planned within 0.95-1.15 of the compiled train step's device peak (planning on the low side is what runs out
of memory, so the bound is not symmetric).

The constants were read off the 125m preset at 2 x 2048 tokens per chip under remat full on v5e-8; the shapes below
differ from it in batch, length, stage and context count, microbatches, LoRA rank and loss pieces. Their loss is split
(loss_chunks=16) so that the peak is in the layers' backward, where the terms under test are, not in the loss. Each
shape compiles once (XLA:TPU ahead of time, planning/tpu_compile.py), the smallest each bound still holds at; what
each shape planned, on which libtpu, and the shapes tried and not taken are in benchmarks/README.md, "Held-out shapes".

The LoRA shape also holds the plan's host bytes (what an offload policy moves off the device) to XLA:TPU's host
buffers, to the byte: under offload_qkv_out_proj the layer input, out_proj and the adapted q, k and v move to host
memory, q, k and v stored as the tiled layout pads them (`widths.Widths.stored`). The context shape's program also
shows ring attention on XLA:TPU, its steps passing K/V around the ring (collective-permute).
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

from maxshard.launch import topologies
from maxshard.parallel import mesh
from maxshard.planning import estimate
from maxshard.planning.compiled import compile_train_step, peak_bytes
from maxshard.planning.tpu_compile import INSTALL, abstract_devices
from maxshard.run.target import load_for_target

if importlib.util.find_spec("libtpu") is None:  # a test dependency: missing means a broken install, not a skip
    raise ImportError(f"tests/test_plan_heldout_tpu.py needs libtpu: {INSTALL}")

LOW, HIGH = 0.95, 1.15
TARGET = "v5litepod-8"
SHAPE = ("model_name=125m", "override_model_config=true", "loss_chunks=16")
CASES = {
    "pipeline": (*SHAPE, "per_device_batch_size=4", "max_target_length=1024", "ici_pipeline_parallelism=2",
                 "num_pipeline_microbatches=4", "remat_policy=full"),
    "context": (*SHAPE, "per_device_batch_size=2", "max_target_length=1024", "ici_context_parallelism=4",
                "vocab_size=4096", "remat_policy=full"),
    "lora": (*SHAPE, "per_device_batch_size=4", "max_target_length=512", "lora_rank=8",
             "remat_policy=offload_qkv_out_proj"),
}


@functools.cache
def _ratio(case: str) -> float:
    """Planned / compiled device peak of one case (one compile, kept for the module), after checking that the plan's
    host bytes are the program's host buffers: 0 where nothing is offloaded, to the byte where it is."""
    target = topologies.parse(TARGET)
    cfg = load_for_target(["configs/base.yml", *CASES[case]], target)
    step = compile_train_step(cfg, mesh.build(cfg, abstract_devices(target)))
    stats, plan = step.memory_analysis(), estimate.make_plan(cfg, target)
    assert plan.host_bytes == stats.host_temp_size_in_bytes, (
        f"{case}: planned host bytes {plan.host_bytes}, XLA:TPU's host buffers {stats.host_temp_size_in_bytes}")
    assert (plan.host_bytes > 0) == cfg.remat_policy.startswith("offload"), case
    if cfg.ici_context_parallelism > 1:  # ring attention: its steps pass K/V around the context ring
        assert "collective-permute" in step.as_text(), case
    return plan.peak_bytes / peak_bytes(stats)


@pytest.mark.parametrize("case", list(CASES))
def test_a_held_out_shape_plans_within_the_bound(case):
    ratio = _ratio(case)
    print(f"\n{case}: planned / XLA:TPU compiled device peak = {ratio:.3f}")
    assert LOW <= ratio <= HIGH, f"{case}: planned / compiled = {ratio:.3f}, outside [{LOW}, {HIGH}]"
