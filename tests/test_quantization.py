"""`quantization: int8 | fp8` (maxshard/model/quantization.py, through qwix): the matmuls it names really run on 8-bit
operands in the train step, the others do not, the first step's gradients are the unquantized ones to 8-bit rounding
(and not exactly them), training still learns and stays close to the unquantized run, the CLI trains each mode, a
combination qwix cannot train is one ConfigError line, and the planner and MFU measure against the 8-bit peak.

The dots are read from the lowered StableHLO of the train step: every `stablehlo.dot_general` with its operand types
and its location, whose name stack carries the Flax module path (`layers/attention/attention._proj/query/...`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers import TINY, gradient_agreement, loss_and_grads, mesh_for, tiny_config

from maxshard import config, data, devices, train
from maxshard.errors import ConfigError
from maxshard.launch import topologies
from maxshard.model import flops as model_flops
from maxshard.model import quantization
from maxshard.model.layers import moe
from maxshard.observe import console
from maxshard import perf
from maxshard.planning import estimate, printout
from maxshard.planning.compiled import abstract_inputs
from maxshard.run import loading
from maxshard.run.target import load_for_target
from maxshard.training.step import Trainer, abstract_state
from tests.cuda_plugin import cuda_plugin, with_plugin  # noqa: F401 (cuda_plugin: a fixture)

# The projections by module path; the routed experts by qwix's QtProvider.ragged_dot in the call stack (jax lowers a
# ragged_dot on CPU to a dense dot without the module's name).
QUANTIZED = re.compile(
    r"/attention\._(proj|output)/(query|key|value|out)/|/(mlp|shared)/|QtProvider\.ragged_dot")
EIGHT_BIT = {"int8": {"i8"}, "fp8": {"f8E4M3FN", "f8E5M2"}}


def _element(type_text: str) -> str:
    """'tensor<16x32x64xi8>' -> 'i8'."""
    return re.fullmatch(r"tensor<(?:[\d?]+x)*(\w+)>", type_text).group(1)


def _walk(operation: object) -> Iterator[object]:
    for region in operation.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _walk(inner.operation)


def lowered_dot_types(*overrides: str) -> list[tuple[str, str, str]]:
    """(lhs type, rhs type, location) of every dot_general and ragged_dot in the train step of the tiny model with
    `overrides`, lowered on 8 CPU devices (fsdp); types as MLIR prints them ('tensor<16x32x64xi8>')."""
    cfg = tiny_config(*overrides)
    trainer = Trainer(cfg, mesh_for(cfg))
    batch_sharding = data.batch_sharding(cfg, trainer.mesh)
    module = trainer.jit_train_step(batch_sharding).lower(*abstract_inputs(trainer, batch_sharding)).compiler_ir()
    return [(str(op.operands[0].type), str(op.operands[1].type), str(op.location))
            for op in _walk(module.operation) if op.operation.name in ("stablehlo.dot_general", "chlo.ragged_dot")]


def lowered_dots(*overrides: str) -> list[tuple[str, str, str]]:
    """`lowered_dot_types` with element types only: (lhs, rhs, location), e.g. ('i8', 'i8', 'loc(...)')."""
    return [(_element(lhs), _element(rhs), where) for lhs, rhs, where in lowered_dot_types(*overrides)]


def split_by_rule(dots: list[tuple[str, str, str]]) -> tuple[list, list]:
    """(the dots of the quantized matmuls, all the others), by the module path in their location."""
    quantized = [d for d in dots if QUANTIZED.search(d[2])]
    return quantized, [d for d in dots if not QUANTIZED.search(d[2])]


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_the_attention_and_mlp_matmuls_run_on_8_bit_operands_and_nothing_else_does(mode: str) -> None:
    quantized, others = split_by_rule(lowered_dots(f"quantization={mode}"))
    # q, k, v, out, the stacked gate/up and wo: each forward, recomputed under remat=full, and its two gradients
    assert {re.search(r"/(query|key|value|out|mlp/wo|mlp/\.\.\.e,ekf)", d[2]).group(1) for d in quantized} == {
        "query", "key", "value", "out", "mlp/wo", "mlp/...e,ekf"}
    assert len(quantized) >= 6 * 3
    assert all({lhs, rhs} <= EIGHT_BIT[mode] for lhs, rhs, _ in quantized), quantized
    assert all("dot_general_qt" in where for _, _, where in quantized)  # qwix's quantized-training dot made them
    if mode == "fp8":  # forward: e4m3 x e4m3; backward: the incoming gradient e5m2 x the e4m3 forward operand
        backward = [d for d in quantized if "f8E5M2" in d[:2]]
        assert len(backward) == 12 and all(sorted(d[:2]) == ["f8E4M3FN", "f8E5M2"] for d in backward)
        assert all(d[:2] == ("f8E4M3FN", "f8E4M3FN") for d in quantized if d not in backward)
    # the output head and attention's scores and values stay in the compute dtype
    assert others and all(lhs == rhs == "f32" for lhs, rhs, _ in others), others
    assert any("logits" in d[2] for d in others) and any("bqhd,bkhd->bhqk" in d[2] for d in others)


def test_unquantized_runs_have_no_8_bit_dot() -> None:
    assert all(lhs == rhs == "f32" for lhs, rhs, _ in lowered_dots())


@pytest.mark.parametrize("overrides", [
    ("loss_chunks=2",),  # the step applies Transformer.hidden and .head, not __call__
    ("scan_layers=false",),
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_layers=4"),  # stages applied as their own root
    # the table runner applies each stage and the layer a pattern leaves over as roots of their own
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_layers=5", "num_layers_per_pipeline_stage=1",
     "attention_pattern=local,global", "sliding_window=3", "pipeline_schedule=1f1b"),
    ("num_experts=4", "num_experts_per_tok=2", "capacity_factor=0", "moe_dropless_impl=ragged_dot",
     "num_shared_experts=1"),
], ids=["loss_chunks", "unrolled", "pipeline", "pipeline_1f1b", "moe_ragged_dot"])
def test_every_entry_point_and_stack_is_quantized(overrides: tuple[str, ...]) -> None:
    dots = lowered_dots("quantization=int8", *overrides)
    quantized, others = split_by_rule(dots)
    assert len(quantized) >= 18 and all(lhs == rhs == "i8" for lhs, rhs, _ in quantized), quantized
    assert all(lhs != "i8" and rhs != "i8" for lhs, rhs, _ in others), others
    if "num_experts=4" in overrides:  # the routed experts (ragged_dot; a masked dense dot on CPU) and shared ones
        assert any(re.search(r"/moe/(moe\._shared/)?shared/", d[2]) for d in quantized)  # name stack: _shared
        assert sum("QtProvider.ragged_dot" in d[2] for d in quantized) >= 9, dots  # 3 forward, 6 backward
        assert any("/moe/gate/" in d[2] for d in others)  # the router stays float


@pytest.mark.parametrize("path", [("capacity_factor=1.25",), ("capacity_factor=0", "moe_dropless_impl=tiled"),
                                  ("capacity_factor=0", "moe_dropless_impl=dense")], ids=["dropping", "tiled", "dense"])
def test_the_routed_experts_run_on_8_bit_operands_on_every_moe_path(path: tuple[str, ...]) -> None:
    """The experts' einsums (by their subscripts, in the dot's location) are int8 on the dropping, tiled dropless and
    dense paths; the MoE layer's other einsums (dispatch, combine, routing statistics) and its router stay float,
    though they run in the same module (qwix_training.Provider)."""
    dots = lowered_dots("quantization=int8", "num_experts=4", "num_experts_per_tok=2", *path)
    experts = [d for d in dots if any(f'"{eq}/' in d[2] or f"/{eq}/" in d[2] for eq in moe.EXPERT_EINSUMS)]
    assert len(experts) >= 9 and all(lhs == rhs == "i8" for lhs, rhs, _ in experts), experts  # 3 x (fwd + 2 bwd)
    routed = [d for d in dots if ("/moe/" in d[2] or "tkm,tk->tm" in d[2]) and d not in experts]
    assert routed and all(lhs == rhs == "f32" for lhs, rhs, _ in routed), routed
    assert any("/moe/gate/" in d[2] for d in routed)


def test_lora_adapters_stay_in_the_compute_dtype_beside_their_8_bit_kernels() -> None:
    """Under LoRA the frozen kernels' matmuls are quantized and the adapters' thin ones (rank 3 here, a size no other
    dimension has) are not, though they run in the same module (qwix_training.Provider)."""
    dots = lowered_dot_types("quantization=int8", "lora_rank=3", "lora_targets=[q,k,v,o,gate,up,down]")
    adapter = re.compile(r"[<x]3x")  # a dimension of size 3: the adapter's rank
    in_projections = [d for d in dots if QUANTIZED.search(d[2]) or "/mlp/wi_" in d[2]]
    adapters = [d for d in in_projections if adapter.search(d[0]) or adapter.search(d[1])]
    kernels = [d for d in in_projections if d not in adapters]
    assert len(adapters) >= 2 * 7 and all(_element(lhs) == _element(rhs) == "f32" for lhs, rhs, _ in adapters)
    assert len(kernels) >= 6 and all(_element(lhs) == _element(rhs) == "i8" for lhs, rhs, _ in kernels), kernels


def _train(mode: str, steps: int) -> list[float]:
    cfg = tiny_config(f"quantization={mode}", num_devices=1)
    trainer = Trainer(cfg, mesh_for(cfg))
    step = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))
    state, batches, losses = trainer.init_state(), data.make_input(cfg, trainer.mesh), []
    for _ in range(steps):
        state, metrics = step(state, next(batches))
        losses.append(metrics["loss"])
    return [float(x) for x in jax.device_get(losses)]


@pytest.fixture(scope="module")
def unquantized_losses() -> list[float]:
    return _train("none", 40)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_training_learns_and_stays_close_to_the_unquantized_run(mode: str, unquantized_losses) -> None:
    """40 steps of the tiny model on the synthetic progressions (one device), same seed and batches. Measured (jax
    0.10.2, qwix 0.1.8): the loss falls 6.5 -> 1.0 in every mode; the mean of the last 10 steps is 0.05% (int8) and
    0.5% (fp8) above the unquantized run's. Most of its 10-20 s is compiling the init and the step."""
    losses = _train(mode, 40)
    assert losses[-1] < 0.6 * losses[0]
    tail, reference = np.mean(losses[-10:]), np.mean(unquantized_losses[-10:])
    assert abs(tail / reference - 1) < 0.02, (tail, reference)
    assert losses != unquantized_losses  # the 8-bit rounding is really there


