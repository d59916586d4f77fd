"""Numbers as people read them: bytes, counts, durations, FLOP rates. One formatter per kind, used everywhere."""

from __future__ import annotations

__all__ = ["format_bytes", "format_count", "format_sig3", "format_duration", "format_flops"]


def format_sig3(value: float) -> str:
    """About three significant figures without switching to exponent notation: 3.21, 14.1, 291."""
    magnitude = abs(value)
    decimals = 0 if magnitude >= 100 else 1 if magnitude >= 10 else 2
    return f"{value:.{decimals}f}"


def format_count(value: float) -> str:
    """14100 -> '14.1k', 2.5e6 -> '2.50M'; three significant figures are enough to compare runs."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{format_sig3(value / scale)}{suffix}"
    return format_sig3(value)


def format_flops(flops_per_second: float) -> str:
    """A FLOP rate in the unit that shows it: 3.2e14 -> '320 TFLOP/s', 8.1e9 -> '8.10 GFLOP/s' (a CPU's rate
    would read 0.00 in TFLOP/s)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(flops_per_second) >= scale:
            return f"{format_sig3(flops_per_second / scale)} {prefix}FLOP/s"
    return f"{format_sig3(flops_per_second)} FLOP/s"


def format_duration(seconds: float) -> str:
    """52 -> '52s', 185 -> '3m05s', 3720 -> '1h02m'."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_bytes(n: float) -> str:
    """Binary units, as device memory is quoted in: 1536 -> '1.5 KiB'."""
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {suffix}"
    return f"{int(n)} B"
