"""One inventory of a model's matmuls per token, by part of the layer: the model's FLOP count, the remat policies'
recompute cost, the 8-bit share of a quantized run and the LoRA count all read it.

Why one: the planner's recompute factors and the model's FLOPs were two hand-written copies, and the second one
missed the shared experts, the router and `moe_layer_interval` (an MoE model whose dense layers have one MLP).
Parts are named as the remat table names what a policy recomputes (`maxshard/spec/remat.py`: qkv, out, attention,
mlp), so a policy's cost is a sum over this inventory.
"""

from __future__ import annotations

import dataclasses

from maxshard.spec import blocks, mixer_kinds
from maxshard.spec.model_config import ModelConfig

__all__ = ["Matmuls", "matmuls", "keys_seen", "attention_flops", "layer_flops", "matmul_params", "lora_matmul_params",
           "flops_per_token"]


@dataclasses.dataclass(frozen=True)
class Matmuls:
    """Parameters per token that take part in a matmul, summed over the decoder stack, by part (x 2 = forward FLOPs).

    An MoE layer's MLP is the k routed experts a token visits, its shared experts and the router [embed, experts];
    a dense layer's is one MLP (gate, up, down); Gemma 4's MoE layers (`moe_beside_dense`) have both."""

    qkv: int
    out: int
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    router: int
    head: int  # the output projection (tied to the embedding or not), and each MTP module's eh_proj and head
    # Gemma 4's per-layer inputs: each layer's gate [embed, P] and projection back [P, embed] (with its MLP, what a
    # remat policy recomputes of the layer), and the embedded tokens' projection [embed, layers x P] once
    per_layer_inputs: int = 0

    @property
    def mlp(self) -> int:
        return self.dense_mlp + self.routed_experts + self.shared_experts + self.router + self.per_layer_inputs

    @property
    def total(self) -> int:
        return self.qkv + self.out + self.mlp + self.head


def matmuls(cfg: ModelConfig) -> Matmuls:
    """The sum over every decoder layer's kinds (spec/blocks.py), the multi-token prediction modules' layers
    (layers/mtp.py: a layer of the main stack's last kind each) and the heads."""
    parts = dict.fromkeys(("qkv", "out", "dense_mlp", "routed_experts", "shared_experts", "router"), 0)
    for layer in (*blocks.layers(cfg), *blocks.mtp_layers(cfg)):
        own = blocks.layer_config(cfg, layer)  # its own head shape and MLP width (Gemma 4)
        reused = layer.mixer.reused(own) if layer.kv_shared else {}  # a KV-shared layer projects no keys or values
        for part, params in (*layer.mixer.params(own).items(), *blocks.mlp_params(own, layer.mlp).items()):
            parts[part] += params - reused.get(part, 0)
    mtp = cfg.mtp_depth * 2 * cfg.emb_dim * cfg.emb_dim  # eh_proj: [2, embed] -> embed
    per_layer = 3 * cfg.num_layers * cfg.emb_dim * cfg.per_layer_input_dim  # gate and out each layer, the projection
    return Matmuls(**parts, head=(1 + cfg.mtp_depth) * cfg.emb_dim * cfg.vocab_size + mtp, per_layer_inputs=per_layer)


keys_seen = mixer_kinds.keys_seen  # one home (spec/mixer_kinds.py): the attention rows' FLOPs read it there


def attention_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of the token mixers beyond their matmuls, over the stack: each row's `flops`
    (spec/mixer_kinds.py). For softmax attention, its scores and values: q.k is 2 x keys x heads x qk_head_dim and
    p.v 2 x keys x heads x v_head_dim, where keys are the ones a query sees (`keys_seen`: length / 2 causal, about the
    window in a local layer, half the chunk in a chunked one). What the model needs, as MFU counts it, not what a
    kernel executes: dot_product computes the whole [length, length] scores and masks them, for a window as for
    causality. The multi-token prediction modules' layers (`blocks.mtp_layers`) count as decoder layers."""
    total = 0.0
    for layer in (*blocks.layers(cfg), *blocks.mtp_layers(cfg)):
        total += layer.mixer.flops(blocks.layer_config(cfg, layer), layer.local)
    return round(total)


def layer_flops(cfg: ModelConfig) -> dict[str, int]:
    """Forward FLOPs per token of the decoder stack by the parts a remat policy recomputes (the head is not one)."""
    m = matmuls(cfg)
    return {"qkv": 2 * m.qkv, "out": 2 * m.out, "attention": attention_flops(cfg), "mlp": 2 * m.mlp}


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: every kernel a token meets, plus the output head."""
    return matmuls(cfg).total


def lora_matmul_params(cfg: ModelConfig) -> int:
    """LoRA adapter parameters that take part in a matmul per token: rank x (in + out) per targeted projection of
    every layer, the mixer's as its row declares them (spec/mixer_kinds.py `lora`), a dense MLP's gate, up and down
    (also beside the experts of Gemma 4's MoE block; experts take none)."""
    if not cfg.lora_rank:
        return 0
    total = 0
    for layer in blocks.layers(cfg):
        own = blocks.layer_config(cfg, layer)  # its own head shape and MLP width (Gemma 4)
        e, f = own.emb_dim, own.mlp_dim
        dense = {"gate": e + f, "up": e + f, "down": f + e}
        widths = {**layer.mixer.lora(own), **(dense if layer.has_dense_mlp else {})}
        if layer.kv_shared:  # no key or value projection to adapt
            widths = {k: v for k, v in widths.items() if k not in ("k", "v")}
        total += sum(widths.get(target, 0) for target in cfg.lora_targets)
    return cfg.lora_rank * total


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6 x matmul params (forward 2, backward 4) + 3 x attention's forward.

    With LoRA the frozen weights need no weight gradient: 4 x their matmul params (forward 2, input gradient 2),
    and 6 x the adapters'.
    """
    attention = 3 * attention_flops(cfg)
    if not cfg.lora_rank:
        return 6 * matmul_params(cfg) + attention
    return 4 * matmul_params(cfg) + 6 * lora_matmul_params(cfg) + attention
