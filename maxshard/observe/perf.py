"""Throughput arithmetic: tokens/s and TFLOP/s per device, and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per device / the device's peak dense bf16 FLOP/s. The FLOPs are the *model's*
(forward + backward of the transformer, from `model.py`), not what the hardware executed: recomputation under
remat does not count, so MFU compares layouts and remat policies honestly. The peak is looked up from the device
kind JAX reports; on an unknown kind (CPU, a new chip) there is no peak and no MFU is reported, never a guess.
A quantized run (`quantization: int8 | fp8`) does part of its FLOPs at the chip's 8-bit peak: `mixed_peak` gives the
peak of such a mix, and `maxshard/model/quantization.py` says which share of the FLOPs is quantized.
"""

from __future__ import annotations

import re

# (pattern matched against `jax.Device.device_kind`, case-insensitive; peak dense bf16 FLOP/s per JAX device).
# First match wins, so the specific variants (PCIe, NVL) come before the general name. Sources, vendor spec sheets:
#   TPU v4   275e12  cloud.google.com/tpu/docs/v4   "Peak compute per chip (bf16): 275 TFLOPs"
#   TPU v5e  197e12  cloud.google.com/tpu/docs/v5e  "Peak compute per chip (bf16): 197 TFLOPs"
#   TPU v5p  459e12  cloud.google.com/tpu/docs/v5p  "Peak compute per chip (bf16): 459 TFLOPs"
#   TPU v6e  918e12  cloud.google.com/tpu/docs/v6e  "Peak compute per chip (bf16): 918 TFLOPs"
#   A100     312e12  NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 is with sparsity); SXM and PCIe alike
#   H100 SXM 989e12  NVIDIA H100 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, i.e. 989 dense
#   H100 PCIe 756e12 same datasheet: 1,513 TFLOPS with sparsity; H100 NVL 835e12 (1,671 with sparsity)
#   H200     989e12  NVIDIA H200 datasheet: H200 SXM BF16 1,979 TFLOPS with sparsity; H200 NVL 835e12 (1,671)
# A JAX device is one chip on TPU v4 and later (megacore) and one GPU on NVIDIA.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"^tpu v4$", 275e12),
    (r"^tpu v5 ?(lite|e)$", 197e12),
    (r"^tpu v5p?$", 459e12),
    (r"^tpu v6 ?(lite|e)$", 918e12),
    (r"a100", 312e12),
    (r"h100.*pcie", 756e12),
    (r"h100.*nvl", 835e12),
    (r"h100", 989e12),
    (r"h200.*nvl", 835e12),
    (r"h200", 989e12),
)


# Peak dense int8 OP/s per JAX device (a multiply-add counts 2, as a FLOP does), same sources and matching:
#   TPU v4   275e12  cloud.google.com/tpu/docs/v4   "Peak compute per chip 275 teraflops (bf16 or int8)"
#   TPU v5e  393e12  cloud.google.com/tpu/docs/v5e  "Peak compute per chip (Int8) 393 TOPs"
#   TPU v5p  918e12  cloud.google.com/blog (TPU v5p announcement, Dec 2023): "918 TOPs" Int8 per chip
#   TPU v6e 1836e12  cloud.google.com/tpu/docs/v6e  "Peak compute per chip (Int8) 1836 TOPs"
#   A100     624e12  NVIDIA A100 datasheet: INT8 Tensor Core 624 TOPS (1,248 with sparsity)
#   H100/H200 1979e12 (SXM), 1513e12 (H100 PCIe), 1670e12 (NVL): the datasheets' INT8 Tensor Core 3,958 / 3,026 /
#            3,341 TOPS are with sparsity; dense is half
PEAK_INT8_OPS: tuple[tuple[str, float], ...] = (
    (r"^tpu v4$", 275e12),
    (r"^tpu v5 ?(lite|e)$", 393e12),
    (r"^tpu v5p?$", 918e12),
    (r"^tpu v6 ?(lite|e)$", 1836e12),
    (r"a100", 624e12),
    (r"h100.*pcie", 1513e12),
    (r"h100.*nvl", 1670e12),
    (r"h100", 1979e12),
    (r"h200.*nvl", 1670e12),
    (r"h200", 1979e12),
)

