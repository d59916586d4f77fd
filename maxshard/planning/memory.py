"""Activation memory of one train step per device, counted from the layer shapes under the `remat_policy`.

Per token (one [batch, length] position a device holds), in elements, with per-device widths E = emb_dim,
Q = heads x head_dim, K = kv_heads x head_dim, F = mlp_dim (heads, kv_heads, mlp divided by their tensor shards)
and A = heads x whole length (the attention scores of one query):

    every intermediate of one layer (what `none` keeps, counted from layers/attention.py and layers/mlp.py):
        6E   layer input, attention norm, attention output projection, residual, MLP norm, MLP output
        3Q   queries, rotated queries, attention output [.., heads, head_dim]
        3K   keys, rotated keys, values
        3F   gate, up, silu(gate) x up
        A    scores in float32, probabilities in float32 (4 + 4 bytes) and in the compute dtype

    what a policy saves per layer for the backward pass:
        none               everything above
        minimal            matmul outputs: 3E + 2Q + 2K + 2F + A (float32 scores)
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
    """Per-token, per-device widths of a layer's activations (elements)."""

    embed: int
    q: int
    kv: int
    mlp: int
    scores: int  # heads x whole length

    def layer_bytes(self, itemsize: int) -> int:
        """Every intermediate of one layer, per token."""
        dense = 6 * self.embed + 3 * self.q + 3 * self.kv + 3 * self.mlp
        return dense * itemsize + self.scores * (4 + 4 + itemsize)

    def saved_bytes(self, policy: str, itemsize: int) -> int:
        """What `policy` keeps per layer and token for the backward pass."""
        e, q, kv, f = self.embed, self.q, self.kv, self.mlp
        if policy == "none":
            return self.layer_bytes(itemsize)
        if policy == "minimal":
            return (3 * e + 2 * q + 2 * kv + 2 * f) * itemsize + self.scores * 4
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
    return Widths(
        embed=cfg.emb_dim,
        q=heads * cfg.head_dim,
        kv=kv_heads * cfg.head_dim,
        mlp=_split(cfg.mlp_dim, rule_axes(cfg, ax.ACT_MLP, sizes), sizes),
        scores=heads * cfg.max_target_length,
    )


def activation_bytes(cfg: Config, sizes: Mapping[str, int], geo: Geometry) -> int:
    """The estimate of the module docstring, in bytes per device."""
    w, size = widths(cfg, sizes), geo.compute_itemsize
    tokens = geo.tokens // geo.accumulation
    layers = geo.layers * tokens * w.saved_bytes(cfg.remat_policy, size)
    working = 0 if cfg.remat_policy == "none" else tokens * w.layer_bytes(size)
    vocab = _split(cfg.vocab_size, rule_axes(cfg, ax.ACT_VOCAB, sizes), sizes)
    head = 2 * (geo.outer_tokens // geo.accumulation) * vocab * 4
    return layers + working + head
