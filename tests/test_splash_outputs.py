"""The planner's block term for splash on XLA:TPU: the block-sized float32 outputs of the installed kernel's calls
(planning/splash_outputs.py), per sequence row and kv head, in place of the score block the other fused kernels
hold. jax 0.10's splash writes its forward accumulators as outputs (768 KiB a call at 512-token blocks); jax 0.12's
keeps them in scratch (0). What either does to the compiled peak is tests/test_plan_heldout_tpu.py's LoRA shape:
planned 1.19 on jax 0.12 with the score block, 1.00 with the kernel's outputs.
"""

from __future__ import annotations

from maxshard.launch import topologies
from maxshard.planning import estimate, splash_outputs
from maxshard.run.target import load_for_target

V5E_8 = topologies.parse("v5litepod-8")
TILE = (8, 128)


def test_a_value_is_counted_with_its_minor_dimensions_padded_to_the_tile():
    assert splash_outputs._tiled((512, 64), TILE) == 512 * 128
    assert splash_outputs._tiled((3, 5, 200), TILE) == 3 * 8 * 256
    assert splash_outputs._tiled((100,), TILE) == 8 * 128


def test_the_kernels_block_outputs_follow_its_blocks_not_its_heads():
    """Whatever the installed kernel writes, it is per call and block-sized: half the blocks, half the bytes; a
    head width within one lane tile, and a larger query group, the same bytes."""
    full = splash_outputs.largest_call_bytes(1, 64, 512, 512, TILE)
    assert full in (0, 3 * 512 * 128 * 4)  # jax 0.12: scratch; jax 0.10: running max, sum and output [512, 128]
    assert splash_outputs.largest_call_bytes(1, 64, 256, 256, TILE) * 2 == full
    assert splash_outputs.largest_call_bytes(4, 128, 512, 512, TILE) == full


def test_the_plan_holds_the_kernels_outputs_for_every_row_and_kv_head():
    """The 125m step on v5e-8 (splash, 12 kv heads, 4 rows of 512 per chip): the block term is 4 x 12 calls'
    outputs; with the blockwise kernel instead, a float32 score block per row and head."""
    overrides = ["configs/base.yml", "model_name=125m", "override_model_config=true",
                 "per_device_batch_size=4", "max_target_length=512"]
    cfg = load_for_target(overrides, V5E_8)
    assert cfg.model.attention == "splash"
    block = estimate.make_plan(cfg, V5E_8).activation_terms.block
    assert block == 4 * 12 * splash_outputs.largest_call_bytes(1, 64, 512, 512, TILE)
    blockwise = load_for_target([*overrides, "attention=blockwise"], V5E_8)
    assert estimate.make_plan(blockwise, V5E_8).activation_terms.block == 4 * 12 * 512 * 512 * 4
