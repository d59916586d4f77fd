"""The attention implementations (`attention`): one row each, so an implementation is named here once. Read by the
config schema (the allowed names), `attention_choice` (where an explicit choice may run, what it needs),
`layers/attention_ops` (the dispatch: a row's kernel is that module's function of the same name) and the planner
(`planning/memory.py`: whether a [q, kv] score matrix exists).

Platforms are `attention_choice.platform_of`'s: "tpu", "nvidia" (an NVIDIA GPU) and "cpu" (CPU and anything else).
A row says where an explicit choice runs (anywhere else it is refused at load time with `off_platform` and
`instead`; an accelerator's kernel runs on CPU only through a stand-in of the same contract, `cpu_stand_in`, which a
run names at startup), and where it is a fused kernel: one that never materialises a [q, kv] score matrix, holding a
block of scores and a float32 log-sum-exp per query instead (the planner's memory model; ring attention, a layout
rather than a row, is fused too). How `auto` picks among them, and the per-config checks (block sizes, dtype,
head_dim), are `attention_choice`'s.

Packed documents reach every kernel as segment ids [batch, length]; `segment_ids` says whether the kernel takes
them as such, or the implementation turns them into what its kernel takes (a dense mask, per-query key offsets).
"""

from __future__ import annotations

import dataclasses

__all__ = ["PLATFORMS", "Kind", "KINDS", "NAMES", "RING_OPTIONS", "kind", "fused"]

PLATFORMS = ("tpu", "nvidia", "cpu")


@dataclasses.dataclass(frozen=True)
class Kind:
    """One attention implementation (module docstring)."""

    name: str
    platforms: tuple[str, ...]  # where an explicit choice runs
    fused_on: tuple[str, ...]  # where it is a fused kernel: no [q, kv] scores (planning/memory.py)
    segment_ids: bool  # its kernel takes the documents as segment ids (else a mask or offsets made from them)
    blocks: bool  # it takes attention_block_q / attention_block_kv
    per_device: bool  # a kernel XLA cannot partition: it runs on each device's shard (shard_map)
    summary: str
    off_platform: str = ""  # a refused explicit choice: "attention=NAME {off_platform} (device kind ...)"
    instead: str = ""  # ... "; use {instead}"
    package: str = ""  # an optional package it needs (`pip install -e '.[{package}]'`)
    # it takes value heads of another width than query/key heads (latent attention); else `attention_ops.attend`
    # zero-pads the narrower to one width, exact, at the padded width's cost (`attention_ops.one_width`)
    value_width: bool = False
    # the local/global options its kernel takes (`attention_ops.attend`: "window", "softcap", "sinks"); any other
    # is refused in one line
    options: tuple[str, ...] = ()
    # an accelerator's kernel that "cpu" in `platforms` runs through a stand-in of the same contract: what runs
    # there, the rest of the startup line "attention=NAME: ..." (run/stand_ins.py); "" where the kernel itself runs
    cpu_stand_in: str = ""


KINDS = (
    Kind("dot_product", PLATFORMS, (), True, False, False,
         "scores [batch, kv_heads, group, q_len, kv_len] in float32: the reference, memory quadratic in length",
         value_width=True, options=("window", "softcap", "sinks")),
    Kind("blockwise", PLATFORMS, PLATFORMS, True, True, False,
         "online softmax over blocks with a custom VJP (layers/blockwise_attention.py): linear memory, any backend",
         value_width=True, options=("window", "softcap", "sinks")),
    Kind("cudnn", ("nvidia", "cpu"), ("nvidia",), False, False, False,
         "cuDNN flash attention (jax.nn.dot_product_attention), the documents as a dense [q, kv] mask",
         off_platform="needs an NVIDIA GPU", instead="auto, blockwise or dot_product",
         options=("window",),  # jax.nn.dot_product_attention has local_window_size, no soft-cap, no sinks
         cpu_stand_in="a GPU kernel; on CPU jax.nn.dot_product_attention computes the same call through XLA "
                      "(same contract, the whole [q, kv] scores)"),
    Kind("splash", ("tpu", "cpu"), ("tpu", "cpu"), True, True, True,
         "the Pallas TPU splash kernel; lengths a multiple of the blocks",
         off_platform="is a TPU kernel", instead="cudnn or auto", value_width=True,
         options=("window", "softcap", "sinks"),  # LocalMask, attn_logits_soft_cap, sinks
         cpu_stand_in="a TPU kernel; on CPU Pallas interprets it (the same kernel, much slower)"),
    Kind("tokamax", ("nvidia", "cpu"), ("nvidia",), False, False, True,
         "tokamax's Pallas Mosaic GPU FlashAttention (Hopper, Blackwell), the documents as per-query key offsets",
         off_platform="is a GPU kernel", instead="splash or auto", package="tokamax", value_width=True,
         options=("window", "softcap"),  # Mask(k_start), logits_soft_cap; tokamax 0.0.12 has no sinks
         cpu_stand_in="a GPU kernel; on CPU tokamax's XLA reference runs instead (same contract, the whole "
                      "[q, kv] scores)"),
)
NAMES = tuple(k.name for k in KINDS)
# the options ring attention (context parallelism, a layout not a row, blockwise steps) takes
RING_OPTIONS: tuple[str, ...] = ("window", "softcap", "sinks")
_BY_NAME = {k.name: k for k in KINDS}


def kind(name: str) -> Kind:
    """The implementation called `name` (KeyError for `auto`, which the loader resolves first)."""
    return _BY_NAME[name]


def fused(name: str, platform: str) -> bool:
    """Whether implementation `name` runs as a fused kernel on `platform` (no [q, kv] scores)."""
    return platform in kind(name).fused_on
