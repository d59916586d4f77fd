"""The paths only an accelerator runs compute what the CPU tests check them against (issue #39).

Marked `gpu` or `tpu`: tests/conftest.py skips them, with the reason, where `jax.devices()` has no such device (CI
has none), and a GPU or TPU machine runs them with `JAX_PLATFORMS=cuda python -m pytest -m gpu` (tpu: `-m tpu`).

    attention     cuDNN and tokamax's Mosaic GPU kernel (GPU), splash compiled for the chip (TPU), outputs and
                  gradients against dot_product in float32 on a packed batch; tests/test_attention.py checks the
                  same calls through XLA and Pallas interpret mode on CPU
    offload       remat_policy=offload_full's gradients are full's, and its program really keeps values in host
                  memory; on CPU the offload compiles to nothing (tests/test_offload.py)
    ragged MoE    the ragged exchange's output and gradients are the fixed exchange's, through XLA's
                  ragged-all-to-all; on CPU the collective is emulated (tests/test_moe_ragged.py)
    quantization  int8 and fp8: the compiled step's matmuls take 8-bit operands, and the first step's gradients pass
                  tests/test_quantization.py's check against the unquantized ones

A path the config refuses on the device at hand (tokamax or fp8 before Hopper) is skipped with the ConfigError's
words. The tolerances come from CPU measurements (bfloat16 XLA attention against float32: 0.2-0.6%). On one H200
(2026-11-26, jax 0.11.2, tokamax 0.0.17) the gpu tests passed but the ragged exchange's, which needs 2 or more
devices (benchmarks/README.md); no TPU has run the tpu ones.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard import data
from maxshard.errors import ConfigError
from maxshard.model.layers import attention_ops as ops
from maxshard.parallel import sharding
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import layout_overrides, max_relative_difference, mesh_for, tiny_config
from tests.test_attention import _inputs, _many_documents, _value_and_grads
from tests.test_moe_ragged import _run_dropless, layer_inputs  # noqa: F401 (layer_inputs: a fixture)
from tests.test_quantization import quantization_problem, step_one

GPU, TPU = pytest.mark.gpu, pytest.mark.tpu
ON_EACH = [pytest.param("gpu", marks=GPU), pytest.param("tpu", marks=TPU)]

# bfloat16 kernels against float32 dot_product: a few times what bfloat16 XLA attention gets on CPU (0.2-0.6%), far
# below what a wrong mask or offset gives (order 1). float32: the kernels' own summation order and precision.
ATTENTION_TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-3}
EIGHT_BIT = {"int8": {"s8"}, "fp8": {"f8e4m3fn", "f8e5m2"}}


def _device_kind() -> str:
    return jax.devices()[0].device_kind


def _config_here(*overrides: str, num_devices: int = 1):
    """The tiny config as a run on this device resolves it (dtype auto: bfloat16), or a skip with the ConfigError's
    words where the config refuses it here."""
    try:
        return tiny_config(*overrides, num_devices=num_devices, device_kind=_device_kind())
    except ConfigError as error:
        pytest.skip(f"{_device_kind()}: {error}")


# --------------------------------------------------------------------------------------------- attention

KERNELS = [
    pytest.param("cudnn", "bfloat16", marks=GPU, id="cudnn-bf16"),
    pytest.param("tokamax", "bfloat16", marks=GPU, id="tokamax-bf16"),
    pytest.param("splash", "bfloat16", marks=TPU, id="splash-bf16"),
    pytest.param("splash", "float32", marks=TPU, id="splash-f32"),
]


@pytest.mark.parametrize("kernel,dtype", KERNELS)
def test_the_fused_kernel_computes_dot_products_attention(kernel: str, dtype: str) -> None:
    """8 ragged packed documents per row (the last tokens padding), 4 query heads over 2 kv heads, causal, 256
    tokens in 128-token blocks: the kernel on `dtype` inputs against dot_product in float32 (highest precision) on
    the same values. cuDNN and tokamax take 16-bit inputs only (attention_choice.py), so float32 is splash's."""
    _config_here(f"attention={kernel}", f"dtype={dtype}", "max_target_length=256", "head_dim=128",
                 "attention_block_q=128", "attention_block_kv=128")
    q, k, v, _ = _inputs(256, heads=4, kv_heads=2, dim=128, batch=2)
    segments = _many_documents(2, 256, 8)
    inputs = [x.astype(dtype) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        reference = _value_and_grads(ops.dot_product, *[x.astype(jnp.float32) for x in inputs], segments, {})

    def fused(*args: jax.Array) -> jax.Array:
        return ops.attend(*args, implementation=kernel, block_q=128, block_kv=128).astype(jnp.float32)

    out, grads = _value_and_grads(fused, *inputs, segments, {})
    assert max_relative_difference(out, reference[0]) < ATTENTION_TOLERANCE[dtype]
    assert max_relative_difference(grads, reference[1]) < ATTENTION_TOLERANCE[dtype]


# --------------------------------------------------------------------------------------------- the step's gradients


def _fresh_start(cfg) -> tuple[object, object]:
    """(params, batch) of a fresh run of `cfg`: the init of its seed and its first synthetic batch."""
    trainer = Trainer(cfg, mesh_for(cfg))
    return trainer.init_state().params, next(data.make_input(cfg, trainer.mesh))


def _compiled_grads(cfg, params, batch) -> tuple[object, str]:
    """(gradient sums, the compiled program's HLO text) of the first step of `cfg`'s trainer on `params`, `batch`."""
    trainer = Trainer(cfg, mesh_for(cfg))
    with mesh_context(trainer.mesh, trainer.rules):
        compiled = jax.jit(trainer._grads).lower(params, batch).compile()
        grads, _ = compiled(params, batch)
    return jax.device_get(grads), compiled.as_text()


@pytest.mark.parametrize("platform", ON_EACH)
def test_offloaded_gradients_are_the_device_only_ones(platform: str) -> None:
    """offload_full moves every layer's input to pinned host memory in the forward pass and back for the backward
    pass; full keeps it on the device. Same params, batch and float32 math: the same gradients, and only the
    offloading program has buffers in host memory (XLA's memory space S(5))."""
    common = ("dtype=float32", "attention=dot_product")
    full = _config_here(*common, "remat_policy=full")
    params, batch = _fresh_start(full)
    with jax.default_matmul_precision("highest"):
        on_device, device_program = _compiled_grads(full, params, batch)
        offloaded, offload_program = _compiled_grads(_config_here(*common, "remat_policy=offload_full"), params,
                                                     batch)
    assert "S(5)" in offload_program and "S(5)" not in device_program
    assert max_relative_difference(offloaded, on_device) < 1e-5


def matmul_operands(program: str) -> list[tuple[str, str]]:
    """(lhs type, rhs type) of every dot, convolution and GEMM custom call (cuBLAS: '__cublas$gemm',
    '__cublas$lt$matmul$f8') of a compiled HLO module, those inside fusions included: e.g. ('s8', 's8')."""
    types = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[", program, re.M))
    calls = re.findall(r" (dot|convolution|custom-call)\((%[\w.\-]+), (%[\w.\-]+)[,)](.*)$", program, re.M)
    return [(types.get(lhs, "?"), types.get(rhs, "?")) for op, lhs, rhs, rest in calls
            if op != "custom-call" or re.search(r'custom_call_target="[^"]*(gemm|matmul)', rest, re.I)]


@pytest.mark.parametrize("platform", ON_EACH)
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_matmuls_run_in_8_bits_and_keep_the_gradients(mode: str, platform: str) -> None:
    """The tiny model as the device runs it (dtype auto: bfloat16): the compiled first step has 8-bit matmuls, at
    least one per quantized projection of the forward pass (q, k, v, out, gate/up, down), and its gradients pass
    the check the CPU test holds them to (tests/test_quantization.py: cosine > 0.99, error within the mode's
    band) against the unquantized step's on the same init and batch."""
    cfg = _config_here(f"quantization={mode}", "attention=dot_product")  # fp8 before Hopper: skipped
    params, batch, reference = step_one("none", "attention=dot_product", device_kind=_device_kind())
    grads, program = _compiled_grads(cfg, params, batch)
    eight_bit = [m for m in matmul_operands(program) if set(m) <= EIGHT_BIT[mode]]
    assert len(eight_bit) >= 6, matmul_operands(program)
    assert quantization_problem(grads, reference, mode) == ""


# --------------------------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("platform", ON_EACH)
def test_the_ragged_exchange_computes_the_fixed_exchanges_numbers(platform: str, layer_inputs) -> None:  # noqa: F811
    """tests/test_moe_ragged.py's dropless layer (8 experts, top-2, skewed routing) over an expert axis of every
    device (up to 8), through XLA's ragged-all-to-all: with the buffer no routing overflows, output and gradients
    (input, router weights, kernels) are the fixed exchange's."""
    shards = max((n for n in (8, 4, 2) if n <= jax.device_count()), default=0)
    if not shards:
        pytest.skip(f"needs 2 or more devices to exchange between; jax.devices() has {jax.device_count()}")
    cfg = tiny_config(*layout_overrides([f"ici_expert_parallelism={shards}"]), num_devices=shards)
    layer_mesh = mesh_for(cfg), sharding.flax_rules(cfg)
    with jax.default_matmul_precision("highest"):
        fixed_y, fixed_dropped, fixed_grads = _run_dropless(layer_mesh, layer_inputs, "all_to_all")
        y, dropped, grads = _run_dropless(layer_mesh, layer_inputs, "ragged", 0.0)
    assert dropped == fixed_dropped == 0
    assert max_relative_difference(y, fixed_y) < 1e-5
    assert max_relative_difference(grads, fixed_grads) < 1e-5
    assert np.abs(np.asarray(grads[2][0])).min(axis=(1, 2)).max() > 0  # every expert's kernel has gradient