# The first step's gradients of a quantized run against the unquantized ones (fresh init, same seed, same batch):
# the cosine must stay close to 1, and the relative error must be above float noise (the 8-bit rounding is there)
# and below the mode's ceiling. int8's ceiling is 5%; fp8's is the unit roundoff of its e5m2 gradients, 2^-3: with
# 2 mantissa bits each rounding of an incoming gradient errs by up to 12.5% (7% RMS), and the measured error of the
# whole tree (tiny model, one device, float32; jax 0.10.2, qwix 0.1.8) is 2.3% for int8 and 9.9% for fp8, cosines
# 0.9997 and 0.9951.
MIN_COSINE, MIN_ERROR = 0.99, 1e-6
MAX_ERROR = {"int8": 5e-2, "fp8": 2.0**-3}


def quantization_problem(grads, reference, mode: str) -> str:
    """Why `grads` are not what `mode`'s quantization makes of the `reference` gradients ('' when they are)."""
    cosine, error = gradient_agreement(grads, reference)
    if not cosine > MIN_COSINE:
        return f"cosine {cosine:.6f} to the unquantized gradients, not above {MIN_COSINE}"
    if error < MIN_ERROR:
        return f"relative error {error:.2e} below {MIN_ERROR:g}: nothing was quantized"
    if error > MAX_ERROR[mode]:
        return f"relative error {error:.4f} above {mode}'s {MAX_ERROR[mode]:g}"
    return ""


