"""RoPE frequencies: the plain schedule is the one maxshard always used; Llama-3 scaling keeps, divides and blends."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.config import Config, parse
from maxshard.errors import ConfigError
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import rope
from tests.helpers import tiny_config


def test_plain_frequencies_are_theta_to_the_minus_2i_over_d():
    inv = rope.inverse_frequencies(8, 10000.0)
    np.testing.assert_allclose(inv, [1.0, 10000.0**-0.25, 10000.0**-0.5, 10000.0**-0.75], rtol=1e-15)


def test_llama3_scaling_keeps_short_divides_long_and_blends_between():
    s = rope.Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    inv = rope.inverse_frequencies(128, 500000.0)
    scaled = rope.llama3_scaled(inv, s)
    wavelength = 2 * math.pi / inv
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    middle = ~short & ~long
    assert short.any() and long.any() and middle.any()  # head_dim 128, theta 5e5 reaches all three bands
    np.testing.assert_array_equal(scaled[short], inv[short])
    np.testing.assert_allclose(scaled[long], inv[long] / 8.0, rtol=1e-15)
    blend = (8192 / wavelength[middle] - 1.0) / 3.0
    np.testing.assert_allclose(scaled[middle], (1 - blend) * inv[middle] / 8 + blend * inv[middle], rtol=1e-15)
    assert np.all(np.diff(scaled) < 0)  # still a decreasing schedule: the blend is continuous at both edges


def test_apply_rope_rotates_first_half_against_second_half():
    x = jnp.arange(8, dtype=jnp.float32).reshape(1, 1, 1, 8) + 1.0
    positions = jnp.array([[3]])
    inv = rope.inverse_frequencies(8, 100.0)
    out = np.asarray(rope.apply_rope(x, positions, inv))[0, 0, 0]
    x1, x2 = np.arange(1.0, 5.0), np.arange(5.0, 9.0)
    angle = 3 * inv
    expected = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)])
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_scaling_keys_reach_the_model_config_and_are_range_checked():
    cfg = tiny_config("rope_scaling_type=llama3", "rope_scaling_factor=32")
    assert rope.scaling_from(cfg.model) == rope.Llama3Scaling(32.0, 1.0, 4.0, 8192)
    assert rope.scaling_from(tiny_config().model) is None
    with pytest.raises(ConfigError, match="rope_low_freq_factor and rope_high_freq_factor"):
        parse(["configs/base.yml", "rope_low_freq_factor=4", "rope_high_freq_factor=2"])  # equal: a step
    with pytest.raises(ConfigError, match="rope_scaling_factor must be >= 1"):
        parse(["configs/base.yml", "rope_scaling_factor=0.5"])


def test_model_config_defaults_equal_the_schema_defaults():
    """A ModelConfig built by hand (conversion, tests) is the network a run gets from the same keys left at their
    defaults: every default but the ones a run resolves for its devices ('auto') is the schema's."""
    schema = {f.name: f.default for f in dataclasses.fields(Config)}
    model = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name != "pipeline"}
    resolved = {k for k in model if schema[k] == "auto"}
    assert {k for k in model if k.startswith("rope_")} <= model.keys() - resolved
    assert {k: v for k, v in model.items() if k not in resolved and k != "vocab_size"} == {
        k: schema[k] for k in model if k not in resolved and k != "vocab_size"}
