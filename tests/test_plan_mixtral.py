"""The published MoE run through the planner: Mixtral 8x7B (configs/models/mixtral_8x7b.yml: capacity 1.25,
whole-sequence routing groups, as MaxText's run) at 12 x 4096 tokens per chip on v6e-256 (benchmarks/README.md,
"Mixtral 8x7B on v6e-256"). Plan only, nothing compiled (a few seconds): the MoE layer's backward is counted as
XLA:TPU holds it, a phase of its own (planning/moe_memory.py `working_bytes`, `Fitted.moe_rows`), not as XLA:CPU does.

The whole step compiled for v6e-256 (libtpu 0.0.42.1, benchmarks/README.md): the preset to 30.9 GiB per chip, over
the 28.1 GiB usable, which the plan now says (31.3 GiB; it said 21.2 and "fits" before); dropless
(`capacity_factor=-1`, ragged_dot) to 24.6 GiB, under it, which the plan says too (offload_qkv_out_proj chosen by
`remat_policy: auto`): 24.1 GiB on jax 0.10, 24.0 on jax 0.12 (24.4 before splash's block term became the kernel's
own float32 outputs, 72 MiB per chip on jax 0.10 and none on 0.12, where 12 rows x 32 heads of score blocks were
384 MiB: planning/splash_outputs.py).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from maxshard import plan as plan_cli
from maxshard.spec import remat
from maxshard.parallel import mesh
from maxshard.observe.report import build_report
from maxshard.planning import fit, fitted, moe_memory
from maxshard.planning.widths import widths
from maxshard.run.target import target_capacity

MIXTRAL = ["configs/base.yml", "model_name=mixtral_8x7b", "per_device_batch_size=12"]
TARGET = "v6e-256"


@pytest.fixture(scope="module")
def plan():
    return plan_cli.plan_for(MIXTRAL, TARGET)


def test_the_moe_backward_is_a_phase_of_its_own_on_xla_tpu(plan) -> None:
    """Per token, the unit holds the larger of the MoE rows (2.5 rows of 2E + 6F; dropless 2 rows of 2E + 5F, or with
    the experts split the exchange buffer's rows of 2E + 6F) and the layer's working set less the dense MLP's share;
    XLA:CPU keeps its count."""
    cfg, sizes = plan.cfg, mesh.axis_sizes(plan.cfg)
    w = widths(cfg, sizes)
    policy = remat.policy(cfg.remat_policy)
    row = fitted.fitted("xla:tpu").working[remat.on_device(policy).name]
    share = (row[0] * 6 + row[2]) * 14336 * 2
    layer = w.working_bytes(policy, 2, "xla:tpu")
    rows = 2.5 * (2 * 4096 + 6 * 14336) * 2
    assert rows > layer - share  # Mixtral's peak is the MoE backward (benchmarks/README.md)
    assert moe_memory.working_bytes(cfg, w, sizes, 2, "xla:tpu", row, layer) == rows - layer
    assert moe_memory.working_bytes(cfg, w, sizes, 2, "xla:cpu", row, layer) == moe_memory.token_bytes(cfg, w, sizes, 2)
    dropless = dataclasses.replace(cfg, capacity_factor=-1.0)  # 2 rows of 2E + 5F (benchmarks/README.md)
    dropless_rows = 2 * (2 * 4096 + 5 * 14336) * 2
    assert moe_memory.working_bytes(dropless, w, sizes, 2, "xla:tpu", row, layer) == dropless_rows - layer
    small = dataclasses.replace(cfg, capacity_factor=0.01)  # few rows: the layer's own working set is the larger
    assert moe_memory.working_bytes(small, w, sizes, 2, "xla:tpu", row, layer) == -share
    # the experts split over 4 devices (the ragged exchange): the rows of its worst-case buffer, 4 x top-2 a token,
    # each 2E + 6F (Moonlight-16B's buffers, moe_memory.py); dropping there keeps XLA:CPU's count (not measured)
    split = {**sizes, "fsdp": sizes["fsdp"] // 4, "expert": 4}
    exchange = dataclasses.replace(dropless, moe_exchange="ragged")
    assert moe_memory.rows(exchange, split) == 8
    want = 8 * (2 * 4096 + 6 * 14336) * 2 - layer
    assert moe_memory.working_bytes(exchange, w, split, 2, "xla:tpu", row, layer) == want
    assert moe_memory.working_bytes(cfg, w, split, 2, "xla:tpu", row, layer) == moe_memory.token_bytes(cfg, w, split, 2)


def test_the_published_dropping_run_does_not_fit_at_12_sequences(plan) -> None:
    """The preset compiled to 30.9 GiB per chip, over the usable 28.1: the plan says so (no policy fits), and its
    verdict names the setting that does fit, the dropless grouped path under the published offload policy."""
    assert not plan.cfg.memory_fit.fits
    assert plan.peak_bytes > plan.cfg.memory_fit.usable_bytes
    fits, line = fit.verdict(plan.cfg, target_capacity(plan.cfg, plan.target))
    assert not fits and "\n" not in line
    assert "no remat policy fits" in line and "capacity_factor=-1 (dropless" in line
    planned = re.search(r"fits with remat_policy=offload_qkv_out_proj \(([\d.]+) GiB\)$", line)
    assert planned and 0.95 * 24.6 <= float(planned.group(1)) <= 24.6, line  # compiled: 24.6 GiB


def test_the_dropless_grouped_path_fits_and_auto_offloads_the_projections() -> None:
    """Dropless (`capacity_factor=-1`: ragged_dot over 2 rows per token, MaxText's other Mixtral recipe) at the same
    12 x 4096 tokens per chip: `auto` keeps the published offload policy, under the usable memory, as the compiled
    step is."""
    dropless = [*MIXTRAL, "capacity_factor=-1"]
    fit = plan_cli.plan_for(dropless, TARGET)
    assert fit.cfg.memory_fit.fits and fit.cfg.remat_policy == "offload_qkv_out_proj"
    assert fit.peak_bytes <= fit.cfg.memory_fit.usable_bytes


def test_the_heap_leaves_gaps_beside_the_moe_layers_stacked_values(plan) -> None:
    """XLA:TPU's heap fragments with the MoE layers' stacked values (`Fitted.moe_stack_gaps`, planning/fitted.py):
    the term is 0.9 x their float32 gradient and bfloat16 cast per device. Every Mixtral layer is an MoE layer, so
    that is every decoder parameter's 4 + 2 bytes; in tiny_moe's [dense, MoE] unit only the second layer counts, a
    frozen LoRA base has no gradient, and XLA:GPU (XLA:CPU's constants) leaves no such gaps."""
    decoder = sum(p.bytes_per_device for p in build_report(plan.cfg, plan.mesh).params
                  if p.name.startswith("params/decoder/"))
    assert plan.activation_terms.gaps == pytest.approx(0.9 * decoder * 1.5)

    def terms(*overrides: str, topology: str = "v5litepod-8"):
        tiny = plan_cli.plan_for(["configs/base.yml", "model_name=tiny_moe", *overrides], topology)
        return tiny.activation_terms, build_report(tiny.cfg, tiny.mesh).params

    (trained, params), (frozen, lora) = terms(), terms("lora_rank=4")
    moe = sum(p.bytes_per_device for p in params if "/decoder/layers/layer_1/" in p.name)
    assert 0 < moe < sum(p.bytes_per_device for p in params if p.name.startswith("params/decoder/"))
    assert trained.moe_stack == pytest.approx(1.5 * moe) and trained.gaps == pytest.approx(0.9 * 1.5 * moe)
    adapters = sum(p.bytes_per_device for p in lora if "/decoder/layers/layer_1/" in p.name and "lora" in p.name)
    assert 0 < adapters and frozen.moe_stack == pytest.approx(0.5 * moe + 1.5 * adapters)  # the base: its cast only
    assert terms(topology="h100-80gb-8")[0].gaps == 0
