"""What defines the network, apart from how it is trained: the `ModelConfig` the layers are built from.

The run `Config` (every YAML key: data, checkpoints, mesh knobs, optimizer, ...) derives one `ModelConfig` when a run
is loaded (`maxshard.run.loading`), and the `Transformer` and every layer take only this, or the few fields they use.
So a model can be built, initialised and applied with no mesh, data or checkpoint settings in sight: generation,
checkpoint conversion and tests build it from the same type.

Field names equal the run config's model keys, so `cfg.model.emb_dim` reads like `cfg.emb_dim`, and their defaults
are the run config's: both inherit `ModelKeys`, the one declaration of each. This module imports
nothing else of maxshard: it sits below both the config loader and the layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax.numpy as jnp

__all__ = ["IMPLEMENTATION", "LORA_TARGETS", "ModelConfig", "ModelKeys", "PipelineShape", "architecture_keys",
           "model_fields", "num_units", "resolve_dtype", "shortest_period",
           "resolve_moe_impl", "resolve_moe_exchange"]

# The projections LoRA can adapt (`lora_targets`): attention's query, key, value and output, and a dense MLP's
# gate (wi_0), up (wi_1) and down (wo). MoE experts take none.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(name: str, platform: str) -> str:
    """'auto' is bfloat16 on accelerators and float32 on CPU (where bfloat16 matmuls are emulated and slow)."""
    if name == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    return name


def resolve_moe_impl(name: str, device_kind: str) -> str:
    """'auto' is XLA's ragged_dot on TPU and the tiled grouped matmul elsewhere: jax lowers ragged_dot to a masked
    dense dot over every expert on CPU, and on an H100 it was slower than tiled, more so with more experts
    (benchmarks/README.md, "On one H100"; see `layers/moe_grouped.py`)."""
    if name == "auto":
        return "ragged_dot" if device_kind.strip().lower().startswith("tpu") else "tiled"
    return name


def resolve_moe_exchange(name: str, platform: str) -> str:
    """'auto' is the ragged exchange on TPU and GPU (`platform` 'tpu' or 'nvidia'), the fixed all_to_all on CPU,
    whose XLA has no ragged all-to-all: an explicit 'ragged' runs there through the collective's emulation
    (`layers/ragged_all_to_all.py`), a stand-in for the same numbers, not for speed (`run/stand_ins.py`)."""
    if name == "auto":
        return "ragged" if platform in ("tpu", "nvidia") else "all_to_all"
    return name


def num_units(num_layers: int, num_experts: int, moe_layer_interval: int, first_k_dense_replace: int = 0,
              pattern_length: int = 1) -> int:
    """Repeated units of the main decoder stack (the one a pipeline runs): layers, or blocks of the shortest run of
    layers that repeats (spec/blocks.py `stacks`): lcm(`moe_layer_interval` in an MoE model, the attention
    pattern's length), counted after the `first_k_dense_replace` dense layers (a stack of their own). Layers left
    over run once after them (blocks.LAST_STACK), outside the pipeline.

    nn.scan and the pipeline need identical iterations, so an MoE model that mixes dense and MoE layers, or a model
    with local and global layers, repeats blocks of layers rather than single layers."""
    moe = num_experts > 1
    body = num_layers - (first_k_dense_replace if moe else 0)
    return body // min(math.lcm(moe_layer_interval if moe else 1, pattern_length), body)  # at least one unit


def shortest_period(items: tuple) -> int:
    """The smallest p with items[i] == items[i % p] for every i (len(items) when nothing shorter repeats)."""
    return next(p for p in range(1, len(items) + 1) if all(x == items[i % p] for i, x in enumerate(items)))


@dataclasses.dataclass(frozen=True)
class PipelineShape:
    """A pipeline's sizes, resolved (no -1 left). The order of work, its iterations and bubble are its schedule's
    (`maxshard/spec/pipeline_schedule.py`, `of(shape)`); `maxshard/model/layers/pipeline.py` runs it."""

    stages: int
    layers_per_stage: int
    repeats: int
    microbatches: int
    schedule: str = "circular"  # `pipeline_schedule` (spec/pipeline_schedule.py, pipeline_tables.py)

    @property
    def units(self) -> int:
        """Stacked units the pipeline holds: R * S * L."""
        return self.repeats * self.stages * self.layers_per_stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelKeys:
    """The model keys a user sets and the network reads as they are, declared once with their types and defaults.

    The run `Config` (config/schema.py) and `ModelConfig` both inherit these fields, so a new model option is one
    line here (plus its comment in configs/base.yml). Keys whose user value is a request the run resolves
    (`dtype: auto`, `attention: auto`, ...) are declared by each class with its own meaning.
    """

    emb_dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    mlp_dim: int = 512
    max_target_length: int = 128
    logits_via_embedding: bool = False
    score_head: bool = False  # the head gives one score per token (a reward model), not logits
    norm_epsilon: float = 1e-6
    qk_norm: bool = False  # RMSNorm over head_dim of each query and key head before RoPE (Qwen3)
    qk_norm_all_heads: bool = False  # with qk_norm: one RMSNorm over all heads of q (and of k) instead (OLMo 2/3)
    # the query projection also gives each head a gate: attention output x sigmoid(gate) before the output
    # projection (Qwen3-Next, Qwen3.5; layers/attention.py)
    attention_output_gate: bool = False
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim x this features of a head (Qwen3-Next: 0.25)
    # The attention kind of every layer (a row of spec/mixer_kinds.py): "gqa" (grouped-query, the fields
    # above) or "mla" (DeepSeek-V2/V3 multi-head latent attention, the five fields below; num_kv_heads unused).
    attention_type: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int = 0  # mla: the query's low-rank latent width (0: a plain [embed, heads, qk_head_dim] projection)
    kv_lora_rank: int = 512  # mla: the compressed key/value latent width (what generation caches per token)
    qk_nope_head_dim: int = 128  # mla: the part of each query/key head without RoPE
    qk_rope_head_dim: int = 64  # mla: the RoPE part of each query head; the key's is one head shared by all heads
    v_head_dim: int = 128  # mla: each value head's width
    # gated DeltaNet, the linear-attention layers of Qwen3-Next/Qwen3.5 (layers/gated_deltanet.py): query/key heads,
    # value heads (a multiple: each key head serves consecutive value heads), their widths, the short conv's width
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    delta_chunk_size: int = 64  # tokens per chunk of the chunked delta rule (training and prefill; layers/delta_rule.py)
    # Local/global attention (Gemma 2/3, GPT-OSS; spec/blocks.py): layer i is `attention_pattern[i % len]`, "global"
    # (every earlier key) or "local" (the last `sliding_window` keys, its own included)
    sliding_window: int = 0
    attention_pattern: tuple[str, ...] = ("global",)
    # Each layer's token mixer, one entry a layer in Hugging Face's `layer_types` spelling ("full_attention",
    # "sliding_attention", "linear_attention") or a row's name (spec/mixer_kinds.py); empty: attention_type and
    # attention_pattern decide every layer
    layer_types: tuple[str, ...] = ()
    # Llama 4: local layers attend within chunks of this many positions (query p sees the keys of its own chunk
    # p // size, up to p) instead of a sliding window; 0: none
    attention_chunk_size: int = 0
    # One entry a layer: 1 rotates its q and k (RoPE), 0 leaves them unrotated (NoPE, Llama 4); empty: every layer
    rope_layers: tuple[int, ...] = ()
    # NoPE layers' query temperature log(floor((p + 1) / floor) + 1) x scale + 1 at position p (Llama 4's
    # attn_scale and floor_scale); scale 0: none
    nope_temperature_scale: float = 0.0
    nope_temperature_floor: int = 8192
    # q and k divided by their RMS over head_dim after RoPE, no learned scale, on the RoPE layers (Llama 4)
    qk_l2_norm: bool = False
    rope_local_max_timescale: float = 0.0  # RoPE base of local layers, unscaled (Gemma 3: 10000); 0: as global ones
    # Proportional RoPE (Gemma 4's global layers): only the first head_dim / 2 x this pairs (x[i], x[i + head_dim/2])
    # turn, at rope_max_timescale ** (-2i / head_dim) over the whole head; the other pairs pass unrotated. 1: all
    rope_proportion: float = 1.0
    attn_logit_softcapping: float = 0.0  # scaled logits -> c * tanh(logits / c) before the softmax (Gemma 2); 0: none
    final_logit_softcapping: float = 0.0  # the output logits capped the same way (Gemma 2); 0: none
    query_pre_attn_scalar: float = 0.0  # softmax scale this ** -0.5 (Gemma); 0: the query/key head width
    attention_sinks: bool = False  # a learned logit per query head in the softmax's denominator (GPT-OSS)
    value_norm: bool = False  # each value head RMS-normalised over head_dim, no learned scale (Gemma 4)
    # the global attention layers' own head width and key/value heads (Gemma 4's global_head_dim: 512 beside the
    # local layers' 256); 0: head_dim and num_kv_heads, as every layer (spec/blocks.py `layer_config`)
    global_head_dim: int = 0
    global_num_kv_heads: int = 0
    # the global attention layers take their values from the key projection, before its norm and RoPE, and have no
    # value projection (Gemma 4's attention_k_eq_v); in a layer's own config (spec/blocks.py) true only in those
    global_values_from_keys: bool = False
    # Gemma 4: the last this many layers reuse the keys and values of the last earlier layer of their own kind
    # (local or global) and have no key/value projections or cache of their own (spec/blocks.py); 0: none
    kv_shared_layers: int = 0
    kv_shared_mlp_dim: int = 0  # the KV-shared layers' MLP width (Gemma 4's use_double_wide_mlp: 2 x mlp_dim); 0: as
    # every layer
    # Gemma 4's per-layer input embeddings: each layer adds gelu(x @ gate) x its own [this] slice of a second
    # embedding of the tokens, projected back to embed and normalised (layers/per_layer_inputs.py); 0: none
    per_layer_input_dim: int = 0
    per_layer_vocab_size: int = 0  # the per-layer embedding's rows (0: vocab_size)
    layer_scalar: bool = False  # each layer's output x a fixed scalar of its own (Gemma 4's layer_scalar; no gradient)
    attention_bias: bool = False  # biases on the query, key, value and output projections (GPT-OSS)
    qkv_bias: bool = False  # biases on the query, key and value projections only (GLM-4.5)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), the weight starting at 0 (Gemma)
    post_norms: bool = False  # RMSNorm on the attention's and the MLP's outputs before each residual add (Gemma 2/3)
    pre_norms: bool = True  # RMSNorm on each layer's input to attention and to the MLP; false: post_norms only (OLMo 2/3)
    # gated MLP: silu (SwiGLU), gelu_tanh (GeGLU), clamped_swiglu (GPT-OSS)
    mlp_activation: Literal["silu", "gelu_tanh", "clamped_swiglu"] = "silu"
    swiglu_limit: float = 7.0  # clamped_swiglu: gate clamped to <= limit, up to [-limit, limit]
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate)
    embed_scale: bool = False  # token embeddings multiplied by sqrt(emb_dim) (Gemma)
    moe_bias: bool = False  # biases on the router and on every expert's projections (GPT-OSS)
    mtp_depth: int = 0  # multi-token prediction modules after the last layer (DeepSeek-V3: 1; layers/mtp.py)
    rope_max_timescale: float = 10000.0
    rope_scaling_type: Literal["none", "linear", "llama3", "yarn"] = "none"  # "none", "linear", "llama3" or "yarn"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    yarn_beta_fast: float = 32.0  # yarn: rotations per original context above which a frequency is kept
    yarn_beta_slow: float = 1.0  # yarn: rotations below which a frequency is fully interpolated
    yarn_mscale: float = 1.0  # yarn: with yarn_mscale_all_dim set, cos/sin x m(this) / m(all_dim) (configs/base.yml)
    yarn_mscale_all_dim: float = 0.0  # yarn: softmax scale x m(this)^2; 0: cos/sin x m(1), yarn_mscale unread
    yarn_truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole indices (GPT-OSS: false)
    scan_layers: bool = True
    attention_block_q: int = 512
    attention_block_kv: int = 512
    num_experts: int = 1
    num_experts_per_tok: int = 1
    capacity_factor: float = 1.25
    moe_layer_interval: int = 1
    moe_group_size: int = 0
    moe_ragged_buffer_factor: float = 0.0
    num_shared_experts: int = 0
    shared_expert_gate: bool = False  # the shared experts' output x sigmoid(x @ w), w [embed, 1] (Qwen3-Next)
    moe_renormalize_top_k: bool = True  # top-k router weights rescaled to sum to 1 (False: the softmax's own)
    moe_mlp_dim: int = 0  # hidden width of each routed and shared expert (0: mlp_dim, which dense layers keep)
    first_k_dense_replace: int = 0  # the first k layers are dense (their own scanned stack), the rest MoE
    moe_router: Literal["softmax", "sigmoid"] = "softmax"  # router scores: "softmax" or "sigmoid" (DeepSeek-V3)
    moe_n_group: int = 1  # experts in n groups; a token picks its top-k among the best `moe_topk_group` groups
    moe_topk_group: int = 1
    moe_routed_scaling_factor: float = 1.0  # the routed experts' output is scaled by this (DeepSeek-V3: 2.5)
    moe_router_bias: bool = False  # a per-expert bias added to the scores for selection only (aux-loss-free)
    moe_weights_on_input: bool = False  # the router weight scales the expert's input, not its output (Llama 4)
    moe_beside_mlp: bool = False  # Gemma 4's MoE block: the routed experts beside the MoE layers' dense MLP
    lora_rank: int = 0  # LoRA adapters of this rank on the `lora_targets` projections (0: none; layers/lora.py)
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o")

    @property
    def pattern_length(self) -> int:
        """The period of the layers' mixers (spec/blocks.py): layer_types' shortest, else attention_pattern's length;
        with `rope_layers` the shortest period of both together."""
        if self.layer_types and self.rope_layers:
            return shortest_period(tuple(zip(self.layer_types, self.rope_layers)))
        mixers = shortest_period(self.layer_types) if self.layer_types else len(self.attention_pattern)
        return math.lcm(mixers, shortest_period(self.rope_layers)) if self.rope_layers else mixers

    @property
    def local_span(self) -> int:
        """What a local layer sees: the last `sliding_window` keys, or its chunk of `attention_chunk_size`
        positions (one of the two is set where a model has local layers; 0: neither)."""
        return self.sliding_window or self.attention_chunk_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(ModelKeys):
    """The network: dimensions, heads, vocabulary, norm and RoPE constants, MoE shape, dtypes, scan and remat.

    `dtype` and `weight_dtype` are resolved names ('float32', 'bfloat16', 'float16'; never 'auto'); so is
    `attention` (see `maxshard/model/attention_choice.py`).
    `pipeline` is None without pipeline parallelism; otherwise the decoder runs as a pipeline of that shape.
    """

    vocab_size: int
    dtype: str = "float32"
    weight_dtype: str = "float32"
    remat_policy: str = "full"
    attention: str = "dot_product"  # resolved: a row of spec/attention_kinds.py (never auto)
    moe_dropless_impl: str = "tiled"
    moe_exchange: str = "all_to_all"  # resolved: all_to_all or ragged (never auto)
    pipeline: PipelineShape | None = None

    def __post_init__(self) -> None:
        for name in ("attention_pattern", "lora_targets", "layer_types", "rope_layers"):  # lists: hashable too
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def compute_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    @property
    def param_dtype(self) -> Any:
        return _DTYPES[self.weight_dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_dim(self) -> int:
        """Hidden width of one routed (or shared) expert."""
        return self.moe_mlp_dim or self.mlp_dim

    @property
    def num_units(self) -> int:
        """Repeated units of the main decoder stack (see `num_units`)."""
        return num_units(self.num_layers, self.num_experts, self.moe_layer_interval, self.first_k_dense_replace,
                         self.pattern_length)

    @property
    def has_local_layers(self) -> bool:
        return self.local_span > 0 and "local" in self.attention_pattern

    def lora_rank_of(self, target: str) -> int:
        """The adapter rank of one projection ("q", "k", "v", "o", "gate", "up", "down"); 0 when it has none."""
        return self.lora_rank if target in self.lora_targets else 0

    @property
    def lora_scale(self) -> float:
        """LoRA's output scale alpha / rank (PEFT's convention), applied to x @ A @ B."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is an MoE block: the last of every `moe_layer_interval` layers after the dense first ones."""
        return (self.num_layers - self.first_k_dense_replace) // self.moe_layer_interval if self.is_moe else 0


def model_fields() -> tuple[str, ...]:
    """The run-config keys a ModelConfig copies (every field but the derived `pipeline`)."""
    return tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "pipeline")


# How a network is computed and trained, not which network it is: the fields a checkpoint of the same model may
# hold other values of (a converted model runs with any of them). Every other field is an architecture key.
IMPLEMENTATION = frozenset({
    "max_target_length", "dtype", "weight_dtype", "scan_layers", "remat_policy", "attention", "attention_block_q",
    "attention_block_kv", "capacity_factor", "moe_group_size", "moe_dropless_impl", "moe_exchange",
    "moe_ragged_buffer_factor", "lora_rank", "lora_alpha", "lora_targets", "pipeline", "delta_chunk_size",
})


def architecture_keys() -> tuple[str, ...]:
    """The fields that say which network this is (what a Hugging Face config.json describes), declared once: every
    field outside IMPLEMENTATION, so a new model key is an architecture key unless it is named there."""
    return tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in IMPLEMENTATION)
