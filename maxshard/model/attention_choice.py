"""Which attention implementation a run uses, resolved once when the run is loaded, and what each one needs.

`attention: auto` becomes, by the device kind the config was finalized for:

    TPU           splash (the Pallas kernel), or blockwise when the blocks do not suit it (they must divide the
                  length, and the key block must be a multiple of 128)
    NVIDIA GPU    tokamax on Hopper/Blackwell where the package is installed (`.[cuda]` installs it) and the
                  config suits its kernel, else cudnn when the compute dtype is bfloat16/float16 and head_dim suits
                  cuDNN, else blockwise. tokamax's Mosaic GPU kernel takes the documents as key offsets and skips
                  the blocks before a document, where cuDNN gets a dense mask, so it is the faster of the two
                  (benchmarks/README.md, "On one H200: tokamax and 8-bit dots, and the accelerator tests")
    CPU, other    blockwise when the length exceeds one block (max of attention_block_q/kv), dot_product up to
                  one block, where both hold the same [length, length] scores (benchmarks/README.md, "Attention
                  memory")

An explicit kernel of an accelerator runs on CPU through its stand-in (attention_kinds.py `cpu_stand_in`, the
startup line): splash in Pallas interpret mode, tokamax's XLA reference, cudnn's call through XLA; so a TPU or GPU
config runs on a laptop. The XLA stand-ins take any config, so the GPU kernels' checks (dtype, head_dim, length)
apply on a GPU only; interpreted splash is the same kernel and keeps its blocks' needs. tokamax is refused on TPUs
(splash is the TPU kernel).

An explicit choice that cannot work is a ConfigError here, before anything compiles, naming the key and what is
allowed: where each implementation runs and what it needs installed are its row of `attention_kinds.py`, what it
needs of the config (blocks, dtype, head_dim) the `_*_problem` checks below. Two layouts are checked too: sequence
parallelism shards attention heads over `sequence` (with the tensor axes), so the heads must divide; context
parallelism (ring attention) needs the length to split into 2 x context chunks and runs every implementation's ring
steps with the blockwise kernel (a documented fallback: the fused kernels take no ring offsets), and does not combine
with a pipeline.

The model's local/global options (`sliding_window`, `attn_logit_softcapping`, `attention_sinks`: a window, Gemma 2's
logit soft-cap, GPT-OSS's sinks) are what `attention_ops.attend` passes its kernel; a row of attention_kinds.py lists
those its kernel takes. `auto` never picks a kernel that lacks one the model uses (blockwise takes them all), and an
explicit choice that lacks one is a ConfigError naming the key.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Mapping

from maxshard import devices
from maxshard.config.schema import Config
from maxshard.errors import ConfigError
from maxshard.spec import attention_kinds, mixer_kinds
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import axes_of, flax_rules

__all__ = ["platform_of", "resolve", "model_options"]

def platform_of(device_kind: str) -> str:
    """'tpu', 'nvidia', or 'cpu' (CPU and anything else: only the portable implementations): the platforms of
    attention_kinds.py's rows."""
    chip = devices.by_kind(device_kind)
    if chip is not None:
        return {"tpu": "tpu", "gpu": "nvidia", "cpu": "cpu"}[chip.accelerator]
    kind = device_kind.strip().lower()  # a chip the registry lacks: JAX's kinds start "TPU" or name NVIDIA
    if kind.startswith("tpu"):
        return "tpu"
    return "nvidia" if "nvidia" in kind or kind.startswith(("b100", "b200", "gb200")) else "cpu"


# The model keys behind `attention_ops.attend`'s options, and each key's "off" value.
_OPTION_KEYS = {"window": ("sliding_window", 0), "softcap": ("attn_logit_softcapping", 0.0),
                "sinks": ("attention_sinks", False)}


def model_options(cfg: Config) -> tuple[str, ...]:
    """The options of `attention_ops.attend` this model's attention layers use ("window", "softcap", "sinks"): those
    whose key is set (a window: some layer of attention_pattern is local, config/ranges.py ties the two)."""
    return tuple(name for name, (key, off) in _OPTION_KEYS.items() if getattr(cfg, key) != off)


def _untaken(cfg: Config, supported: tuple[str, ...]) -> list[str]:
    """The model keys of the options in use that a kernel taking `supported` lacks."""
    return [_OPTION_KEYS[name][0] for name in model_options(cfg) if name not in supported]