# Peak dense fp8 FLOP/s per JAX device, for the chips with fp8 matrix units among the tables' kinds: H100 and H200
# (datasheets: FP8 Tensor Core 3,958 TFLOPS SXM, 3,026 H100 PCIe, 3,341 NVL, all with sparsity; dense is half).
# TPU v4, v5e, v5p, v6e and the A100 have none (TPU v7x/Ironwood has, but is not in these tables); a run there
# counts its fp8 matmuls at the bf16 peak (`mixed_peak` with no 8-bit peak).
PEAK_FP8_FLOPS: tuple[tuple[str, float], ...] = (
    (r"h100.*pcie", 1513e12),
    (r"h100.*nvl", 1670e12),
    (r"h100", 1979e12),
    (r"h200.*nvl", 1670e12),
    (r"h200", 1979e12),
)

_PEAKS = {"bf16": PEAK_BF16_FLOPS, "int8": PEAK_INT8_OPS, "fp8": PEAK_FP8_FLOPS}


def peak_flops(device_kind: str, precision: str = "bf16") -> float | None:
    """Peak dense FLOP/s of one device of this kind in `precision` ('bf16', 'int8' or 'fp8'), or None when the kind
    is not in that table."""
    kind = device_kind.strip().lower()
    for pattern, peak in _PEAKS[precision]:
        if re.search(pattern, kind):
            return peak
    return None


def mixed_peak(bf16_peak: float | None, low_peak: float | None, low_share: float) -> float | None:
    """The peak of a step that does `low_share` of its FLOPs at `low_peak` (8-bit) and the rest at `bf16_peak`: total
    FLOPs / the least time they take, 1 / (share / low + (1 - share) / bf16). Without an 8-bit peak (None) the
    8-bit FLOPs are counted at the bf16 peak, which is then the answer; without a bf16 peak, None."""
    if bf16_peak is None or low_peak is None:
        return bf16_peak
    if not 0 <= low_share <= 1:
        raise ValueError(f"low_share must be in [0, 1], got {low_share}")
    return 1 / (low_share / low_peak + (1 - low_share) / bf16_peak)


def _check_time(step_time: float) -> None:
    if not step_time > 0:
        raise ValueError(f"step_time must be > 0 seconds, got {step_time}")


def tokens_per_sec_per_device(tokens_per_step: float, step_time: float, num_devices: int) -> float:
    """Global tokens of one step / step time / devices: comparable across mesh sizes."""
    _check_time(step_time)
    return tokens_per_step / step_time / num_devices


def tflops_per_device(flops_per_step: float, step_time: float, num_devices: int) -> float:
    """Model TFLOP/s achieved per device, from the FLOPs of one global step (all devices together)."""
    _check_time(step_time)
    return flops_per_step / step_time / num_devices / 1e12


def mfu(flops_per_step_per_device: float, step_time: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction (0.412 = 41.2%); None without a known peak."""
    _check_time(step_time)
    if peak is None:
        return None
    return flops_per_step_per_device / step_time / peak


def step_perf(
    tokens_per_step: float, flops_per_step: float, step_time: float, num_devices: int, peak: float | None
) -> dict[str, float | None]:
    """The three throughput figures of a step, keyed as `MetricsWriter` expects them."""
    return {
        "tokens_per_sec_per_device": tokens_per_sec_per_device(tokens_per_step, step_time, num_devices),
        "tflops_per_device": tflops_per_device(flops_per_step, step_time, num_devices),
        "mfu": mfu(flops_per_step / num_devices, step_time, peak),
    }
