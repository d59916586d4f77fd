"""A layer's activation widths per token and device (`Widths`): heads, kv heads, the MLP and the experts divided
over the mesh axes their activation rules name, the attention that runs and how it is tiled, and from them the
bytes one layer saves, holds while it runs and sends to host memory under a remat policy. `planning/memory.py`
combines these per-layer figures into the step's activation terms (its docstring holds the formulas; where each
constant was measured is benchmarks/README.md's); `planning/moe_memory.py` adds the MoE layer's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping


from maxshard.config import Config
from maxshard.model.attention_choice import platform_of
from maxshard.parallel import axis_names as ax
from maxshard.planning import splash_outputs
from maxshard.planning.axes import rule_axes
from maxshard.planning.fitted import compiler, fitted
from maxshard.spec import attention_kinds, mixer_kinds, remat

__all__ = ["Widths", "widths", "split", "latent_query_pad"]


@dataclasses.dataclass(frozen=True)
class Widths:
    """Per-token, per-device widths of a layer's activations (elements), and the attention that runs."""

    embed: int
    q: int
    kv: int
    mlp: int
    heads: int  # query heads per device
    length: int  # the whole sequence length: a dot-product score row, in a local layer too (its window is a mask)
    attention: str = "dot_product"  # resolved implementation
    kernel_fused: bool = False  # it is a fused kernel on the device kind's platform (spec/attention_kinds.py)
    context: int = 1  # context shards (ring attention)
    tensor: bool = False  # heads or mlp split over the `tensor` axis (partial sums before their reduction)
    residual: int = 1  # shards of the residual stream's length beyond the activation length's (tensor_sequence)
    block_q: int = 512
    block_kv: int = 512
    head_dim: int = 0  # for `tile`
    tile: tuple[int, int] | None = None  # Fitted.tile of the compiler: how per-head values are stored
    expert: int = 0  # an expert's hidden width per device (moe_mlp_dim, or the dense mlp's)
    query_pad: int = 0  # latent attention: lanes the tile adds to the stored query (`latent_query_pad`)
    adapted: tuple[str, ...] = ()  # the attention projections ("q", "k", "v") that carry LoRA adapters (`stored`)
    # splash on XLA:TPU: the bytes its largest call writes as block-sized float32 outputs, per sequence row and kv
    # head (planning/splash_outputs.py, read off the installed kernel); None: the kernel's score block instead
    block_outputs: int | None = None
    # Fitted.kept_without_remat of the compiler: what a layer keeps without remat, where it differs from `dense`
    kept_without_remat: tuple[int, int, int, int] | None = None

    @property
    def fused(self) -> bool:
        """Whether attention runs a blockwise kernel (no [length, length] scores): a fused one, or the ring's."""
        return self.kernel_fused or self.context > 1

    @property
    def scores(self) -> int:
        """Score elements per query of dot-product attention: heads x whole length."""
        return self.heads * self.length

    def block_bytes(self, rows: int) -> int:
        """The fused kernels' block-sized float32 buffers per device: a score block per row and head, or what the
        splash kernel writes per row and kv head (`block_outputs`); 0 for dot_product."""
        if not self.fused:
            return 0
        if self.block_outputs is not None:
            return rows * (self.kv // self.head_dim) * self.block_outputs
        length = self.length // self.context
        return rows * self.heads * min(self.block_q, length) * min(self.block_kv, length) * 4

    @property
    def stream(self) -> int:
        """Per-device width of one token of the residual stream, [length / residual, embed] counted per token."""
        return self.embed // self.residual

    def dense_bytes(self, itemsize: int) -> int:
        """What one layer keeps without remat, attention kernel aside (module docstring: `dense`)."""
        return (7 * self.stream + self._layout_extra + 3 * self.q + self.kv + 6 * self.mlp) * itemsize

    @property
    def _layout_extra(self) -> int:
        """E-wide elements a layer keeps per token because of the layout: attention's and the MLP's inputs gathered
        back to full length (tensor_sequence), and a row-parallel projection's partial sum before its reduction."""
        return 2 * (self.embed - self.stream) + (self.embed if self.tensor else 0)

    def kept_bytes(self, itemsize: int) -> int:
        """What one layer keeps without remat, its attention kernel's residuals included: `dense` and the kernel's,
        or, where the compiler keeps other values (`kept_without_remat`, XLA:TPU) and the kernel is fused, those
        counts of E, Q and K-wide values, 6 F-wide and the kernel's float32 log-sum-exp."""
        if self.kept_without_remat is None or not self.fused:
            return self.dense_bytes(itemsize) + self.kernel_saved_bytes(itemsize)
        e32, e, q, k = self.kept_without_remat
        return ((e * self.stream + self._layout_extra + q * self.q + k * self.kv + 6 * self.mlp) * itemsize
                + e32 * self.stream * 4 + 4 * self.heads)

    def kernel_saved_bytes(self, itemsize: int) -> int:
        """What the attention kernel keeps for its backward without remat."""
        return self.q * itemsize + 4 * self.heads if self.fused else 8 * self.scores

    def kernel_working_bytes(self, itemsize: int, score_bytes: float) -> float:
        """The attention kernel's share of one layer's backward working set (`score_bytes` per dot-product score)."""
        if not self.fused:
            return score_bytes * self.scores
        fused = self.q * (5 * itemsize + 8) + self.kv * (4 * itemsize + 8) + 12 * self.heads
        if self.attention == "cudnn":
            fused += self.length * itemsize  # the packed-document mask cuDNN takes as a bias
        # each ring step after the first (its loop is unrolled, layers/ring_attention.py) holds its float32 dq partial,
        # the K/V chunk it received and the travelling float32 dK, dV: with q = kv at 2 shards, kv x (4 itemsize + 8).
        # Counting one step alone under-planned from 4 shards on (benchmarks/README.md, "Held-out shapes", "Context")
        fused += (self.context - 1) * (4 * self.q + self.kv * (2 * itemsize + 8))
        return fused

    def stored(self, width: int, projection: str = "") -> int:
        """Elements per token of a projection's per-head output (width = heads x head_dim, [.., heads, head_dim]) as
        the compiler stores it (`tile`): head_dim padded to whole lanes, heads to whole rows (fewer than a tile's rows
        take the smallest power of two that holds them, as XLA:TPU picks T(2,128) or T(4,128) tiles for them).

        A projection with a LoRA adapter (`adapted`) is stored with its heads unpadded, [.., heads, lanes]: XLA:TPU's
        host buffers of an adapted layer under the offload policies hold q, k, v in that layout, to the byte, not in
        the unadapted layout's whole tiles of rows (benchmarks/README.md, "Held-out shapes": the LoRA + offload rows,
        tests/test_plan_heldout_tpu.py). The same layout is assumed for q, k, v saved on the device under a
        save_qkv_* policy with adapters (not measured)."""
        if self.tile is None or not self.head_dim:
            return width
        rows, lanes = self.tile
        heads = width // self.head_dim
        if projection in self.adapted:
            padded = heads
        else:
            padded = 1 << (heads - 1).bit_length() if heads < rows else -(-heads // rows) * rows
        return padded * -(-self.head_dim // lanes) * lanes

    @property
    def stored_query(self) -> int:
        """Elements per token of the query projection's output as stored, latent attention's lane padding included."""
        return self.stored(self.q, "q") + self.query_pad

    def name_width(self, name: str) -> int:
        """Per-token elements of a value a policy names (maxshard/spec/remat.py), as stored."""
        widths = {remat.LAYER_INPUT: self.stream, "query_proj": self.stored_query,
                  "key_proj": self.stored(self.kv, "k"), "value_proj": self.stored(self.kv, "v"),
                  "out_proj": self.embed}
        return widths[name]

    def saved_bytes(self, policy: remat.Policy, itemsize: int) -> int:
        """What `policy` keeps per layer and token in device memory for the backward pass."""
        q, k, v, f = self.q, self.stored(self.kv, "k"), self.stored(self.kv, "v"), self.mlp
        if policy.keeps == "everything":
            return self.kept_bytes(itemsize)
        if policy.keeps == "dots":  # the projections' q, k, v as stored, the attention output (not [.., heads, dim])
            kernel = 4 * self.heads if self.fused else 4 * self.scores
            matmuls = 2 * self.stream + self.stored_query + q + k + v + 2 * f  # row-parallel outputs split
            return matmuls * itemsize + kernel
        kept = (remat.LAYER_INPUT, *policy.device) if remat.LAYER_INPUT not in policy.host else policy.device
        return sum(self.name_width(n) for n in kept) * itemsize

    def host_bytes(self, policy: remat.Policy, itemsize: int) -> int:
        """What `policy` moves to host memory per layer and token."""
        return sum(self.name_width(n) for n in policy.host) * itemsize

    def working_bytes(self, policy: remat.Policy, itemsize: int, compiler_name: str = "xla:cpu") -> float:
        """One layer's backward working set per token (module docstring)."""
        partials = 3 * self.embed * itemsize if self.tensor else 0  # column-parallel input gradients, unreduced
        dense, scores, mlp = fitted(compiler_name).working[remat.on_device(policy).name]
        return (dense * self.dense_bytes(itemsize) + self.kernel_working_bytes(itemsize, scores)
                + mlp * self.mlp * itemsize + partials)

    def unit_working_bytes(self, policy: remat.Policy, itemsize: int, compiler_name: str, layers: int) -> float:
        """The backward working set per token of one stacked unit of `layers` layers, rematerialised as one: its
        forward re-runs whole, so every layer but the one being differentiated holds what the policy did not keep
        (everything a layer keeps without remat, less what the policy saves) beside that layer's working set."""
        # `dense`, not `kept_bytes`: the share `Fitted.unit_kept` of it was fitted on that count
        everything = self.dense_bytes(itemsize) + self.kernel_saved_bytes(itemsize)
        recomputed = max(everything - self.saved_bytes(remat.on_device(policy), itemsize), 0)
        layer = self.working_bytes(policy, itemsize, compiler_name)
        if not recomputed:  # nothing re-runs (none): XLA:CPU held every layer's working set (tests/test_plan_memory)
            return layers * layer
        return layer + (layers - 1) * recomputed * fitted(compiler_name).unit_kept


def latent_query_pad(cfg: Config, heads: int, tile: tuple[int, int] | None) -> int:
    """Per token, the lanes the tiled layout adds to latent attention's stored query [.., heads, n + p] (per device)
    beyond its n + p features: what the layer trace cannot see. `residuals.option_bytes` counts the query's p RoPE
    features beyond a grouped-query head (its elements, unpadded); the tile pads n + p to whole lanes, 128 + 64 ->
    256 for DeepSeek-V3 and Moonlight, as the moonlight_16b preset's saved query in XLA:TPU's buffer assignment
    shows (benchmarks/README.md, "DeepSeek-style on XLA:TPU")."""
    if tile is None or not mixer_kinds.latent(cfg.attention_type):
        return 0
    width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    return heads * (-(-width // tile[1]) * tile[1] - width)


def split(n: int, axes: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    """`n` divided by the sizes of `axes` (a dimension's share per device)."""
    for a in axes:
        n //= sizes[a]
    return n


def _shards_beyond(cfg: Config, sizes: Mapping[str, int]) -> int:
    """How many more pieces the residual stream's length (activation_norm_length: tensor_sequence too, see
    layers/decoder.py) is cut into than the activation length's."""
    length_axes = set(rule_axes(cfg, ax.LENGTH, sizes))
    return math.prod(sizes[a] for a in rule_axes(cfg, ax.NORM_LENGTH, sizes) if a not in length_axes)


def widths(cfg: Config, sizes: Mapping[str, int]) -> Widths:
    """Per-device widths: heads, kv heads and mlp split over their activation rules' mesh axes."""
    head_axes, mlp_axes = rule_axes(cfg, ax.ACT_HEADS, sizes), rule_axes(cfg, ax.ACT_MLP, sizes)
    heads = split(cfg.num_heads, head_axes, sizes)
    kv_heads = split(cfg.num_kv_heads, rule_axes(cfg, ax.ACT_KV_HEADS, sizes), sizes)
    mlp = split(cfg.mlp_dim, mlp_axes, sizes)
    expert = split(cfg.model.expert_dim, mlp_axes, sizes) if cfg.model is not None else mlp
    context = 1
    for axis in rule_axes(cfg, ax.ATTN_LENGTH, sizes):
        context *= sizes[axis]
    attention = cfg.model.attention if cfg.model is not None else "dot_product"
    f = fitted(compiler(cfg))
    tile = f.tile
    return Widths(
        embed=cfg.emb_dim,
        q=heads * cfg.head_dim,
        kv=kv_heads * cfg.head_dim,
        mlp=mlp,
        heads=heads,
        length=cfg.max_target_length,
        attention=attention,
        kernel_fused=attention_kinds.fused(attention, platform_of(cfg.device_kind or "cpu")),
        context=context,
        tensor="tensor" in (*head_axes, *mlp_axes),
        residual=_shards_beyond(cfg, sizes),
        block_q=cfg.attention_block_q,
        block_kv=cfg.attention_block_kv,
        head_dim=cfg.head_dim,
        tile=tile,
        expert=expert,
        query_pad=latent_query_pad(cfg, heads, tile),
        adapted=tuple(t for t in ("q", "k", "v") if cfg.model is not None and cfg.model.lora_rank_of(t)),
        block_outputs=_splash_outputs(cfg, attention, context, heads // max(kv_heads, 1), tile),
        kept_without_remat=f.kept_without_remat,
    )


def _splash_outputs(cfg: Config, attention: str, context: int, group: int,
                    tile: tuple[int, int] | None) -> int | None:
    """`Widths.block_outputs`: splash's block-sized float32 outputs where a tiled compiler (XLA:TPU) runs the kernel
    itself (not the ring's steps, which run blockwise), per sequence row and kv head of `group` query heads; None
    elsewhere."""
    if attention != "splash" or context > 1 or tile is None:
        return None
    length = cfg.max_target_length
    return splash_outputs.largest_call_bytes(max(group, 1), cfg.head_dim, min(cfg.attention_block_q, length),
                                             min(cfg.attention_block_kv, length), tile)
