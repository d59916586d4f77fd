"""`python -m maxshard.plan --search`: the layouts it ranks fit, are ordered by planned step time, load as printed,
and the best one's planned peak holds up against a compile of that layout.

The acceptance case is the 8B preset on one h100-80gb-8 node. Its best layout is compiled for the 8 simulated CPU
devices from abstract inputs (nothing is allocated; ~15 s here): XLA:CPU's per-device peak, arguments + temporaries +
outputs - aliased, must be under the node's capacity too. The CPU compile runs attention=blockwise where the H100
plan has cudnn (no cuDNN on CPU; the planner counts cudnn as blockwise plus its mask), both in bfloat16.
The other tests search the tiny model with some keys pinned on the command line, which keeps them to a few
candidates.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import flax.linen as nn
import jax
import pytest
from helpers import TINY, mesh_for, tiny_config
from test_plan import _compile, _plan_tool

from benchmarks import sweep_spec
from maxshard import config
from maxshard.errors import ConfigError
from maxshard.launch import topologies
from maxshard.parallel import mesh
from maxshard.planning import estimate, hardware
from maxshard.planning.compiled import peak_bytes
from maxshard.run import loading, search
from maxshard.run import target as run_target
from maxshard.run.layouts import Layout
from maxshard.units import format_bytes

REPO = Path(__file__).resolve().parent.parent
H100 = topologies.parse("h100-80gb-8")
BASE_8B = ["configs/base.yml", "model_name=8b"]
# The tiny model with the tensor axes, the pipeline and remat pinned: fsdp x data x sequence x context remain.
TINY_PINNED = ["configs/base.yml", *(t for t in TINY if not t.startswith("remat_policy=")),
               "ici_tensor_parallelism=1", "ici_tensor_sequence_parallelism=1", "ici_pipeline_parallelism=1",
               "remat_policy=full"]


@pytest.fixture(scope="module")
def result_8b() -> search.SearchResult:
    lines: list[str] = []
    result = search.search(BASE_8B, H100, progress=lines.append)
    ends = [line for line in lines if re.search(r" (\d+)/\1;", line)]  # the last line of each round
    rounds = [re.sub(r" \d+/\d+;.*", "", line) for line in ends]
    assert rounds == ["search: meshes (remat_policy=full)", "search: other remat policies"]
    assert sum(int(re.search(r"/(\d+);", line)[1]) for line in ends) == result.considered
    print(f"8b on h100-80gb-8: {result.considered} candidates, {result.planned} valid, {len(result.fitting)} fit, "
          f"{result.seconds:.1f} s")
    return result


def _layout_of(cfg: config.Config) -> tuple:
    shape = mesh.resolve_shape(cfg)
    pipe = cfg.model.pipeline
    return shape.ici, shape.dcn, cfg.remat_policy, pipe.microbatches if pipe is not None else 0


def _as_layout(layout: Layout) -> tuple:
    return layout.ici, layout.dcn, layout.remat_policy, layout.microbatches


# --------------------------------------------------------------------------------------------- 8B on one node


def test_8b_layouts_that_fit_ranked_by_step_time(result_8b: search.SearchResult) -> None:
    fitting = result_8b.fitting
    # JAX's share of an H100 80GB (75% of 79.2 GiB allocatable), less 10% headroom: 53.5 GiB
    assert fitting and result_8b.capacity == pytest.approx(hardware.device_memory("h100-80gb-8")[0] * 0.9)
    assert result_8b.capacity == pytest.approx((81559 - 458) * 2**20 * 0.75 * 0.9)
    assert all(c.peak <= result_8b.capacity for c in fitting)
    keys = [(c.step_s, c.peak) for c in fitting]
    assert keys == sorted(keys)
    assert fitting[0].step_s < fitting[-1].step_s  # not one tie: pipeline bubbles and slower axes rank lower
    assert result_8b.seconds < 60, result_8b.seconds  # ~13 s on an idle 2-core machine
    for c in fitting:  # the search never changes the model or the global batch
        assert c.plan.cfg.global_batch_size == 16 and c.plan.cfg.num_layers == 32 and c.plan.cfg.emb_dim == 4096

    # A layout that was planned but does not fit is left out: saving every activation of 32 layers of 2 x 8192
    # tokens needs more than the GPU's 53.5 GiB.
    heavy = _plan_tool().plan_for([*BASE_8B, "remat_policy=none"], "h100-80gb-8")
    assert heavy.peak_bytes > result_8b.capacity
    assert all(c.layout.remat_policy != "none" for c in fitting)
    assert result_8b.invalid and sum(result_8b.invalid.values()) + result_8b.planned == result_8b.considered

    # The first round tries every mesh with remat_policy=full only and drops those that do not fit: sound when no
    # policy plans less memory than full on the same mesh, as here on every mesh that fits.
    assert result_8b.unrefined == 0  # and on one node every fitting mesh got every policy: exhaustive
    full = {c.layout: c.peak for c in fitting if c.layout.remat_policy == "full"}
    others = [c for c in fitting if c.layout.remat_policy != "full"]
    assert others and {c.layout.remat_policy for c in others} >= {"save_out_proj", "save_qkv_proj"}
    assert all(c.peak >= full[dataclasses.replace(c.layout, remat_policy="full")] for c in others)


def test_8b_best_layout_compiles_under_capacity_on_8_devices(result_8b: search.SearchResult) -> None:
    """The best layout compiled for 8 simulated CPU devices, in float32: XLA:CPU emulates bfloat16 through float32
    temporaries (tests/test_plan_memory.py), so the CPU's own dtype is what its compile can check. The float32
    twin's planned peak must be within 15% of its compiled peak, and that compiled peak, scaled to bfloat16 by the
    plan's own ratio (the scaled capacity), must fit the node."""
    best = result_8b.fitting[0]
    argv = [*BASE_8B, "dtype=float32", "attention=blockwise", *best.overrides]
    cfg = loading.complete(config.finalize(config.parse(argv), 8))
    assert _as_layout(best.layout) == _layout_of(cfg)
    compiled = peak_bytes(_compile(cfg, mesh_for(cfg)).memory_analysis())
    planned = estimate.make_plan(cfg).peak_bytes
    print(f"best {best.layout.label}: planned {format_bytes(best.peak)} (H100, bfloat16, cudnn); float32 on CPU "
          f"(blockwise): planned {format_bytes(planned)}, compiled {format_bytes(compiled)}, planned / compiled "
          f"{planned / compiled:.2f}; capacity {format_bytes(result_8b.capacity)}")
    assert abs(planned / compiled - 1) <= 0.15
    assert compiled * best.peak / planned <= result_8b.capacity


