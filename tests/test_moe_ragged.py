"""The ragged expert-parallel exchange of dropless MoE (`maxshard/model/layers/moe_ragged.py`), computed on CPU.

XLA:CPU has no ragged all-to-all; here the collective is its emulation (`layers/ragged_all_to_all.py`, tested
against the op's contract in tests/test_ragged_all_to_all.py), and the XLA:TPU program with the real one is compiled
in tests/test_tpu_aot.py. The sizes and offsets each device computes (`moe_ragged.plan`) are checked for what
`jax.lax.ragged_all_to_all` requires of them (every sender's sizes equal its receivers'), for the layout they
promise (each receiver's buffer packed, sorted by local expert, never past its rows) and for the overflow rule; then,
on the 8 CPU devices (expert=4 x fsdp=2), against the fixed exchange itself: the rows the offsets name are, row for
row, the buffer the fixed exchange's all_to_all delivers and sorts (`moe_grouped._fixed_there`), and the way back
names every row's origin (row moves read off the offsets on the host, following the collective's documented
semantics). Then the dropless layer with the ragged exchange runs: with the buffer no routing overflows its output
and gradients are the fixed exchange's, and with a small one it drops exactly what the overflow rule says.

Last, the config users run: an explicit `moe_exchange=ragged` on CPU loads (`loading.load_run`) and runs through the
stand-in, named in one startup line (`run/stand_ins.py`); a whole model's step (loss, router statistics, gradients)
is the fixed exchange's on expert=4 x fsdp=2 and inside a pipeline (stage x expert x fsdp), and `maxshard.train`
trains it.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maxshard import train
from maxshard.errors import ConfigError
from maxshard.generation import decode
from maxshard.model.layers import moe_grouped, moe_ragged, ragged_all_to_all
from maxshard.parallel import axis_names as ax
from maxshard.parallel import sharding
from maxshard.run import loading
from maxshard.run.stand_ins import stand_ins
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import layout_overrides, max_relative_difference, mesh_for, ragged_all_to_all_reference, tiny_config

P_, E, K, TOKENS, WIDTH = 4, 8, 2, 16, 4  # expert shards, experts, top-k, tokens per device, embed
LOCAL = E // P_
WORST = moe_ragged.buffer_rows(TOKENS, K, E, P_, 0.0)
RAGGED_LINE = ("moe_exchange=ragged: XLA:CPU has no ragged all-to-all; using its CPU stand-in (same contract, "
               "slower)")


# --------------------------------------------------------------------------------------------- sizes and offsets


def test_buffer_rows_are_the_balanced_share_times_the_factor_at_most_the_worst_case():
    assert WORST == 4 * 16 * 2  # P x T x min(k, E_l)
    assert moe_ragged.buffer_rows(16, 2, 8, 4, 1.5) == 48  # 1.5 x 16 x 2
    assert moe_ragged.buffer_rows(5, 2, 8, 4, 1.0) == 16  # 10 rows rounded up to a multiple of 8
    assert moe_ragged.buffer_rows(16, 2, 8, 4, 100.0) == WORST
    assert moe_ragged.buffer_rows(16, 8, 64, 32, 0.0) == 32 * 16 * 2  # E_l = 2 < k: at most 2 rows a token


def _plans(counts: np.ndarray, rows: int) -> moe_ragged.Plan:
    """Every device's plan, stacked on a leading device axis."""
    counts = jnp.asarray(counts, jnp.int32)
    return jax.jit(jax.vmap(lambda d: moe_ragged.plan(counts, d, rows)))(jnp.arange(counts.shape[0]))


def test_worked_example_of_the_docstring():
    """2 devices, 4 experts, 5 rows: source 1's rows to device 0 and 2 of its 4 to device 1 do not fit."""
    counts = np.array([[3, 2, 2, 1], [1, 1, 3, 1]])
    np.testing.assert_array_equal(moe_ragged.taken(jnp.asarray(counts), 5),
                                  [[[3, 2], [2, 1]], [[0, 0], [2, 0]]])  # [source, receiver, local expert]
    plans = _plans(counts, 5)
    np.testing.assert_array_equal(plans.there.output_offsets[0], [0, 3, 0, 4])  # device 0's blocks at 0 and 1
    np.testing.assert_array_equal(plans.there.output_offsets[1], [3, 5, 2, 5])
    np.testing.assert_array_equal(plans.local_sizes, [[3, 2], [4, 1]])
    np.testing.assert_array_equal(plans.unsent, [0, 4])


