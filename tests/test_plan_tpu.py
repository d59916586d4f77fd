"""An offload policy's host bytes planned as XLA:TPU allocates them, compiled ahead of time in CI without a TPU.

The 125m preset on v5e-8 at 2 x 512 tokens per chip under offload_qkv_out_proj (libtpu; maxshard/planning/
tpu_compile.py): q, k and v [.., 12 heads, 64] are moved to host memory stored as the tiled layout pads them,
[.., 16, 128] (2.7x their size): the plan counts the padding, so its host bytes equal the compiled program's host
buffers to the byte (180 MiB). One compile (~75 CPU s; at 2048 tokens the same check took ~180).

The device peak is held to XLA:TPU in tests/test_plan_heldout_tpu.py and tests/test_plan_deepseek_tpu.py, on
shapes that fitted none of the plan's constants. The in-sample shapes once compiled here (125m at 2048 tokens under
full and offload_qkv_out_proj, 1b fsdp=4 x tensor=2 under offload_qkv_proj: 1.104 and 0.904 of their compiled peaks
with libtpu 0.0.42.1) are in benchmarks/README.md ("The planner against XLA:TPU at mid-size shapes"), measured
with `python -m maxshard.plan ... --compile`.
"""

from __future__ import annotations

import importlib.util

from maxshard.launch import topologies
from maxshard.parallel import mesh
from maxshard.planning import estimate
from maxshard.planning.compiled import compile_train_step
from maxshard.planning.tpu_compile import INSTALL, abstract_devices
from maxshard.run.target import load_for_target

if importlib.util.find_spec("libtpu") is None:  # a test dependency: missing means a broken install, not a skip
    raise ImportError(f"tests/test_plan_tpu.py needs libtpu: {INSTALL}")

TARGET = "v5litepod-8"
SHAPE = ("model_name=125m", "override_model_config=true", "per_device_batch_size=2", "max_target_length=512",
         "remat_policy=offload_qkv_out_proj")


def test_an_offload_policy_plans_xla_tpus_host_buffers():
    """What the plan counts apart from the device peak is what XLA:TPU allocates in host memory."""
    target = topologies.parse(TARGET)
    cfg = load_for_target(["configs/base.yml", *SHAPE], target)
    stats = compile_train_step(cfg, mesh.build(cfg, abstract_devices(target))).memory_analysis()
    plan = estimate.make_plan(cfg, target)
    assert plan.host_bytes > 0 and plan.host_bytes == stats.host_temp_size_in_bytes