def test_8b_pasted_overrides_load_as_that_layout_in_the_trainer(result_8b: search.SearchResult) -> None:
    """`python -m maxshard.train CONFIG <overrides> <pasted>` on the node: the trainer's own loading, its 8 GPUs
    given as the count and kind JAX would report."""
    fitting = result_8b.fitting
    chosen = fitting[:5]
    chosen += [next(c for c in fitting if any(o.startswith("num_pipeline_microbatches=") for o in c.overrides))]
    chosen += [next(c for c in fitting if c.layout.remat_policy != "full")]
    user = run_target.load_for_target(BASE_8B, H100)  # remat_policy: auto, decided for the node's HBM
    # the search's best is the mesh as given (fsdp=8) with the policy auto decides there
    assert chosen[0].layout.remat_policy == user.remat_policy == "save_qkv_out_proj"
    assert chosen[0].overrides in ((), ("remat_policy=save_qkv_out_proj",))
    for c in chosen:
        cfg = loading.load_run([*BASE_8B, *c.overrides], num_devices=8, device_kind=H100.device_kind, check_fit=False)
        assert _layout_of(cfg) == _as_layout(c.layout), c.overrides


# --------------------------------------------------------------------------------------------- the tool


def test_overrides_reproduce_layouts_across_two_nodes() -> None:
    """dcn knobs too: base.yml fills dcn_data with -1, which the overrides leave alone when it fills right."""
    argv = [*TINY_PINNED, "num_slices=2"]
    target = topologies.parse("h100-80gb-8", 2)
    result = search.search(argv, target)
    across = {mesh.describe(dict(zip(config.MESH_AXES, c.layout.dcn))) for c in result.fitting}
    assert across == {"data=2", "fsdp=2", "stage=2"}  # ici_pipeline is pinned, dcn_pipeline is not
    for c in result.fitting:
        assert not any(o.startswith(("ici_tensor", "ici_pipeline", "remat_policy")) for o in c.overrides)
        cfg = loading.load_run([*argv, *c.overrides], num_devices=16, device_kind=target.device_kind, check_fit=False)
        assert _layout_of(cfg) == _as_layout(c.layout), c.overrides