def _skewed_counts(rng: np.random.Generator) -> np.ndarray:
    """[P sources, E] rows per expert, most of them for device 0's experts."""
    return rng.multinomial(TOKENS * K, [0.3, 0.25] + [0.075] * 6, size=P_)


@pytest.mark.parametrize("rows", [WORST, 48, 32, 8])
def test_the_tables_fit_the_collective_and_pack_each_buffer(rows):
    rng = np.random.default_rng(rows)
    for counts in (_skewed_counts(rng), rng.multinomial(TOKENS * K, [1 / E] * E, size=P_)):
        p = jax.tree.map(lambda a: np.asarray(a).reshape(P_, P_, LOCAL), _plans(counts, rows)[:2])  # [device, peer, j]
        there, back = p
        # ragged_all_to_all's contract: what device d sends peer r is what r expects from d, both ways.
        np.testing.assert_array_equal(there.send_sizes, there.recv_sizes.transpose(1, 0, 2))
        np.testing.assert_array_equal(back.send_sizes, back.recv_sizes.transpose(1, 0, 2))
        # The way back is the transpose of the way there.
        np.testing.assert_array_equal(back.input_offsets, there.output_offsets.transpose(1, 0, 2))
        np.testing.assert_array_equal(back.output_offsets, there.input_offsets.transpose(1, 0, 2))
        taken = there.send_sizes  # [source, receiver, j]
        assert np.all(taken <= counts.reshape(P_, P_, LOCAL))  # a prefix of each sender's block
        for r in range(P_):
            layout = [(j, s) for j in range(LOCAL) for s in range(P_)]  # expert-major, then source
            sizes = np.array([taken[s, r, j] for j, s in layout])
            np.testing.assert_array_equal([there.output_offsets[s, r, j] for j, s in layout], np.cumsum(sizes) - sizes)
            assert sizes.sum() <= rows
            cut = [s for s in range(P_) if taken[s, r].sum() < counts[s, r * LOCAL:(r + 1) * LOCAL].sum()]
            assert all(taken[s, r].sum() == 0 for s in range(P_) if cut and s > cut[0])  # source-major: later lose
        unsent = np.asarray(_plans(counts, rows).unsent)
        assert unsent.sum() == counts.sum() - taken.sum()
        if rows == WORST:
            assert unsent.sum() == 0


# --------------------------------------------------------------------------------------------- against the fixed


def _routing(rng: np.random.Generator, devices: int, skew: tuple[float, float] = (0.3, 0.25)
             ) -> tuple[np.ndarray, np.ndarray]:
    """x [devices x TOKENS, WIDTH] (small positive integers) and distinct top-k experts [.., K], skewed
    towards device 0's experts (`skew`: the chance of e0 and e1); the last 3 tokens of every device are padding
    (expert id E)."""
    x = rng.integers(1, 100, (devices * TOKENS, WIDTH)).astype(np.float32)  # no all-zero row
    probs = np.array([*skew] + [(1 - sum(skew)) / (E - 2)] * (E - 2))
    experts = np.stack([rng.choice(E, K, replace=False, p=probs) for _ in range(devices * TOKENS)]).astype(np.int32)
    experts.reshape(devices, TOKENS, K)[:, -3:] = E
    return x, experts