def step_one(mode: str, *overrides: str, start: tuple | None = None, num_devices: int = 1,
             device_kind: str = "cpu") -> tuple:
    """(params, batch, gradient sums) of the tiny model's first step under `mode`: the init of the config's seed and
    the first synthetic batch, or `start`'s (params, batch), so every mode is measured on the same ones."""
    cfg = tiny_config(f"quantization={mode}", *overrides, num_devices=num_devices, device_kind=device_kind)
    trainer = Trainer(cfg, mesh_for(cfg))
    params, batch = start or (trainer.init_state().params, next(data.make_input(cfg, trainer.mesh)))
    return params, batch, loss_and_grads(trainer, params, batch)[1]


@pytest.fixture(scope="module")
def unquantized_step_one() -> tuple:
    """The unquantized first step, compiled and run once for every mode's comparison."""
    return step_one("none")


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_the_first_steps_gradients_are_the_unquantized_ones_to_8_bit_rounding(mode: str,
                                                                            unquantized_step_one) -> None:
    params, batch, reference = unquantized_step_one
    _, _, grads = step_one(mode, start=(params, batch))
    assert quantization_problem(grads, reference, mode) == ""


def test_the_gradient_check_fails_a_quantization_that_changes_nothing(unquantized_step_one) -> None:
    """The lower bound is what makes the check above fail for a no-op quantization: the unquantized gradients
    against themselves have error 0."""
    reference = unquantized_step_one[2]
    assert gradient_agreement(reference, reference)[1] == 0.0
    assert "nothing was quantized" in quantization_problem(reference, reference, "int8")


