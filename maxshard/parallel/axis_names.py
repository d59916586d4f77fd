"""Logical axis names, defined once. Layers name dimensions with these; `logical_axis_rules` maps them to mesh axes.

Parameter dimensions and activation dimensions have separate names, because a weight and the activation it
produces are often laid out differently (FSDP shards a kernel's "embed" dimension but not the activation's).
"""

# ---- parameter dimensions
LAYERS = "layers"  # leading axis of scanned layer stacks
UNSTAGED_LAYERS = "unstaged_layers"  # leading axis of a stack that runs before the pipeline (spec/blocks.py)
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
# latent attention (layers/mla.py): the query's and the key/value's compressed widths. Beside `embed` (the down
# projections) they stay whole, as the norm over them wants; as the input of the up projections, which have no
# `embed` dim, they take fsdp's axes like `embed`, so those kernels are not repeated on every fsdp device
Q_LORA = "q_lora"
KV_LORA = "kv_lora"

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
# latent attention's latents [batch, length, q_lora_rank or kv_lora_rank (+ qk_rope_head_dim)] (layers/mla.py):
# whole, like the embeddings they come from, since every head reads all of them
ACT_Q_LORA = "activation_q_lora"
ACT_KV_LORA = "activation_kv_lora"

# ---- the KV cache of generation [batch, kv_heads, max_length, head_dim] (layers/kv_cache.py)
CACHE_BATCH = "cache_batch"
CACHE_KV_HEADS = "cache_kv_heads"
CACHE_LENGTH = "cache_length"
CACHE_KV = "cache_kv"

# ---- the input batch [batch, length]: sharded like the activations outside the pipeline
INPUT_AXES = (EMBED_AND_LOGITS_BATCH, LENGTH)

# ---- activations whose layout is also worked out away from the layer that constrains them (ring attention, MoE,
# the pipeline check, the planner). The mesh axes a name gets depend on the other names of its array
# (`sharding.mesh_axes`), so those modules ask with the arrays the layers constrain, named once here.
TOKENS = (BATCH, LENGTH, ACT_EMBED)  # [batch, length, embed] inside a layer: the MoE block's input (layers/moe.py)
QUERY = (BATCH, LENGTH, ACT_HEADS, ACT_KV)  # q projection and attention output (layers/attention.py)
KEY_VALUE = (BATCH, LENGTH, ACT_KV_HEADS, ACT_KV)  # k and v projections
ATTN_QUERY = (BATCH, ATTN_LENGTH, ATTN_HEADS, ACT_KV)  # q inside attention (layers/attention_ops.py, ring_attention.py)
ATTN_KEY_VALUE = (BATCH, ATTN_LENGTH, ATTN_KV_HEADS, ACT_KV)
ATTN_SEGMENTS = (BATCH, ATTN_LENGTH)
LATENT_Q = (BATCH, LENGTH, ACT_Q_LORA)  # latent attention's query latent (layers/mla.py)
LATENT_KV = (BATCH, LENGTH, ACT_KV_LORA)  # its key/value latent, and with the RoPE key before the split
ABSORBED_QUERY = (BATCH, LENGTH, ACT_HEADS, ACT_KV_LORA)  # decode: queries in the latent space [b, T, heads, rank]
LATENT_CACHE = (CACHE_BATCH, CACHE_LENGTH, CACHE_KV)  # its KV cache [batch, max_length, width] (layers/mla.py)
MLP_HIDDEN = (BATCH, LENGTH, ACT_MLP)  # layers/mlp.py
RESIDUAL = (BATCH, NORM_LENGTH, ACT_EMBED)  # the residual stream between attention and MLP (layers/decoder.py)
PIPELINE_STATE = (ACT_STAGE, BATCH, NORM_LENGTH, ACT_EMBED)  # [stages, microbatch, length, embed] (layers/pipeline.py)
EMBEDDED = (EMBED_AND_LOGITS_BATCH, LENGTH, ACT_EMBED)  # the token embeddings (model/transformer.py)
LOGITS = (EMBED_AND_LOGITS_BATCH, LENGTH, ACT_VOCAB)
DISPATCHED = (ACT_EXP, BATCH_NO_EXP, None, ACT_EMBED)  # tokens sent to experts by token dropping (layers/moe.py)
EXPERT_KERNEL = (EXP, EMBED, MLP)  # wi_0, wi_1 of the MoE experts (layers/moe.py): their `exp` axes hold the experts
