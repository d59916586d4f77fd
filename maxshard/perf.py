"""Throughput arithmetic: tokens/s and TFLOP/s per device, and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per device / the device's peak dense bf16 FLOP/s. The FLOPs are the *model's*
(forward + backward of the transformer, from `model.py`), not what the hardware executed: recomputation under
remat does not count, so MFU compares layouts and remat policies honestly. The peak is looked up from the device
kind JAX reports; on an unknown kind (CPU, a new chip) there is no peak and no MFU is reported, never a guess.
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


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of this kind, or None when the kind is not in the table."""
    kind = device_kind.strip().lower()
    for pattern, peak in PEAK_BF16_FLOPS:
        if re.search(pattern, kind):
            return peak
    return None


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