def test_a_budget_refines_the_fastest_meshes_and_refuses_a_first_round_beyond_it() -> None:
    argv = [*TINY_PINNED[:-1]]  # remat_policy free: 6 policies
    whole = search.search(argv, H100)
    meshes = [c for c in whole.fitting if c.layout.remat_policy == "full"]
    assert whole.unrefined == 0 and len(whole.fitting) == 6 * len(meshes)  # the tiny model fits with every policy
    first_round = whole.considered - 5 * len(meshes)
    small = search.search(argv, H100, max_candidates=first_round + 2 * 5)  # room for 2 meshes x 5 more policies
    assert small.unrefined == len(meshes) - 2
    refined = {dataclasses.replace(c.layout, remat_policy="full") for c in small.fitting if c.layout.remat_policy
               != "full"}
    assert refined == {c.layout for c in meshes[:2]}  # the 2 fastest of the first round
    with pytest.raises(ConfigError, match="candidate meshes \\(more than --max-candidates 3\\); pin"):
        search.search(argv, H100, max_candidates=3)


def test_nothing_fits_prints_one_line_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    tool = _plan_tool()
    flags = ["--search", "--topology", "h100-80gb-8", "--headroom", "0.99999999"]  # 800 bytes per device
    assert tool.main([*TINY_PINNED, *flags, "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    closest, capacity = printed["closest"], printed["capacity_bytes"]
    assert printed["candidates"] == [] and capacity == pytest.approx(hardware.device_memory("h100-80gb-8")[0] * 1e-8)
    assert tool.main([*TINY_PINNED, *flags]) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"plan: no layout fits {format_bytes(capacity)} per device")
    assert closest["layout"] == "fsdp=8 remat=full" and closest["overrides"] == []  # the least memory: as given
    assert "the closest, fsdp=8 remat=full (the config as given), plans" in out
    assert f"{format_bytes(closest['peak_bytes'] - capacity)} over" in out


def test_sweep_file_reads_back_as_the_suggested_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "suggested.yml"
    code = _plan_tool().main([*TINY_PINNED, "--search", "--topology", "h100-80gb-8", "--top", "3", "--json",
                              "--sweep-out", str(path)])
    assert code == 0
    suggested = json.loads(capsys.readouterr().out)["candidates"]
    sweep = sweep_spec.load_sweep(str(path))
    assert [p.name for p in sweep.points] == [c["name"] for c in suggested] and len(suggested) == 3
    assert sweep.base_config == "configs/base.yml" and sweep.xpk == {"device_type": "h100-80gb-8", "num_slices": 1}
    user = dict(token.split("=", 1) for token in TINY_PINNED[1:])
    assert {k: sweep_spec.format_value(v) for k, v in sweep.fixed.items()} == user
    for point, c in zip(sweep.points, suggested):
        argv = [sweep.base_config, *sweep_spec.overrides_argv(sweep.merged(point))]
        cfg = run_target.load_for_target(argv, H100)
        assert mesh.axis_sizes(cfg) == c["mesh"] and cfg.remat_policy == c["remat_policy"]


def test_a_mistake_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    tool = _plan_tool()
    assert tool.main([*TINY_PINNED, "--search", "--topology", "h100-80gb-8", "--headroom", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("plan: error: --headroom must be in [0, 1)")
    assert tool.main(["configs/base.yml", "--topology", "h100-80gb-8", "--sweep-out", "x.yml"]) == 2
    assert "add --search" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- what makes it fast


def test_config_files_are_read_once_only_inside_the_block(tmp_path: Path) -> None:
    path = tmp_path / "run.yml"
    path.write_text(f"base_config: {REPO / 'configs' / 'base.yml'}\nsteps: 7\n")
    with config.reading_files_once():
        assert config.parse([str(path)]).steps == 7
        path.write_text(f"base_config: {REPO / 'configs' / 'base.yml'}\nsteps: 9\n")
        assert config.parse([str(path)]).steps == 7  # the first read, copied: base_config popped from a copy
    assert config.parse([str(path)]).steps == 9


def test_the_train_state_shapes_are_traced_once_per_model() -> None:
    """Mesh knobs and the remat policy change where the state lives and what the backward pass recomputes, not the
    state's shapes: one trace serves every layout and policy of a model (`remat_policy: auto` plans under `full`, then
    the trainer asks for the chosen policy's state), while a pipeline (its stage count is in the model) gets its own."""
    from maxshard.training.step import abstract_state

    fsdp = tiny_config("ici_fsdp_parallelism=8")
    assert abstract_state(fsdp) is abstract_state(tiny_config("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"))
    assert abstract_state(tiny_config("ici_fsdp_parallelism=8", "remat_policy=none")) is abstract_state(fsdp)
    staged = tiny_config("ici_fsdp_parallelism=4", "ici_pipeline_parallelism=2")
    shapes = lambda cfg: jax.tree.map(lambda leaf: leaf.shape, nn.unbox(abstract_state(cfg).params))  # noqa: E731
    assert shapes(staged) != shapes(fsdp)
    assert abstract_state(tiny_config("ici_fsdp_parallelism=8", "emb_dim=32")) is not abstract_state(fsdp)
