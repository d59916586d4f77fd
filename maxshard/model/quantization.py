"""Quantized training (`quantization: int8 | fp8`): the matmuls of attention and the MLP in 8 bits, through qwix.

Google's qwix (the library MaxText trains with) does the quantization; this module only says where and in which
types. `quantize` hands the Transformer to `qwix.quantize_model` with a `QtProvider` (`model/qwix_training.py`,
imported only by a run that quantizes): while the model's methods
run, qwix intercepts `jax.lax.dot_general`, `jnp.einsum` and `jax.lax.ragged_dot`, and every op whose module path
and name match a rule below becomes qwix's quantized-training dot. Both operands are quantized in the forward pass
(absmax scales per channel of the non-contracted dimensions, computed from the values of this step: dynamic
scaling, no state), the dot runs on the 8-bit values, and in the backward pass the incoming gradient is quantized
too, so all three matmuls of a projection (forward, input gradient, weight gradient) take 8-bit operands; the
backward quantizes the forward's operands again for its own contractions (`qwix_training.backward_residuals`). Gradients
reach the float parameters straight through the rounding. The layers are untouched and never see the run config.

What is quantized, by module path (scanned, unrolled and pipelined stacks alike, under every pipeline schedule; the
stage of a pipeline is applied as its own root, so no rule names the decoder):

    attention/{query,key,value,out}   the projections (DenseGeneral's dot_general)
    mlp, mlp/wo                       the SwiGLU MLP: the stacked gate/up einsum and the down projection
    moe/shared, moe/shared/wo         an MoE layer's shared experts (the same MLP)
    moe                               the routed experts on every path: jax.lax.ragged_dot (dropless, ragged_dot),
                                      and the einsums of the tiled dropless, the dense and the dropping paths

and what is not: attention's scores and values (MaxText's rules leave them out too, and the fused kernels do their
own math), the router, the embedding and the output head, and the MoE layer's dispatch, combine and routing
einsums (one-hot masks and router weights): they run in the `moe` module beside the experts' einsums, and a qwix
rule matches module paths and op names only, so `Provider` keeps in 8 bits only the einsums the layer names as its
experts' (`moe.EXPERT_EINSUMS`). Under LoRA the frozen kernels are quantized and the adapters' matmuls are not
(`Provider` again).

Recipes (`RECIPES`):
    int8   weights, activations and gradients int8 (MaxText's int8 recipe)
    fp8    weights and activations float8_e4m3fn, gradients float8_e5m2: the wider exponent of e5m2 holds the
           gradients' range (NVIDIA Transformer Engine's "hybrid" format; MaxText's fp8_full)

The parameters are not changed (no new variables: dynamic scales keep no statistics), so a checkpoint trains on
with or without quantization, and generation and checkpoint conversion run the model unquantized.

Peaks. MFU and the planner's compute time (`peak_flops`) measure a quantized run against the chip's 8-bit peak (from
the device registry, `maxshard/devices.py`) for the quantized share of the FLOPs (`quantized_share`: 72% for the
125m preset at 2048 tokens) and its bf16 peak for the rest. A chip without a peak for the mode's type counts those
matmuls at bf16: fp8 on TPU v4, v5e, v5p and v6e, whose programs XLA:TPU compiles with the dots keeping
their e4m3/e5m2 operands (benchmarks/README.md, "Quantized training") but for which Google's tables give no fp8
rate. fp8 on an A100 (no fp8 tensor cores) is refused (`check`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from maxshard import devices
from maxshard.config.schema import Config
from maxshard.errors import ConfigError
from maxshard.model.attention_choice import platform_of
from maxshard.spec.model_config import ModelConfig
from maxshard.model.flops import flops_per_token, matmuls
from maxshard import perf

__all__ = ["MODES", "Recipe", "RECIPES", "RULES", "MOE_PATH", "check", "quantize", "quantized_matmul_params",
           "quantized_share", "peak_flops", "peak_precision"]

MODES = ("none", "int8", "fp8")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The 8-bit types of one mode: operands of the forward dots, and the incoming gradient of the backward ones."""

    forward: Any
    gradient: Any
    peak: str  # which peak of the device registry the quantized matmuls run at ("int8" or "fp8")


RECIPES = {
    "int8": Recipe(jnp.int8, jnp.int8, "int8"),
    "fp8": Recipe(jnp.float8_e4m3fn, jnp.float8_e5m2, "fp8"),
}

MOE_PATH = r"(.*/)?moe"  # an MoE layer: its experts' einsums are quantized, its other einsums not (`Provider`)
# (module path regex, op names) of the quantized matmuls; qwix matches the path with re.fullmatch.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"(.*/)?attention/(query|key|value|out)", ("dot_general",)),
    (r"(.*/)?(mlp|shared)(/wo)?", ("dot_general", "einsum")),
    (MOE_PATH, ("ragged_dot", "einsum")),
)


