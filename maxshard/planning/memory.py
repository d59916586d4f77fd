"""Activation memory of one train step per device, counted from the layer shapes under the `remat_policy`.

Per token (one [batch, length] position a device holds), in elements, with per-device widths E = emb_dim,
Q = heads x head_dim, K = kv_heads x head_dim, F = mlp_dim (heads, kv_heads, mlp divided by their tensor shards)
H = heads per device, and L = the whole length:

    every intermediate of one layer (what `none` keeps, counted from layers/attention.py and layers/mlp.py):
        6E   layer input, attention norm, attention output projection, residual, MLP norm, MLP output
        3Q   queries, rotated queries, attention output [.., heads, head_dim]
        3K   keys, rotated keys, values
        3F   gate, up, silu(gate) x up
        + the attention kernel's own working set, by `attention` (s = compute itemsize):
        dot_product  A = H x L scores per query: float32 scores and probabilities and the probabilities in the
                     compute dtype, (8 + s) x A bytes: quadratic in length
        blockwise    what its backward holds (layers/blockwise_attention.py), linear in length:
                     Q x (5s + 8)  blocked q, output buffer and its unblocked copy, blocked dout, the final dq;
                                   dq in float32 and the stacked float32 dq parts of one key block
                     K x (4s + 8)  blocked k and v, their gradients stacked in float32 and cast back
                     12 H          float32 log-sum-exp, its blocked copy and the row sums D
                     plus, per device rather than per token, one float32 score block [rows, H, block_q,
                     block_kv] (rows: the sequences a device holds; blocks shrunk to the length): the block
                     pair the loop works on (the 1k-32k fit of benchmarks/attention_memory.py)
        cudnn        counted like blockwise, plus the packed-document mask cuDNN takes as a bias: L x s per token
        splash       counted like blockwise (the kernel keeps its output and log-sum-exp, no scores)
        context parallelism (ring attention) adds the K/V chunk in flight and the travelling float32 dK, dV:
                     K x (4s + 8)

    what a policy saves per layer for the backward pass:
        none               everything above
        minimal            matmul outputs: 3E + 2Q + 2K + 2F + float32 scores A (dot_product) or
                           the log-sum-exp 4H (the fused kernels)
        save_qkv_out_proj  layer input + q, k, v + output projection: 2E + Q + 2K
        save_qkv_proj      E + Q + 2K
        save_out_proj      2E
        full               E (the layer input only)

    activations = tokens x (layers x saved + one layer's intermediates while it is recomputed, unless `none`)
                + the output head: logits [tokens, vocab / tensor] in float32, and their gradient.

With gradient accumulation only one microbatch's activations live at a time (tokens / k). With a pipeline a device
runs num_layers / stages layers over all of its microbatches. An MoE layer is counted as its dense MLP (an
estimate: the expert buffers add about top-k x capacity_factor x E per token). XLA's temporaries (gathered
weights, fusion buffers) are not included: compare with `memory_analysis().temp_size_in_bytes` loosely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from maxshard import axis_names as ax
from maxshard.config import Config
from maxshard.planning.traffic import Geometry, rule_axes

__all__ = ["Widths", "widths", "activation_bytes"]


@dataclasses.dataclass(frozen=True)
class Widths:
    """Per-token, per-device widths of a layer's activations (elements), and the attention that runs."""

    embed: int
    q: int
    kv: int
    mlp: int
    heads: int  # query heads per device
    length: int  # the whole sequence length (keys one query can see)
    attention: str = "dot_product"  # resolved implementation
    context: int = 1  # context shards (ring attention)
    block_q: int = 512
    block_kv: int = 512

    @property
    def fused(self) -> bool:
        """Whether attention runs a blockwise kernel (no [length, length] scores)."""
        return self.attention != "dot_product" or self.context > 1

    def block_bytes(self, rows: int) -> int:
        """The float32 score block of the fused kernels, per device (module docstring); 0 for dot_product."""
        if not self.fused:
            return 0
        length = self.length // self.context
        return rows * self.heads * min(self.block_q, length) * min(self.block_kv, length) * 4

    @property
    def scores(self) -> int:
        """Score elements per query of dot-product attention: heads x whole length."""
        return self.heads * self.length

    def attention_bytes(self, itemsize: int) -> int:
        """The attention kernel's working set per token (module docstring)."""
        if not self.fused:
            return self.scores * (4 + 4 + itemsize)
        fused = self.q * (5 * itemsize + 8) + self.kv * (4 * itemsize + 8) + 12 * self.heads
        if self.attention == "cudnn":
            fused += self.length * itemsize
        if self.context > 1:
            fused += self.kv * (4 * itemsize + 8)
        return fused

    def layer_bytes(self, itemsize: int) -> int:
        """Every intermediate of one layer, per token."""
        dense = 6 * self.embed + 3 * self.q + 3 * self.kv + 3 * self.mlp
        return dense * itemsize + self.attention_bytes(itemsize)

    def saved_bytes(self, policy: str, itemsize: int) -> int:
        """What `policy` keeps per layer and token for the backward pass."""
        e, q, kv, f = self.embed, self.q, self.kv, self.mlp
        if policy == "none":
            return self.layer_bytes(itemsize)
        if policy == "minimal":
            kernel = 4 * self.heads if self.fused else self.scores * 4
            return (3 * e + 2 * q + 2 * kv + 2 * f) * itemsize + kernel
        saved = {"save_qkv_out_proj": 2 * e + q + 2 * kv, "save_qkv_proj": e + q + 2 * kv, "save_out_proj": 2 * e}
        return saved.get(policy, e) * itemsize


def _split(n: int, axes: tuple[str, ...], sizes: Mapping[str, int]) -> int:
    for a in axes:
        n //= sizes[a]
    return n


def widths(cfg: Config, sizes: Mapping[str, int]) -> Widths:
    """Per-device widths: heads, kv heads and mlp split over their activation rules' mesh axes."""
    heads = _split(cfg.num_heads, rule_axes(cfg, ax.ACT_HEADS, sizes), sizes)
    kv_heads = _split(cfg.num_kv_heads, rule_axes(cfg, ax.ACT_KV_HEADS, sizes), sizes)
    context = 1
    for axis in rule_axes(cfg, ax.ATTN_LENGTH, sizes):
        context *= sizes[axis]
    return Widths(
        embed=cfg.emb_dim,
        q=heads * cfg.head_dim,
        kv=kv_heads * cfg.head_dim,
        mlp=_split(cfg.mlp_dim, rule_axes(cfg, ax.ACT_MLP, sizes), sizes),
        heads=heads,
        length=cfg.max_target_length,
        attention=cfg.model.attention if cfg.model is not None else "dot_product",
        context=context,
        block_q=cfg.attention_block_q,
        block_kv=cfg.attention_block_kv,
    )


def activation_bytes(cfg: Config, sizes: Mapping[str, int], geo: Geometry) -> int:
    """The estimate of the module docstring, in bytes per device."""
    w, size = widths(cfg, sizes), geo.compute_itemsize
    tokens = geo.tokens // geo.accumulation
    layers = geo.layers * tokens * w.saved_bytes(cfg.remat_policy, size)
    working = 0 if cfg.remat_policy == "none" else tokens * w.layer_bytes(size)
    vocab = _split(cfg.vocab_size, rule_axes(cfg, ax.ACT_VOCAB, sizes), sizes)
    head = 2 * (geo.outer_tokens // geo.accumulation) * vocab * 4
    local_length = _split(cfg.max_target_length, rule_axes(cfg, ax.LENGTH, sizes), sizes)
    block = w.block_bytes(max(tokens // local_length, 1))
    return layers + working + head + block