TINY_RUN = (*TINY, "per_device_batch_size=2", "steps=8", "log_period=1", "run_name=quantized",
            "enable_checkpointing=false", "enable_tensorboard=false")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_the_cli_trains_a_quantized_run_and_records_its_mode(mode: str, tmp_path, capsys) -> None:
    """`maxshard.train` in this process (8 simulated devices, fsdp): finite losses that fall within 8 steps, the
    mode in metrics.jsonl's startup record and in the console's startup summary."""
    argv = ["configs/base.yml", *TINY_RUN, f"quantization={mode}", f"base_output_directory={tmp_path}"]
    assert train.main(argv) == 0
    assert f"quantization: {mode} on the attention and MLP matmuls" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "quantized" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["startup"]["quantization"] == mode
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8 and np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses


TPU_MODEL = ("dataset_type=synthetic", "emb_dim=256", "num_layers=2", "num_heads=4", "num_kv_heads=4",
             "head_dim=128", "mlp_dim=512", "max_target_length=256", "vocab_size=1024", "per_device_batch_size=1")


def compiled_matmuls(program: str) -> list[tuple[str, str, str]]:
    """(lhs type, rhs type, op_name) of every top-level dot or convolution of a compiled HLO module."""
    types = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[", program, re.M))
    return [(types.get(lhs, "?"), types.get(rhs, "?"), name)
            for lhs, rhs, name in re.findall(r" (?:convolution|dot)\((%[\w.\-]+), (%[\w.\-]+)\).*?op_name=\"([^\"]*)",
                                             program)]


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_xla_tpu_keeps_the_8_bit_operands_on_a_v5e_slice(mode: str) -> None:
    """Ahead of time with libtpu (a test dependency, as in tests/test_tpu_aot.py), TPU defaults (bf16, splash):
    XLA:TPU compiles the quantized step and its projection matmuls take the 8-bit operands, even fp8 on v5e, a chip
    without an fp8 peak in the tables (the planner counts those at bf16)."""
    from maxshard.launch import topologies
    from maxshard.parallel import mesh
    from maxshard.planning.compiled import compile_train_step
    from maxshard.planning.tpu_compile import abstract_devices
    from maxshard.run.target import load_for_target

    target = topologies.parse("v5litepod-8")
    cfg = load_for_target(["configs/base.yml", *TPU_MODEL, f"quantization={mode}"], target)
    matmuls = compiled_matmuls(compile_train_step(cfg, mesh.build(cfg, abstract_devices(target))).as_text())
    projections = [m for m in matmuls if re.search(r"/(query|key|value|out|wo)/", m[2])]
    assert len(projections) >= 12, matmuls
    expected = {"int8": {"s8"}, "fp8": {"f8e4m3fn", "f8e5m2"}}[mode]
    assert all({lhs, rhs} <= expected for lhs, rhs, _ in projections), projections
    assert all(lhs == rhs == "bf16" for lhs, rhs, name in matmuls if "logits" in name)


GPU_PROGRAMS = """
import json, sys
sys.path.insert(0, "benchmarks")
import gpu_suite
print(json.dumps({mode: gpu_suite.compile_hlo("h100-80gb-8", ["model_name=tiny", "attention=blockwise",
                                                            f"quantization={mode}"]) for mode in ("none", "fp8")}))
"""


def test_xla_gpu_runs_the_fp8_matmuls_on_8_bit_operands_without_adding_copies(cuda_plugin) -> None:
    """Compiled with XLA:GPU for an H100 without one (JAX's CUDA plugin in a directory only the subprocess sees,
    tests/cuda_plugin.py): the fp8 step's GEMMs take 8-bit operands, and it holds no more copies than the
    unquantized step. With the forward's 8-bit copies reused in the backward (qwix's default) it held more: 64
    against 62 here, 61 against 42 for two layers of the 1b preset (benchmarks/README.md, "The fp8 backward's
    copies"); the backward quantizing its own operands (`qwix_training.backward_residuals`) holds 53."""

    run = with_plugin(cuda_plugin, GPU_PROGRAMS)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["none"]["8-bit GEMMs"] == 0 and counts["fp8"]["8-bit GEMMs"] >= 12, counts
    assert counts["fp8"]["copies"] <= counts["none"]["copies"], counts


def test_the_parameters_are_the_same_so_checkpoints_carry_over() -> None:
    """qwix's dynamic scales keep no state: a quantized run's train state is the unquantized one's, leaf for leaf."""
    plain, quantized = (abstract_state(tiny_config(f"quantization={m}")) for m in ("none", "int8"))
    assert jax.tree.structure(plain) == jax.tree.structure(quantized)
    assert jax.tree.leaves(nn.unbox(plain)) == jax.tree.leaves(nn.unbox(quantized))


def _load_error(*tokens: str, device_kind: str = "cpu") -> str:
    with pytest.raises(ConfigError) as e:
        loading.complete(config.finalize(config.parse(["configs/base.yml", *tokens]), 8, device_kind))
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(("tokens", "device_kind", "fragment"), [
    (("quantization=int4",), "cpu", "quantization expects one of 'none', 'int8', 'fp8', got 'int4'"),
    (("quantization=int8", "dtype=float16"), "cpu", "quantization=int8 needs dtype bfloat16 or float32"),
    (("quantization=fp8", "dtype=float16"), "TPU v5 lite", "quantization=fp8 needs dtype bfloat16 or float32"),
    (("quantization=fp8",), "NVIDIA A100-SXM4-40GB", "quantization=fp8 needs fp8 tensor cores (H100, H200)"),
])
def test_a_bad_value_or_a_combination_qwix_cannot_train_is_one_config_error(tokens, device_kind, fragment) -> None:
    assert fragment in _load_error(*tokens, device_kind=device_kind)


def test_fp8_and_int8_load_where_they_can_run() -> None:
    for kind, mode in (("NVIDIA A100-SXM4-40GB", "int8"), ("TPU v5 lite", "fp8"), ("NVIDIA H100 80GB HBM3", "fp8")):
        cfg = loading.complete(config.finalize(config.parse(["configs/base.yml", f"quantization={mode}"]), 8, kind))
        assert cfg.quantization == mode


def test_the_peak_tables_have_the_8_bit_peaks_with_their_sources() -> None:
    h100 = "NVIDIA H100 80GB HBM3"
    assert devices.peak_flops(h100, "fp8") == devices.peak_flops(h100, "int8") == 1979e12  # twice bf16's 989 (989.5)
    assert devices.peak_flops("NVIDIA H200", "int8") == 1979e12
    assert devices.peak_flops("NVIDIA H100 PCIe", "fp8") == 1513e12
    assert devices.peak_flops("TPU v5 lite", "int8") == 393e12
    assert devices.peak_flops("TPU v5", "int8") == 918e12  # v5p
    assert devices.peak_flops("TPU v6 lite", "int8") == 1836e12
    assert devices.peak_flops("NVIDIA A100-SXM4-40GB", "int8") == 624e12
    without_fp8 = ("TPU v5 lite", "TPU v6 lite", "TPU v4", "NVIDIA A100-SXM4-40GB")
    assert [devices.peak_flops(k, "fp8") for k in without_fp8] == [None] * 4
    assert perf.mixed_peak(100.0, 200.0, 0.5) == pytest.approx(1 / (0.5 / 200 + 0.5 / 100))
    assert perf.mixed_peak(100.0, None, 0.5) == 100.0 and perf.mixed_peak(None, 200.0, 0.5) is None


def _plan(target: str, *tokens: str) -> estimate.Plan:
    parsed = topologies.parse(target)
    return estimate.make_plan(load_for_target(["configs/base.yml", "model_name=125m", *tokens], parsed), parsed)


def test_the_planner_and_mfu_measure_a_quantized_run_against_the_8_bit_peak() -> None:
    """The 125m preset on an H100 node: 72% of its training FLOPs are quantized matmuls (the tied head and attention's
    scores are the rest), so fp8 (and int8) plan at 1 / (0.72 / 1979 + 0.28 / 989) TFLOP/s, the compute time
    shrinks by that ratio, and the run's MFU (console.StepLogger) divides by the same peak."""
    plain, fp8, int8 = (_plan("h100-80gb-8", f"quantization={m}") for m in ("none", "fp8", "int8"))
    share = quantization.quantized_share(fp8.cfg.model)
    assert 0.7 < share < 0.75
    assert plain.peak == 989e12
    assert fp8.peak == int8.peak == pytest.approx(1 / (share / 1979e12 + (1 - share) / 989e12))
    assert fp8.compute_s == pytest.approx(plain.compute_s * plain.peak / fp8.peak)
    roofline = printout.format_plan(fp8)
    assert f"at {fp8.peak / 1e12:.0f} TFLOP/s fp8 for 72% of the FLOPs, bf16 for the rest" in roofline
    assert f"MFU <= {fp8.model_flops / fp8.step_s / fp8.peak:.1%}" in roofline
    logger = console.StepLogger(fp8.cfg, writer=None)  # type: ignore[arg-type]
    assert logger.peak == fp8.peak
    figures = perf.step_perf(1.0, 1e15, 1.0, 1, logger.peak)
    assert figures["mfu"] == pytest.approx(1e15 / fp8.peak)


def test_under_lora_the_quantized_share_counts_the_frozen_kernels_without_weight_gradients() -> None:
    """flops_per_token counts LoRA's frozen kernels at 4 FLOPs per parameter (no weight gradient): so does the share."""
    plain = _plan("h100-80gb-8", "quantization=int8").cfg.model
    lora = _plan("h100-80gb-8", "quantization=int8", "lora_rank=8").cfg.model
    quantized = quantization.quantized_matmul_params(plain)
    assert quantization.quantized_matmul_params(lora) == quantized
    assert quantization.quantized_share(lora) == pytest.approx(4 * quantized / model_flops.flops_per_token(lora))
    assert quantization.quantized_share(plain) == pytest.approx(6 * quantized / model_flops.flops_per_token(plain))


def test_a_chip_without_the_8_bit_peak_counts_the_quantized_matmuls_at_bf16() -> None:
    """TPU v5e has an int8 peak (393 TOPs) but no fp8 one: fp8 there is planned at the bf16 peak, and says so."""
    plain, int8, fp8 = (_plan("v5litepod-8", f"quantization={m}") for m in ("none", "int8", "fp8"))
    assert plain.peak == fp8.peak == 197e12
    share = quantization.quantized_share(int8.cfg.model)
    assert int8.peak == pytest.approx(1 / (share / 393e12 + (1 - share) / 197e12))
    assert "no fp8 peak known for TPU v5 lite: its fp8 matmuls count at bf16" in printout.format_plan(fp8)
    figures = console.startup_figures(fp8.cfg, fp8.mesh, 1, _Report())
    summary = console.format_startup_summary(figures)
    assert "peak 197 TFLOP/s bf16 (no fp8 peak known" in summary
    assert "quantization: fp8 on the attention and MLP matmuls, forward and backward (qwix" in summary


class _Report:
    param_bytes_per_device = optimizer_bytes_per_device = gradient_bytes_per_device = reference_bytes_per_device = 0
