"""Rotary position embedding (RoPE): inverse frequencies, optionally Llama-3 scaled, and the rotation itself.

Convention: the pair rotated together is (x[i], x[i + head_dim/2]), i.e. the first half of a head against its
second half. This is Hugging Face's `rotate_half` layout, so Llama/Mistral q/k weights from Hugging Face are used
as they are (Meta's original checkpoints rotate interleaved pairs (x[2i], x[2i+1]); Hugging Face's own conversion
already permuted their rows into the half layout).

The frequencies depend only on static configuration (head_dim, base, scaling), so they are computed here in
float64 numpy and enter the traced computation as a float32 constant; only the angles depend on positions.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxshard.model.config import ModelConfig

__all__ = ["Llama3Scaling", "inverse_frequencies", "llama3_scaled", "scaling_from", "frequencies_for", "apply_rope"]


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's long-context RoPE scaling (Hugging Face `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


def inverse_frequencies(head_dim: int, theta: float, scaling: Llama3Scaling | None = None) -> np.ndarray:
    """[head_dim // 2] float64 angular frequencies theta ** (-2i / head_dim), scaled when `scaling` is given."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) / half)
    return inv_freq if scaling is None else llama3_scaled(inv_freq, scaling)


def llama3_scaled(inv_freq: np.ndarray, s: Llama3Scaling) -> np.ndarray:
    """Stretches the low frequencies so the model reaches `factor` times its pretraining context.

    Wavelengths shorter than original_max_position / high_freq_factor (local detail) are kept; wavelengths longer
    than original_max_position / low_freq_factor are divided in frequency by `factor`; the band between blends the
    two linearly in original_max_position / wavelength.
    """
    wavelength = 2 * math.pi / inv_freq
    short = s.original_max_position / s.high_freq_factor
    long = s.original_max_position / s.low_freq_factor
    blend = (s.original_max_position / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    between = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    return np.where(wavelength < short, inv_freq, np.where(wavelength > long, inv_freq / s.factor, between))


def scaling_from(cfg: ModelConfig) -> Llama3Scaling | None:
    """The scaling the model keys ask for (`rope_scaling_type` and its parameters), or None."""
    if cfg.rope_scaling_type == "none":
        return None
    return Llama3Scaling(cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                         cfg.rope_original_max_position)


def frequencies_for(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies of a model config (`cfg.model` of a run)."""
    return inverse_frequencies(cfg.head_dim, cfg.rope_max_timescale, scaling_from(cfg))


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates pairs (first half, second half) of head_dim by positions x inv_freq, in float32.

    x: [batch, length, heads, head_dim]; positions: [batch, length]; inv_freq: [head_dim // 2].
    """
    freq = jnp.asarray(np.asarray(inv_freq, np.float32))
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [batch, length, 1, half]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = jnp.split(jnp.asarray(x, jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.asarray(rotated, x.dtype)
