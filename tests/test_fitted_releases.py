"""The planner's XLA:TPU constants follow the installed libtpu release (planning/fitted.py `XLA_TPU_BY_LIBTPU`):
a release with an entry of its own plans what its programs hold (0.0.52's loss holds three gathered copies of a
LoRA run's frozen head) and as it reports them (0.0.52's temporaries are the heap, without its fragmentation
counted again), an older one FITTED's entry. Planned only, no compile (the compiles behind the figures are
tests/test_plan_heldout_tpu.py's, run under each release)."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from maxshard.launch import topologies
from maxshard.planning import estimate, fitted, printout
from maxshard.run.target import load_for_target

LORA = ("model_name=125m", "override_model_config=true", "loss_chunks=16", "per_device_batch_size=4",
        "max_target_length=512", "lora_rank=8", "remat_policy=offload_qkv_out_proj")


def test_the_installed_release_is_read_as_numbers() -> None:
    version = importlib.metadata.version("libtpu")  # a test dependency (the tpu-aot extra)
    assert fitted.libtpu_release() == tuple(int(n) for n in re.findall(r"\d+", version)[:4])


@pytest.mark.parametrize("release, copies", [((0, 0, 42, 1), 1), ((0, 0, 50, 1), 1), ((0, 0, 51), 1),
                                             ((0, 0, 52), 3), ((0, 0, 53), 3), (None, 1)])
def test_each_release_takes_its_own_entry(monkeypatch, release, copies) -> None:
    monkeypatch.setattr(fitted, "libtpu_release", lambda: release)
    assert fitted.fitted("xla:tpu").frozen_head_copies == copies
    assert fitted.fitted("xla:tpu").kept_without_remat == ((6, 2, 6, 4) if copies == 3 else (6, 2, 5, 4))
    assert fitted.fitted("xla:tpu").heap_share == (0.66 if copies == 3 else 1.0)  # 0.0.52 reports the heap
    assert fitted.fitted("xla:cpu") is fitted.FITTED["xla:cpu"]


def test_a_frozen_head_is_planned_in_as_many_copies_as_the_release_holds(monkeypatch) -> None:
    target = topologies.parse("v5litepod-8")
    cfg = load_for_target(["configs/base.yml", *LORA], target)
    planned = {}
    for release in ((0, 0, 50, 1), (0, 0, 52)):
        monkeypatch.setattr(fitted, "libtpu_release", lambda release=release: release)
        planned[release] = estimate.make_plan(cfg, target)
    before, after = planned[(0, 0, 50, 1)], planned[(0, 0, 52)]
    table = before.activation_terms.head_grouped[0]  # bf16[32000, 768] gathered whole: 46.9 MiB
    assert table == 32000 * 768 * 2
    assert after.activation_terms.head_grouped[0] == 3 * table
    # the loss phase holds two more tables; its logits, fitted to the older report, take 0.0.52's heap share
    share = fitted.fitted("xla:tpu").heap_share
    assert after.activation_terms.head == pytest.approx(3 * table + share * (before.activation_terms.head - table))


PIPELINE = ("model_name=125m", "override_model_config=true", "loss_chunks=16", "per_device_batch_size=4",
            "max_target_length=1024", "ici_pipeline_parallelism=2", "num_pipeline_microbatches=4",
            "remat_policy=save_qkv_out_proj")


def test_where_the_report_is_the_heap_only_the_terms_fitted_to_the_older_report_shrink(monkeypatch) -> None:
    """libtpu 0.0.52 reports the HBM heap where the older releases add its fragmentation again: the terms fitted to
    those totals take the heap share, the values counted one by one keep their bytes."""
    target = topologies.parse("v5litepod-8")
    cfg = load_for_target(["configs/base.yml", *PIPELINE], target)
    terms = {}
    for release in ((0, 0, 50, 1), (0, 0, 52)):
        monkeypatch.setattr(fitted, "libtpu_release", lambda release=release: release)
        terms[release] = estimate.make_plan(cfg, target).activation_terms
    before, after = terms[(0, 0, 50, 1)], terms[(0, 0, 52)]
    share = fitted.fitted("xla:tpu").heap_share
    assert 0 < share < 1
    for counted in ("saved", "pipeline", "head_grouped"):  # stacks, kept stage inputs, the gathered table
        assert getattr(after, counted) == getattr(before, counted) and getattr(before, counted)
    for name in ("working", "gathered", "cast"):
        assert getattr(before, name) > 0 and getattr(after, name) == pytest.approx(share * getattr(before, name))
    table = before.head_grouped[0]
    assert table > 0 and after.head == pytest.approx(table + share * (before.head - table))


@pytest.mark.parametrize("release, says", [((0, 0, 52), "XLA:TPU as the installed libtpu 0.0.52 compiles"),
                                           ((0, 0, 42, 1), "XLA:TPU as the installed libtpu 0.0.42.1 compiles"),
                                           (None, "XLA:TPU as libtpu before 0.0.52 compiles (libtpu is not "
                                                  "installed here)")])
def test_the_plan_says_which_release_it_is_for(monkeypatch, release, says) -> None:
    """A TPU plan made where libtpu is absent (a laptop) takes the older releases' constants: the printout says so,
    since the TPU may run 0.0.52, whose plan is a quarter smaller for most steps."""
    monkeypatch.setattr(fitted, "libtpu_release", lambda: release)
    target = topologies.parse("v5litepod-8")
    plan = estimate.make_plan(load_for_target(["configs/base.yml", *LORA], target), target)
    assert f"  planned for {says}" in printout.format_plan(plan).splitlines()
    assert printout.plan_json(plan)["planned_for"] == says
