"""The published MoE run through the planner: Mixtral 8x7B (configs/models/mixtral_8x7b.yml: capacity 1.25,
whole-sequence routing groups, as MaxText's run) at 12 x 4096 tokens per chip on v6e-256 (benchmarks/README.md,
"Mixtral 8x7B on v6e-256"). Plan only, nothing compiled (a few seconds): the MoE layer is counted as XLA:TPU holds
it (planning/moe_memory.py `working_bytes`, `Fitted.moe_rows`), not as XLA:CPU does. Whether the run fits is not
asserted: the whole step compiled to 30.9 GiB per chip against a plan of 21.2 GiB (benchmarks/README.md), so a
"fits" from the plan would be the planner's error, not a property to keep.
"""

from __future__ import annotations

import dataclasses

import pytest

from maxshard import plan as plan_cli
from maxshard.spec import remat
from maxshard.parallel import mesh
from maxshard.planning import fitted, moe_memory
from maxshard.planning.widths import widths

MIXTRAL = ["configs/base.yml", "model_name=mixtral_8x7b", "per_device_batch_size=12"]
TARGET = "v6e-256"


@pytest.fixture(scope="module")
def plan():
    return plan_cli.plan_for(MIXTRAL, TARGET)


def test_the_moe_layer_is_counted_in_place_of_the_dense_mlp_on_xla_tpu(plan) -> None:
    """Per token, the MoE working term is the measured rows less the dense MLP's share; XLA:CPU keeps its count."""
    cfg, sizes = plan.cfg, mesh.axis_sizes(plan.cfg)
    w = widths(cfg, sizes)
    row = fitted.fitted("xla:tpu").working[remat.on_device(remat.policy(cfg.remat_policy)).name]
    share = (row[0] * 6 + row[2]) * 14336 * 2
    assert moe_memory.working_bytes(cfg, w, sizes, 2, "xla:tpu", row) == 2.5 * (2 * 4096 + 14336) * 2 - share
    assert moe_memory.working_bytes(cfg, w, sizes, 2, "xla:cpu", row) == moe_memory.token_bytes(cfg, w, sizes, 2)
    dropless = dataclasses.replace(cfg, capacity_factor=-1.0)
    assert moe_memory.working_bytes(dropless, w, sizes, 2, "xla:tpu", row) == 2 * (2 * 4096 + 3 * 14336) * 2 - share