def _exchanged(x: np.ndarray, experts: np.ndarray, rows: int) -> dict:
    """Per device of an expert=4 x fsdp=2 mesh, [fsdp, expert, ...]: its sorted rows, the fixed exchange's sorted
    received buffer and local sizes, and the ragged plan (sizes gathered over `expert`, this device's index)."""
    mesh = jax.make_mesh((2, P_), ("fsdp", "expert"), devices=jax.devices()[:8])
    axis = ("expert",)

    def body(x: jax.Array, experts: jax.Array) -> dict:
        order, sizes = moe_grouped._sort(experts.reshape(-1), E)
        sent = x[order // K]
        received, fixed = moe_grouped._fixed_there(sent, experts.reshape(-1)[order], sizes, LOCAL,
                                                   moe_grouped.exchange_slots(TOKENS, K, LOCAL), axis, P_)
        plan = moe_ragged.plan(jax.lax.all_gather(sizes, axis), jax.lax.axis_index(axis), rows)
        out = {"sent": sent, "fixed": received, "fixed_sizes": fixed.local_sizes, "plan": plan, "sizes": sizes}
        return jax.tree.map(lambda a: a[None], out)

    spec = PartitionSpec(("fsdp", "expert"))
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    sharded = jax.device_put((x, experts), jax.sharding.NamedSharding(mesh, spec))
    out = jax.device_get(run(*sharded))
    return jax.tree.map(lambda a: a.reshape(2, P_, *a.shape[1:]), out)


def _move(operands: list[np.ndarray], out_rows: int, slices: list[moe_ragged.Slices]) -> list[np.ndarray]:
    """The rows `jax.lax.ragged_all_to_all` moves into zeros, read off the slices as its docstring specifies."""
    outputs = [np.zeros((out_rows, operands[0].shape[1]), operands[0].dtype) for _ in operands]
    return ragged_all_to_all_reference(operands, outputs, [tuple(np.asarray(a) for a in s) for s in slices])


@pytest.fixture(scope="module")
def routed():
    return _routing(np.random.default_rng(0), 8)


def test_offsets_deliver_the_fixed_exchanges_buffer_row_for_row(routed):
    """Worst-case buffer: the ragged buffer is the fixed exchange's received buffer after its local sort, bitwise;
    the way back returns every routed row to where it came from."""
    out = _exchanged(*routed, WORST)
    for group in range(2):  # each fsdp index is one exchange over the 4 expert shards
        plan = jax.tree.map(lambda a: a[group], out["plan"])
        sent = list(out["sent"][group])
        per_device = lambda tree: [jax.tree.map(lambda a: a[d], tree) for d in range(P_)]  # noqa: E731
        received = _move(sent, WORST, per_device(plan.there))
        for d in range(P_):
            np.testing.assert_array_equal(received[d], out["fixed"][group, d])
        np.testing.assert_array_equal(plan.local_sizes, out["fixed_sizes"][group])
        returned = _move(received, TOKENS * K, per_device(plan.back))
        for d in range(P_):
            real = out["sizes"][group, d].sum()
            np.testing.assert_array_equal(returned[d][:real], sent[d][:real])
            assert not returned[d][real:].any()  # padding assignments were never sent


def test_a_small_buffer_keeps_a_prefix_of_each_block_and_counts_the_rest(routed):
    """24 rows of the ~32 a device gets on average (device 0 gets ~70): what fits is the fixed buffer less the tail
    of each (source, expert) block the rule cut, and each assignment left home comes back zero and is counted."""
    rows = 24
    out = _exchanged(*routed, rows)
    for group in range(2):
        plan = jax.tree.map(lambda a: a[group], out["plan"])
        per_device = lambda tree: [jax.tree.map(lambda a: a[d], tree) for d in range(P_)]  # noqa: E731
        sent = list(out["sent"][group])
        received = _move(sent, rows, per_device(plan.there))
        taken = plan.there.recv_sizes.reshape(P_, P_, LOCAL)  # [receiver, source, j]
        counts = out["sizes"][group].reshape(P_, P_, LOCAL)  # [source, receiver, j]
        for r in range(P_):
            keep = np.concatenate([np.arange(counts[s, r, j]) < taken[r, s, j] for j in range(LOCAL)
                                   for s in range(P_)])
            fixed = out["fixed"][group, r]
            np.testing.assert_array_equal(received[r][:keep.sum()], fixed[:keep.size][keep])
            assert not received[r][keep.sum():].any()
        returned = _move(received, TOKENS * K, per_device(plan.back))
        for d in range(P_):
            real = out["sizes"][group, d].sum()
            home = ~returned[d][:real].any(axis=1)  # rows that came back zero (x has no zero row)
            assert home.sum() == plan.unsent[d]
            np.testing.assert_array_equal(returned[d][:real][~home], sent[d][:real][~home])
        assert plan.unsent.sum() > 0  # the test can fail: this routing overflows device 0


# --------------------------------------------------------------------------------------------- computed on CPU


@pytest.fixture(scope="module")
def layer_mesh():
    """The mesh and rules of expert=4 x fsdp=2 (the MoE parity tests' layout), and where each token lives on it."""
    cfg = tiny_config(*layout_overrides(["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]))
    mesh, rules = mesh_for(cfg), sharding.flax_rules(cfg)
    return mesh, rules


@functools.cache
def _dropless_grads(exchange: str, factor: float):
    """jit of ((loss, (y, dropped)), gradients w.r.t. x, weights and kernels) of the dropless layer (tiled)."""

    def loss(x, weights, kernels, experts):
        y, dropped = moe_grouped.dropless(x, experts, weights, kernels, "tiled", exchange, factor)
        return jnp.sum(y * jnp.cos(3.0 * y)), (y, dropped)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.fixture(scope="module")
def layer_inputs():
    """x [8, TOKENS, WIDTH], weights and experts [8, TOKENS, K] (one row per device; ~80% of the assignments on
    device 0's experts, so a small buffer there overflows by whole sources), and SwiGLU kernels of E experts."""
    rng = np.random.default_rng(3)
    experts = _routing(rng, 8, skew=(0.45, 0.35))[1].reshape(8, TOKENS, K)
    x = rng.normal(size=(8, TOKENS, WIDTH)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (8, TOKENS, K)).astype(np.float32)
    kernels = tuple(rng.normal(size=s).astype(np.float32) / 2 for s in ((E, WIDTH, 8), (E, WIDTH, 8), (E, 8, WIDTH)))
    return x, weights, kernels, experts


def _run_dropless(layer_mesh, inputs, exchange: str, factor: float = 0.0):
    mesh, rules = layer_mesh
    with mesh_context(mesh, rules):
        (_, (y, dropped)), grads = _dropless_grads(exchange, factor)(*inputs)
    return jax.device_get((y, int(dropped), grads))


def test_the_ragged_exchange_computes_the_fixed_exchanges_numbers(layer_mesh, layer_inputs):
    """On CPU through the emulated collective (`layers/ragged_all_to_all.py`): with the buffer no routing overflows
    (factor 0), output and gradients (input, router weights, kernels) equal the fixed exchange's."""
    fixed_y, fixed_dropped, fixed_grads = _run_dropless(layer_mesh, layer_inputs, "all_to_all")
    y, dropped, grads = _run_dropless(layer_mesh, layer_inputs, "ragged", 0.0)
    assert dropped == fixed_dropped == 0
    assert max_relative_difference(y, fixed_y) < 1e-5
    assert max_relative_difference(grads, fixed_grads) < 1e-5
    assert np.abs(np.asarray(grads[2][0])).min(axis=(1, 2)).max() > 0  # every expert's kernel has gradient


def _device_rows(layer_mesh, shape: tuple[int, ...]) -> dict[tuple[int, int], tuple[slice, ...]]:
    """{(fsdp index, expert index): the token block of [batch, length, ...] that device holds in the layer}."""
    mesh, rules = layer_mesh
    with mesh_context(mesh, rules):
        spec = sharding.partition_spec([*sharding.active_mesh_axes(ax.TOKENS)[:2], ()])
    blocks = NamedSharding(mesh, spec).devices_indices_map(shape)
    names = mesh.axis_names
    where = {d: dict(zip(names, np.argwhere(mesh.devices == d)[0])) for d in mesh.devices.flat}
    return {(int(where[d]["fsdp"]), int(where[d]["expert"])): block for d, block in blocks.items()}


def _kept_by_the_rule(experts: np.ndarray, rows: int) -> np.ndarray:
    """experts [P devices of one exchange, n assignments] -> kept [P, n] by moe_ragged's rule, read off its
    docstring: each receiver's buffer of `rows` filled source-major, then by local expert, each block a prefix of
    that source's rows for that expert (stable sort: assignment order); padding (id E) neither kept nor counted."""
    kept = np.zeros(experts.shape, bool)
    for receiver in range(P_):
        room = rows
        for source in range(P_):
            for j in range(LOCAL):
                mine = np.flatnonzero(experts[source] == receiver * LOCAL + j)
                fits = min(len(mine), room)
                kept[source, mine[:fits]], room = True, room - fits
    return kept


def test_an_overflowing_buffer_drops_exactly_the_rule_and_computes_the_rest(layer_mesh, layer_inputs):
    """Factor 1.5 (48 rows; the skewed routing sends device 0 ~80): the dropped count is the one the overflow rule
    gives from the routing alone, and the output is the fixed exchange's with those assignments' weights zeroed."""
    x, weights, kernels, experts = layer_inputs
    rows = moe_ragged.buffer_rows(TOKENS, K, E, P_, 1.5)
    assert rows == 48
    placed = _device_rows(layer_mesh, experts.shape)
    kept = np.zeros(experts.shape, bool)
    for group in range(2):
        flat = np.stack([experts[placed[group, d]].reshape(-1) for d in range(P_)])
        for d, keep in enumerate(_kept_by_the_rule(flat, rows)):
            kept[placed[group, d]] = keep.reshape(experts[placed[group, d]].shape)
    expected_dropped = int(np.sum(experts < E) - kept.sum())
    assert expected_dropped > 0  # the test can fail: this routing overflows device 0

    y, dropped, _ = _run_dropless(layer_mesh, layer_inputs, "ragged", 1.5)
    assert dropped == expected_dropped
    without = _run_dropless(layer_mesh, (x, np.where(kept, weights, 0), kernels, experts), "all_to_all")[0]
    assert max_relative_difference(y, without) < 1e-5


# --------------------------------------------------------------------------------------------- selection


@pytest.mark.parametrize("device_kind, exchange", [("cpu", "all_to_all"), ("TPU v5p", "ragged"),
                                                   ("NVIDIA H100 80GB HBM3", "ragged")])
def test_auto_exchange_is_ragged_on_tpu_and_gpu_only(device_kind, exchange):
    cfg = dataclasses.replace(tiny_config("num_experts=8", "capacity_factor=-1"), device_kind=device_kind)
    assert loading.model_config(cfg).moe_exchange == exchange
    explicit = dataclasses.replace(cfg, moe_exchange="all_to_all")
    assert loading.model_config(explicit).moe_exchange == "all_to_all"  # an explicit choice is kept


def test_ragged_on_cpu_loads_through_the_users_path_and_is_named_the_stand_in():
    """`load_run`, where train and generate start, on this process's CPU devices: an explicit ragged exchange stays
    ragged (no refusal), and the startup lines name its stand-in once; `auto` there is the fixed exchange, no line."""
    argv = ["configs/base.yml", "model_name=tiny_moe", "capacity_factor=-1", "dataset_type=synthetic",
            *layout_overrides(["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"])]
    cfg = loading.load_run([*argv, "moe_exchange=ragged"])
    assert (cfg.device_kind, cfg.model.moe_exchange) == ("cpu", "ragged")
    assert [line for line in stand_ins(cfg) if line.startswith("moe_exchange=")] == [RAGGED_LINE]
    auto = loading.load_run(argv)
    assert auto.model.moe_exchange == "all_to_all" and not stand_ins(auto)


def test_a_bad_exchange_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match="moe_exchange") as info:
        tiny_config("num_experts=8", "moe_exchange=ragged_fast")
    assert "all_to_all" in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------- the model


# Every layer MoE, 8 dropless experts of top-2 with the grouped matmuls (auto on CPU), the balance loss on.
MOE_MODEL = ("num_layers=2", "num_experts=8", "num_experts_per_tok=2", "capacity_factor=-1",
             "moe_dropless_impl=tiled", "load_balance_loss_weight=0.01")
MODEL_LAYOUTS = {  # 8 simulated CPU devices; the pipeline's stages vmap the exchange (spmd_axis_name)
    "expert4_fsdp2": ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"),
    "pipeline2_expert2_fsdp2": ("ici_pipeline_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2",
                                "num_layers_per_pipeline_stage=1", "num_pipeline_microbatches=2"),
}


@pytest.mark.parametrize("layout", sorted(MODEL_LAYOUTS))
def test_the_model_computes_the_same_step_with_either_exchange(layout):
    """A config that changes only `moe_exchange` changes only the layout of the step: with the CPU stand-in of the
    ragged all-to-all the loss, router statistics and every gradient (float32) are the fixed exchange's, on the
    same parameters and packed batch, with nothing dropped (the default buffer no routing overflows)."""
    from tests.test_pipeline import packed_batch, random_params, small_config
    from tests.test_pipeline_runner_moe import sums_and_grads

    cfgs = {exchange: small_config(*MOE_MODEL, *layout_overrides(MODEL_LAYOUTS[layout]), f"moe_exchange={exchange}")
            for exchange in ("all_to_all", "ragged")}
    assert cfgs["ragged"].model.moe_exchange == "ragged" and RAGGED_LINE in stand_ins(cfgs["ragged"])
    trainer = Trainer(cfgs["ragged"], mesh_for(cfgs["ragged"]))
    params, batch = random_params(trainer), packed_batch(cfgs["ragged"], trainer.mesh)
    (fixed_sums, fixed_grads), (sums, grads) = (sums_and_grads(cfgs[e], params, batch) for e in cfgs)
    assert float(sums["moe_dropped"]) == float(fixed_sums["moe_dropped"]) == 0
    np.testing.assert_allclose(float(sums["loss_sum"]), float(fixed_sums["loss_sum"]), rtol=1e-5)
    assert max_relative_difference(sums, fixed_sums) < 1e-5
    assert max_relative_difference(grads, fixed_grads) < 1e-5
    assert float(sums["moe_lb_loss"]) > 0  # the router's statistics reach the sums


@pytest.mark.slow
def test_a_ragged_run_trains_on_cpu_through_the_cli(tmp_path, monkeypatch, capsys):
    """`maxshard.train` in this process, tiny_moe dropless with the ragged exchange over expert=4 x fsdp=2: the
    run starts (no refusal), its step exchanges through the CPU stand-in, and it logs finite losses for 2 steps."""
    traced = []

    def emulated(*args, **kwargs):
        traced.append(kwargs["axis_name"])
        return real(*args, **kwargs)

    real = ragged_all_to_all.emulated_ragged_all_to_all
    monkeypatch.setattr(ragged_all_to_all, "emulated_ragged_all_to_all", emulated)
    argv = ["configs/base.yml", "model_name=tiny_moe", "capacity_factor=-1", "moe_exchange=ragged",
            "dataset_type=synthetic", "per_device_batch_size=1", "steps=2", "log_period=1",
            "eval_period=0", "enable_checkpointing=false", "enable_tensorboard=false", "remat_policy=full",
            "run_name=ragged", f"base_output_directory={tmp_path}",
            *layout_overrides(["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"])]
    assert train.main(argv) == 0
    assert traced  # the step's trace went through the stand-in
    assert "moe_exchange=ragged: XLA:CPU has no ragged all-to-all; using its CPU stand-in" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "ragged" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and np.all(np.isfinite(losses)), losses


def test_generation_takes_the_buffer_no_routing_overflows():
    model = tiny_config("num_experts=8", "capacity_factor=-1", "moe_ragged_buffer_factor=1.5").model
    assert model.moe_ragged_buffer_factor == 1.5 and decode.decode_model(model).moe_ragged_buffer_factor == 0
    assert tiny_config("num_experts=8").model.moe_ragged_buffer_factor == 0  # the default never overflows
