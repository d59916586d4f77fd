"""Throughput arithmetic: tokens/s and TFLOP/s per device, and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per device / the device's peak dense bf16 FLOP/s. The FLOPs are the *model's*
(forward + backward of the transformer, from `model/flops.py`), not what the hardware executed: recomputation under
remat does not count, so MFU compares layouts and remat policies honestly. The peak is the caller's: the device
registry (`maxshard/devices.py`, `peak_flops`) looks it up from the device kind JAX reports; on an unknown kind (CPU,
a new chip) there is no peak (None) and no MFU is reported, never a guess. This module is a leaf and holds no
figures of any chip. A quantized run (`quantization: int8 | fp8`) does part of its FLOPs at the chip's 8-bit peak:
`mixed_peak` gives the peak of such a mix, and `maxshard/model/quantization.py` says which share is quantized.
"""

from __future__ import annotations


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