def _splash_problem(cfg: Config) -> str:
    """Why the splash kernel cannot take this config's blocks ('' when it can): the blocks (shrunk to the length)
    must divide the length, and the key block must fill whole 128-lane vregs."""
    length = cfg.max_target_length
    if any(length % min(b, length) for b in (cfg.attention_block_q, cfg.attention_block_kv)):
        return (f"max_target_length={length} to be a multiple of attention_block_q={cfg.attention_block_q} and "
                f"attention_block_kv={cfg.attention_block_kv}")
    if min(cfg.attention_block_kv, length) % 128:
        return "a key block (attention_block_kv, or the length if shorter) that is a multiple of 128"
    return ""


def _head_width(cfg: Config) -> tuple[int, str]:
    """(the head width a kernel sees, the keys that set it): head_dim, or under latent attention the query/key
    heads' qk_nope_head_dim + qk_rope_head_dim, which `attention_ops.one_width` pads the value heads to when wider;
    the widest of head_dim and the global layers' global_head_dim (Gemma 4)."""
    if mixer_kinds.latent(cfg.attention_type):
        width = max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
        return width, "attention_type=mla's max(qk_nope_head_dim + qk_rope_head_dim, v_head_dim)"
    if cfg.global_head_dim > cfg.head_dim:
        return cfg.global_head_dim, "global_head_dim"
    return cfg.head_dim, "head_dim"


def _hopper_or_later(cfg: Config) -> bool:
    """Whether the device kind is an NVIDIA Hopper or Blackwell GPU (sm90/sm100)."""
    return bool(re.search(r"\bg?[hb]\d{2,3}\b", (cfg.device_kind or "").lower()))  # H100, H200, H800, GH200, B200


def _cudnn_problem(cfg: Config, dtype: str) -> str:
    """Why cuDNN flash attention cannot run this config ('' when it can). Head widths up to 256 on Hopper and
    later, 128 before (jax's cuDNN check, jax/_src/cudnn/fused_attention_stablehlo.py: DeepSeek's 192-wide
    query/key heads need an H100)."""
    if dtype not in ("bfloat16", "float16"):
        return f"dtype bfloat16 or float16 (the compute dtype is {dtype})"
    width, keys = _head_width(cfg)
    widest = 256 if _hopper_or_later(cfg) else 128
    if width % 8 or width > widest:
        return f"{keys} a multiple of 8 and at most {widest} on device kind {cfg.device_kind!r} (got {width})"
    return ""


def _tokamax_problem(cfg: Config, dtype: str) -> str:
    """Why tokamax's Mosaic GPU FlashAttention cannot run this config on an NVIDIA GPU ('' when it can), from its
    source (tokamax 0.0.12, ops/attention/pallas_mosaic_gpu*.py): sm90/sm100 only; 16-bit inputs at default
    precision; the forward kernel reduces the per-query key offsets over tiles of 2 x 64 queries (its heuristic
    block), so the length must fill whole tiles; head_dim up to 256 keeps the heuristic blocks in shared memory."""
    if not _hopper_or_later(cfg):
        return f"a Hopper or Blackwell GPU (sm90/sm100; device kind {cfg.device_kind!r})"
    if dtype not in ("bfloat16", "float16"):
        return f"dtype bfloat16 or float16 (the compute dtype is {dtype})"
    if cfg.max_target_length % 128:
        return f"max_target_length a multiple of 128 (got {cfg.max_target_length})"
    width, keys = _head_width(cfg)
    if width > 256:
        return f"{keys} at most 256 (got {width})"
    return ""


def _auto(cfg: Config, dtype: str, platform: str) -> str:
    """The fastest implementation that takes this config on `platform` (module docstring), or blockwise, which
    takes every option, when that one lacks an option the model uses (cudnn: soft-cap and sinks)."""
    if platform == "tpu":
        choice = "splash" if not _splash_problem(cfg) else "blockwise"
    elif platform == "nvidia":
        return _auto_nvidia(cfg, dtype)
    else:
        one_block = max(cfg.attention_block_q, cfg.attention_block_kv)
        choice = "blockwise" if cfg.max_target_length > one_block else "dot_product"
    return "blockwise" if _untaken(cfg, attention_kinds.kind(choice).options) else choice


def _auto_nvidia(cfg: Config, dtype: str) -> str:
    """The first of tokamax (installed, Hopper or later), cudnn that takes this config and every option the model
    uses (tokamax: window and soft-cap; cudnn: window), else blockwise (it takes them all)."""
    candidates = (("tokamax", importlib.util.find_spec("tokamax") is not None and not _tokamax_problem(cfg, dtype)),
                  ("cudnn", not _cudnn_problem(cfg, dtype)))
    return next((name for name, runs in candidates
                 if runs and not _untaken(cfg, attention_kinds.kind(name).options)), "blockwise")


