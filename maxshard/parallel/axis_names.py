"""Logical axis names, defined once. Layers name dimensions with these; `logical_axis_rules` maps them to mesh axes.

Parameter dimensions and activation dimensions have separate names, because a weight and the activation it
produces are often laid out differently (FSDP shards a kernel's "embed" dimension but not the activation's).
"""

# ---- parameter dimensions
LAYERS = "layers"  # leading axis of scanned layer stacks
CIRCULAR_REPEATS = "circular_repeats"  # leading axis of a circular pipeline's repeats
LAYERS_PER_STAGE = "layers_per_stage"  # layers one pipeline stage runs in a row
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
KV = "kv"  # head_dim
NORM = "norm"
EXP = "exp"  # experts
LORA_RANK = "lora_rank"  # the inner dimension of a LoRA adapter pair (layers/lora.py): small, kept whole

# ---- activation dimensions
BATCH = "activation_batch"
BATCH_NO_EXP = "activation_batch_no_exp"  # batch where the expert axis already holds experts
EMBED_AND_LOGITS_BATCH = "activation_embed_and_logits_batch"  # batch outside the pipeline (may use stage too)
LENGTH = "activation_length"
NORM_LENGTH = "activation_norm_length"
ACT_EMBED = "activation_embed"
ACT_HEADS = "activation_heads"
ACT_KV_HEADS = "activation_kv_heads"
ACT_KV = "activation_kv"
ACT_MLP = "activation_mlp"
ACT_VOCAB = "activation_vocab"
ACT_EXP = "activation_exp"
ACT_STAGE = "activation_stage"
# inside attention (layers/attention_ops.py): length whole or over `context` (ring attention), heads also over
# `sequence`, so sequence parallelism turns into head parallelism there (an all-to-all each way, no K/V gather)
ATTN_LENGTH = "activation_attn_length"
ATTN_HEADS = "activation_attn_heads"
ATTN_KV_HEADS = "activation_attn_kv_heads"

# ---- the KV cache of generation [batch, kv_heads, max_length, head_dim] (layers/kv_cache.py)
CACHE_BATCH = "cache_batch"
CACHE_KV_HEADS = "cache_kv_heads"
CACHE_LENGTH = "cache_length"
CACHE_KV = "cache_kv"

# ---- the input batch [batch, length]: sharded like the activations outside the pipeline
INPUT_AXES = (EMBED_AND_LOGITS_BATCH, LENGTH)