def quantize(model: Any, mode: str) -> Any:
    """The Transformer (or a stack or stage that a table pipeline schedule applies as its own root,
    training/pipelined.py) whose methods run under qwix's interception with the rules of `mode`; `model` itself for
    'none'. Every entry point the step applies (`__call__`, `hidden`, `head`, ...) is intercepted, so a loss over
    pieces of the sequence (`loss_chunks`) quantizes exactly as the whole one."""
    if mode == "none":
        return model
    if mode not in RECIPES:
        raise ValueError(f"quantization must be one of {', '.join(MODES)}, got {mode!r}")
    # qwix only where a run quantizes: its import is a noticeable part of a CLI start (benchmarks/README.md,
    # "Deferred imports")
    from maxshard.model import qwix_training

    return qwix_training.quantize(model, mode)


def quantized_matmul_params(cfg: ModelConfig) -> int:
    """Parameters per token whose matmuls `RULES` quantize (a subset of `flops.matmul_params`): every layer's
    q/k/v/out projections, the dense layers' MLP, and in MoE layers the shared experts and the k routed experts a
    token visits. Not the head, the router or the embedding."""
    m = matmuls(cfg)
    return m.qkv + m.out + m.dense_mlp + m.shared_experts + m.routed_experts


def quantized_share(cfg: ModelConfig) -> float:
    """The share of the model's training FLOPs (`flops.flops_per_token`) that run in 8 bits: the quantized matmul
    parameters per token x 6 (forward 2, backward 4), or x 4 under LoRA, whose frozen kernels get no weight gradient
    (as `flops_per_token` counts them), over all of them. The head, the router, attention's scores and the LoRA
    adapters stay in the compute dtype."""
    per_param = 4 if cfg.lora_rank else 6
    return per_param * quantized_matmul_params(cfg) / flops_per_token(cfg)


def peak_flops(cfg: Config) -> float | None:
    """The peak FLOP/s per device that this run's MFU and the planner's compute time are measured against: the bf16
    peak, or for a quantized run the mix (`perf.mixed_peak`) of the chip's 8-bit peak for the quantized share of the
    FLOPs and its bf16 peak for the rest. A chip with no peak for the mode's type (fp8 on TPU v4/v5e/v5p/v6e) counts
    its 8-bit matmuls at the bf16 peak: no speedup is assumed that the registry cannot source."""
    bf16 = devices.peak_flops(cfg.device_kind)
    if cfg.quantization == "none" or bf16 is None:
        return bf16
    low = devices.peak_flops(cfg.device_kind, RECIPES[cfg.quantization].peak)
    return perf.mixed_peak(bf16, low, quantized_share(cfg.model))


def peak_precision(cfg: Config) -> str:
    """What `peak_flops` is a peak of, for the startup line and the plan: 'bf16', or the quantized mix."""
    if cfg.quantization == "none":
        return "bf16"
    kind = RECIPES[cfg.quantization].peak
    if devices.peak_flops(cfg.device_kind, kind) is None:
        return f"bf16 (no {kind} peak known for {cfg.device_kind or 'this device'}: its {kind} matmuls count at bf16)"
    return f"{kind} for {quantized_share(cfg.model):.0%} of the FLOPs, bf16 for the rest"


def check(mode: str, dtype: str, device_kind: str) -> None:
    """ConfigError (one line, before anything is traced) for a combination qwix cannot train:

    - compute dtype float16: qwix computes its scales in the compute dtype and takes a scale under sqrt(float16's
      smallest normal) ~ 0.0078 as 1, so int8 rounds weights of ordinary size to 0 (the model stops learning:
      benchmarks/README.md, "Quantized training") and fp8's dots fail to trace (float16 meets float32);
    - fp8 on an NVIDIA GPU whose row in the device registry (`maxshard/devices.py`) has a bf16 peak and no fp8 one
      (A100: fp8 matmuls need compute capability 8.9, Ada or Hopper); int8 runs there.
    """
    if mode == "none":
        return
    if dtype == "float16":
        raise ConfigError(f"quantization={mode} needs dtype bfloat16 or float32 (got float16: qwix's scales in "
                          "float16 round ordinary weights to 0); set dtype=bfloat16 or quantization=none")
    chip = devices.by_kind(device_kind)
    no_fp8 = chip is not None and chip.peak_bf16 is not None and chip.peak_fp8 is None
    if mode == "fp8" and platform_of(device_kind) == "nvidia" and no_fp8:
        raise ConfigError(f"quantization=fp8 needs fp8 tensor cores (H100, H200); {device_kind!r} has none: "
                          "use quantization=int8 or none")