def _check_explicit(cfg: Config, dtype: str, platform: str) -> None:
    """An explicit implementation that cannot run here is a ConfigError: a missing package, a platform its row of
    attention_kinds.py leaves out, or a config its kernel cannot take (`_problem`)."""
    row, device = attention_kinds.kind(cfg.attention), cfg.device_kind or "cpu"
    if row.package and importlib.util.find_spec(row.package) is None:
        raise ConfigError(f"attention={row.name} needs the {row.package} package: pip install -e '.[{row.package}]'")
    if platform not in row.platforms:
        raise ConfigError(f"attention={row.name} {row.off_platform} (device kind {device!r}); use {row.instead}")
    untaken = _untaken(cfg, row.options)
    if untaken:
        raise ConfigError(f"attention={row.name} cannot take {', '.join(untaken)} (its kernel lacks them); use "
                          "attention=blockwise, dot_product or auto")
    problem, instead = _problem(cfg, dtype, platform)
    if problem:
        raise ConfigError(f"attention={row.name} needs {problem}; use {instead}")


def _problem(cfg: Config, dtype: str, platform: str) -> tuple[str, str]:
    """What keeps the chosen kernel from this config on its platform ('' when nothing), and what to use instead.
    cudnn and tokamax are checked on a GPU only: on CPU their XLA stand-ins take any config."""
    if cfg.attention == "cudnn" and platform == "nvidia":
        return _cudnn_problem(cfg, dtype), "attention=blockwise or auto"
    if cfg.attention == "splash":
        return _splash_problem(cfg), "attention=blockwise (any length) or auto"
    if cfg.attention == "tokamax" and platform == "nvidia":
        return _tokamax_problem(cfg, dtype), "attention=cudnn or auto"
    return "", ""


def _head_shards(cfg: Config, sizes: Mapping[str, int], logical: str, array: tuple[str | None, ...]) -> int:
    """How many ways the rules split the heads named `logical` of q, k or v inside attention (`array`)."""
    return math.prod(sizes[a] for a in axes_of(logical, array, flax_rules(cfg), sizes))


def _check_layout(cfg: Config, sizes: Mapping[str, int]) -> None:
    heads = _head_shards(cfg, sizes, ax.ATTN_HEADS, ax.ATTN_QUERY)
    kv_heads = _head_shards(cfg, sizes, ax.ATTN_KV_HEADS, ax.ATTN_KEY_VALUE)
    num_kv_heads = cfg.num_heads if mixer_kinds.latent(cfg.attention_type) else cfg.num_kv_heads  # mla: a k/v head per head
    num_kv_heads = math.gcd(num_kv_heads, cfg.global_num_kv_heads or num_kv_heads)  # both kinds' (Gemma 4)
    if sizes.get("sequence", 1) > 1 and (num_kv_heads % kv_heads or cfg.num_heads % heads):
        ways = f"{heads}" if heads == kv_heads else f"{heads} and {kv_heads}"
        raise ConfigError(
            f"ici/dcn_sequence_parallelism={sizes['sequence']}: attention shards heads over sequence x tensor "
            f"axes ({ways} ways), which must divide num_heads={cfg.num_heads} and num_kv_heads={num_kv_heads}; "
            "use context parallelism (ici_context_parallelism) for models with few kv heads"
        )
    context = sizes.get("context", 1)
    if context > 1:
        if cfg.max_target_length % (2 * context):
            raise ConfigError(f"ici/dcn_context_parallelism={context} needs max_target_length="
                              f"{cfg.max_target_length} to be a multiple of 2 x {context} (load-balanced chunks)")
        if sizes.get("stage", 1) > 1:
            raise ConfigError("context parallelism does not combine with pipeline parallelism; "
                              "set ici/dcn_context_parallelism=1 or ici/dcn_pipeline_parallelism=1")
        untaken = _untaken(cfg, attention_kinds.RING_OPTIONS)
        if untaken:
            raise ConfigError(f"ici/dcn_context_parallelism={context}: ring attention cannot take "
                              f"{', '.join(untaken)}; set ici/dcn_context_parallelism=1")


def resolve(cfg: Config, dtype: str, sizes: Mapping[str, int]) -> str:
    """The concrete implementation of `cfg.attention` for the config's device kind and resolved compute dtype."""
    platform = platform_of(cfg.device_kind or "cpu")
    _check_layout(cfg, sizes)
    if cfg.attention == "auto":
        return _auto(cfg, dtype, platform)
    _check_explicit(cfg, dtype, platform)
    return cfg.attention
