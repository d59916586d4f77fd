"""MXFP4 expert tensors (GPT-OSS's released checkpoints): read as the plain tensors they stand for.

The released gpt-oss checkpoints (config.json `quantization_config.quant_method: mxfp4`) store each layer's expert
projections as two uint8 tensors instead of `experts.gate_up_proj` / `experts.down_proj`:

    {name}_blocks  [experts, out, in / 32, 16]   two FP4 (e2m1) codes per byte, low nibble first
    {name}_scales  [experts, out, in / 32]       one power-of-two exponent per block of 32 values, biased by 127

Value j of a block of 32 is FP4[code j] * 2 ** (scale - 127), with the e2m1 table below (code 8..15: the negatives
of 0..7); the [experts, out, in] result is transposed to transformers' parameter layout [experts, in, out]. This is
the arithmetic of transformers' `convert_moe_packed_tensors` (integrations/mxfp4.py), which is how transformers
loads these checkpoints when it dequantizes. Every such value is exact in bfloat16 and float32, so dequantizing to
the checkpoint's own dtype loses nothing.

`pair` replaces each {name}_blocks + {name}_scales pair of a source by one virtual tensor `name` of the plain shape
and the source's float dtype; `Source.read` (safetensors_io.py) dequantizes its rows (experts) when they are read,
one block of experts at a time, so the converter's memory bound holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from maxshard.errors import ConfigError

__all__ = ["FP4_VALUES", "SUFFIXES", "dequantize", "pair"]

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
SUFFIXES = ("_blocks", "_scales")
_SCALE_BIAS = 127


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """blocks [..., out, groups, 16] uint8 and scales [..., out, groups] uint8 -> [..., groups * 32, out] in
    `dtype`: the codes looked up, low nibble before high, scaled by 2 ** (scale - 127), the last two dims swapped."""
    if blocks.shape[:-1] != scales.shape:
        raise ConfigError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], -1)  # [..., out, g, 32]
    exponent = scales.astype(np.int32) - _SCALE_BIAS
    values = np.ldexp(FP4_VALUES[codes], exponent[..., None])  # exact: powers of two times e2m1 values
    values = values.reshape(*blocks.shape[:-2], -1)  # [..., out, in]
    return np.swapaxes(values, -1, -2).astype(dtype)


def pair(tensors: Mapping[str, object], dtype: np.dtype) -> dict[str, object]:
    """`tensors` (name -> safetensors_io.TensorInfo) with each {name}_blocks/_scales pair replaced by one virtual
    TensorInfo `name` of the dequantized shape, `dtype` and `mxfp4` set to (blocks, scales); a lone half is an
    error naming it."""
    out = {n: t for n, t in tensors.items() if not n.endswith(SUFFIXES)}
    for name in sorted(n for n in tensors if n.endswith(SUFFIXES)):
        base = name[: -len("_blocks")]
        blocks, scales = tensors.get(base + "_blocks"), tensors.get(base + "_scales")
        if blocks is None or scales is None:
            raise ConfigError(f"{name} has no {'_scales' if scales is None else '_blocks'} partner (MXFP4 tensors "
                              "come in pairs)")
        *lead, out_dim, groups, width = blocks.shape
        out[base] = dataclasses.replace(blocks, name=base, dtype=dtype, shape=(*lead, groups * width * 2, out_dim),
                                        mxfp4=(blocks, scales))
    return out
