"""Rotary position embedding (RoPE): inverse frequencies, optionally Llama-3 or YaRN scaled, and the rotation itself.

Convention: the pair rotated together is (x[i], x[i + rotary_dim/2]), i.e. the first half of a head's rotary part
against its second half (the whole head, or its first head_dim x `partial_rotary_factor` features, the rest
unrotated: Qwen3-Next). This is Hugging Face's `rotate_half` layout, so Llama/Mistral q/k weights from Hugging Face
are used as they are (Meta's original checkpoints rotate interleaved pairs (x[2i], x[2i+1]); Hugging Face's own
conversion already permuted their rows into the half layout). DeepSeek-V2/V3 checkpoints keep the interleaved pairs
in their RoPE columns and transformers rotates them as such (`rope_interleave`, `apply_rotary_pos_emb_interleave`),
returning the rotated pairs in the half layout; the same numbers come out here when a converter reorders those
columns with `deinterleaved` (evens, then odds), so the half layout is the only one the layers know.

The frequencies depend only on static configuration (rotary width, base, scaling), so they are computed here in
float64 numpy and enter the traced computation as a float32 constant; only the angles depend on positions.

YaRN (`rope_scaling_type: yarn`) changes two more numbers, both Hugging Face's (`_compute_yarn_parameters` and
DeepSeek-V3's attention): the cos/sin are multiplied by `cos_sin_scale` and the softmax scale by `softmax_mscale`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxshard.spec import mixer_kinds
from maxshard.spec.model_config import ModelConfig

__all__ = ["Llama3Scaling", "YarnScaling", "LinearScaling", "inverse_frequencies", "llama3_scaled", "yarn_scaled",
           "yarn_mscale",
           "scaling_from", "rotary_dim", "frequencies_for", "cos_sin_scale", "softmax_scale", "deinterleaved",
           "apply_rope"]


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's long-context RoPE scaling (Hugging Face `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN (Hugging Face `rope_type: yarn`): frequencies that turn fewer than `beta_slow` times over the original
    context are interpolated (divided by `factor`), those turning more than `beta_fast` times are kept, a linear
    ramp over the frequency index between; `mscale`/`mscale_all_dim` set the attention temperature."""

    factor: float
    original_max_position: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    truncate: bool = True  # the ramp's ends rounded outwards to whole indices (transformers' default; GPT-OSS: no)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (Hugging Face `rope_type: linear`, Gemma 3's global layers): every frequency divided
    by `factor`, i.e. positions divided by it."""

    factor: float


Scaling = Llama3Scaling | YarnScaling | LinearScaling


def inverse_frequencies(dim: int, theta: float, scaling: Scaling | None = None) -> np.ndarray:
    """[dim // 2] float64 angular frequencies theta ** (-2i / dim), scaled when `scaling` is given."""
    half = dim // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) / half)
    if isinstance(scaling, YarnScaling):
        return yarn_scaled(inv_freq, scaling, dim, theta)
    if isinstance(scaling, LinearScaling):
        return inv_freq / scaling.factor
    return inv_freq if scaling is None else llama3_scaled(inv_freq, scaling)


def llama3_scaled(inv_freq: np.ndarray, s: Llama3Scaling) -> np.ndarray:
    """Stretches the low frequencies so the model reaches `factor` times its pretraining context.

    Wavelengths shorter than original_max_position / high_freq_factor (local detail) are kept; wavelengths longer
    than original_max_position / low_freq_factor are divided in frequency by `factor`; the band between blends the
    two linearly in original_max_position / wavelength (with equal factors there is no band: a step).
    """
    wavelength = 2 * math.pi / inv_freq
    short = s.original_max_position / s.high_freq_factor
    long = s.original_max_position / s.low_freq_factor
    band = s.high_freq_factor - s.low_freq_factor  # 0: no band between, a step at the original context (Llama 4)
    blend = (s.original_max_position / wavelength - s.low_freq_factor) / band if band else np.ones_like(inv_freq)
    between = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    return np.where(wavelength < short, inv_freq, np.where(wavelength > long, inv_freq / s.factor, between))


def yarn_scaled(inv_freq: np.ndarray, s: YarnScaling, dim: int, theta: float) -> np.ndarray:
    """YaRN's blend of kept and interpolated frequencies, as transformers computes it.

    Frequency index i turns (original_max_position * inv_freq[i] / 2 pi) times over the original context; solving
    for i at `beta_fast` and `beta_slow` turns gives the band [low, high] (rounded outwards, clipped to the head:
    transformers' `truncate`, its default; `yarn_truncate: false` keeps the fractional ends, as GPT-OSS). Below `low`
    the frequency is kept, above `high` divided by `factor`, and between the two the weight of the divided one rises
    linearly in i."""

    def index_at(turns: float) -> float:  # the (fractional) frequency index that turns `turns` times
        return dim * math.log(s.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_at(s.beta_fast), index_at(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / s.factor * ramp + inv_freq * (1.0 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1): DeepSeek's `yarn_get_mscale`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def scaling_from(cfg: ModelConfig) -> Scaling | None:
    """The scaling the model keys ask for (`rope_scaling_type` and its parameters), or None."""
    if cfg.rope_scaling_type == "none":
        return None
    if cfg.rope_scaling_type == "linear":
        return LinearScaling(cfg.rope_scaling_factor)
    if cfg.rope_scaling_type == "yarn":
        return YarnScaling(cfg.rope_scaling_factor, cfg.rope_original_max_position, cfg.yarn_beta_fast,
                           cfg.yarn_beta_slow, cfg.yarn_mscale, cfg.yarn_mscale_all_dim, cfg.yarn_truncate)
    return Llama3Scaling(cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                         cfg.rope_original_max_position)


def rotary_dim(cfg: ModelConfig) -> int:
    """How many features of a head RoPE rotates: the whole head, its first head_dim x `partial_rotary_factor`
    (Qwen3-Next; transformers' int(head_dim * partial_rotary_factor), config/ranges.py keeps it even and whole),
    or latent attention's RoPE part."""
    if mixer_kinds.latent(cfg.attention_type):
        return cfg.qk_rope_head_dim
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def frequencies_for(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies of a model config (`cfg.model` of a run), over its `rotary_dim`; with proportional RoPE
    (`rope_proportion` < 1, Gemma 4) the pairs past head_dim / 2 x the proportion at frequency 0, so they pass
    unrotated."""
    inv_freq = inverse_frequencies(rotary_dim(cfg), cfg.rope_max_timescale, scaling_from(cfg))
    if cfg.rope_proportion < 1:
        inv_freq = np.where(np.arange(len(inv_freq)) < int(cfg.rope_proportion * len(inv_freq)), inv_freq, 0.0)
    return inv_freq


def cos_sin_scale(cfg: ModelConfig) -> float:
    """The factor on RoPE's cos and sin (transformers' `attention_factor`; 1 unless YaRN): with both mscales set
    mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim) (DeepSeek-V3 sets both to 1: 1.0), else
    mscale(factor) with mscale 1 (Qwen's YaRN), `yarn_mscale` then unread, as in transformers."""
    s = scaling_from(cfg)
    if not isinstance(s, YarnScaling):
        return 1.0
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def softmax_scale(cfg: ModelConfig, width: int) -> float:
    """The logits' scale for query/key heads of `width` features: width ** -0.5, times mscale(factor,
    yarn_mscale_all_dim) ** 2 under YaRN with a nonzero yarn_mscale_all_dim (DeepSeek-V3's `yarn_apply_mscale`;
    the grouped-query models transformers runs with YaRN, Qwen's, leave mscale_all_dim unset, 0: no change)."""
    s = scaling_from(cfg)
    scale = width**-0.5
    if isinstance(s, YarnScaling) and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def deinterleaved(dim: int) -> np.ndarray:
    """The order that takes a rotary part stored in interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's
    checkpoints) to this module's half layout: even features, then odd. A converter indexes those weight columns
    with it (and the inverse permutation, `np.argsort`, on export)."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotates pairs (first half, second half) of the rotary part of the last dim by positions x inv_freq, in
    float32, cos and sin multiplied by `scale` (`cos_sin_scale`).

    x: [batch, length, heads, dim] (or [batch, length, dim], one shared head); positions: [batch, length];
    inv_freq: [rotary // 2], rotary <= dim. The rotary part is the first `rotary` features (partial rotary,
    transformers' `apply_rotary_pos_emb`: the halves are those of the rotary part, x[i] with x[i + rotary / 2]);
    the features after it pass unchanged.
    """
    rotary = 2 * len(inv_freq)
    if rotary < x.shape[-1]:
        turned = apply_rope(x[..., :rotary], positions, inv_freq, scale)
        return jnp.concatenate([turned, x[..., rotary:]], axis=-1)
    freq = jnp.asarray(np.asarray(inv_freq, np.float32))
    extra = (None,) * (x.ndim - 2)
    angle = positions[(..., *extra)].astype(jnp.float32) * freq  # [batch, length, (1,) half]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    if scale != 1.0:
        sin, cos = sin * scale, cos * scale
    x1, x2 = jnp.split(jnp.asarray(x, jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.asarray(rotated, x.dtype)
