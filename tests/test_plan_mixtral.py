"""The published MoE run through the planner: Mixtral 8x7B (configs/models/mixtral_8x7b.yml: capacity 1.25,
whole-sequence routing groups, as MaxText's run) at 12 x 4096 tokens per chip on v6e-256 (benchmarks/README.md,
"Mixtral 8x7B on v6e-256"). Plan only, nothing compiled (a few seconds): `remat_policy: auto` and the layout search
pinned to the published mesh must land on a policy whose planned peak fits the usable memory, with the MoE layer
counted as XLA:TPU holds it (planning/moe_memory.py `working_bytes`, `Fitted.moe_rows`), not as XLA:CPU does.
"""

from __future__ import annotations

import dataclasses

import pytest

from maxshard import plan as plan_cli
from maxshard.launch import topologies
from maxshard.spec import remat
from maxshard.parallel import mesh
from maxshard.planning import fit, fitted, moe_memory
from maxshard.planning.memory import widths
from maxshard.run import search
from maxshard.run.target import target_capacity

MIXTRAL = ["configs/base.yml", "model_name=mixtral_8x7b", "per_device_batch_size=12"]
TARGET = "v6e-256"


@pytest.fixture(scope="module")
def plan():
    return plan_cli.plan_for(MIXTRAL, TARGET)


def test_auto_fits_the_published_mixtral_run_on_v6e_256(plan) -> None:
    cfg = plan.cfg
    assert mesh.axis_sizes(cfg)["fsdp"] == 256 and cfg.capacity_factor == 1.25 and cfg.moe_group_size == 0
    capacity = target_capacity(cfg, plan.target)
    fits, line = fit.verdict(cfg, capacity)
    assert fits and line.startswith("fit: yes"), line
    assert cfg.memory_fit.requested == "auto"
    assert remat.policy(cfg.remat_policy).offloads  # the peers' policy: what no on-device policy fits
    assert plan.peak_bytes <= fit.usable(cfg, capacity)


def test_search_pinned_to_the_published_mesh_finds_a_fitting_policy() -> None:
    target = topologies.parse(TARGET)
    result = search.search([*MIXTRAL, "ici_fsdp_parallelism=256"], target)
    assert result.fitting
    best = result.fitting[0]
    assert best.plan.peak_bytes <= search.capacity_bytes(target)


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
