"""The token-mixer kinds: what mixes information across positions in a decoder layer, one row each, so a kind is
named here once. `attention_type` names the row of every layer; `layer_types` (one entry a layer, Hugging Face's
spelling: "full_attention", "sliding_attention", "linear_attention", or a row's own name) names each layer's.

A row declares everything the rest of the code reads about its kind:

    module         the Flax module, "package.module:Class", imported by the decoder when it builds a layer
                   (layers/decoder.py), called as Module(cfg, dtype, weight_dtype[, local=True][, rope=False],
                   name=scope) on
                   (x [batch, length, embed], segment_ids, positions) -> [batch, length, embed]
    scope          the name of its parameters in a layer: "decoder/<stack>/<layer>/<scope>/..."
    cache          what generation keeps per layer (CACHES): keys and values, a latent, or a recurrent state
    hf, hf_local   its `layer_types` spellings: a global layer's, and a local (sliding-window or chunked) layer's
    params         matmul parameters per token by remat part ("qkv": the input projections, "out": the output one)
    lora           in + out width of each projection a LoRA adapter takes, by `lora_targets` name (q, k, v, o)
    flops          forward FLOPs per token beyond those matmuls (attention's scores and values, a recurrence)
    remat_names    the `checkpoint_name`s its module gives its projections (spec/remat.py's policies keep them)
    reused         the matmul parameters per token a KV-shared layer of the kind skips (`kv_shared_layers`)
    attention      softmax attention over keys: the row `attention_type` names, read by the attention keys
                   (rope, `attention`, the kernels), so a layer_types entry of an attention row must be that row

A new kind is its module plus a row here; `register` adds a row from outside the package (a test's toy kind).
Nothing outside this module compares a kind's name: spec/blocks.py resolves `layer_types` to rows, and the decoder,
the FLOP count (model/flops.py) and the config checks (config/ranges.py) read the rows' fields.

A leaf below spec/blocks.py: arithmetic on ModelConfig; the modules are named, never imported, here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from maxshard.spec.model_config import ModelConfig

__all__ = ["CACHES", "Mixer", "MLP", "KINDS", "MLP_KINDS", "AttentionWidths", "keys_seen", "keys_in_chunk",
           "local_keys_seen",
           "kind", "kinds", "latent", "mlp_kind", "register", "unregister", "resolve", "spellings"]

# What a layer keeps for generation (layers/kv_cache.py): keys and values per position, a compressed latent per
# position (latent attention), or one state per sequence whatever its length (a linear recurrence)
CACHES = ("kv", "latent", "recurrent")


@dataclasses.dataclass(frozen=True)
class Mixer:
    """One token-mixer kind (module docstring)."""

    name: str
    module: str
    scope: str
    cache: str  # of CACHES
    params: Callable[[ModelConfig], dict[str, int]]  # {"qkv": .., "out": ..} matmul parameters per token
    flops: Callable[[ModelConfig, bool], float]  # (cfg, local) -> forward FLOPs per token, not matmuls
    summary: str
    hf: tuple[str, ...] = ()
    hf_local: tuple[str, ...] = ()
    remat_names: tuple[str, ...] = ()
    attention: bool = False
    # the matmul parameters a KV-shared layer of this kind does not meet (its key and value projections; Gemma 4)
    reused: Callable[[ModelConfig], dict[str, int]] = lambda cfg: {}
    lora: Callable[[ModelConfig], dict[str, int]] = lambda cfg: {}  # a row's default: no projection takes adapters


@dataclasses.dataclass(frozen=True)
class MLP:
    """One MLP kind: `routed` experts (layers/moe.py MoEBlock, parameters under "moe"), one gated MLP
    (layers/mlp.py, under "mlp"), or with `dense` both side by side (Gemma 4's MoE block); `params` its matmul
    parameters per token by part (model/flops.py Matmuls)."""

    name: str
    routed: bool
    params: Callable[[ModelConfig], dict[str, int]]
    summary: str
    dense: bool = False  # a routed kind that keeps the dense MLP beside its experts

    @property
    def has_dense(self) -> bool:
        """Whether its layer has the dense MLP ("mlp"): a dense kind, or a routed one beside it."""
        return self.dense or not self.routed


@dataclasses.dataclass(frozen=True)
class AttentionWidths:
    """One attention layer's matmuls per token (parameters that meet a token) and the widths its scores use."""

    qkv: int  # the input projections: query (through its latent, for mla), key and value (through theirs)
    out: int  # the output projection
    heads: int
    qk_head_dim: int  # width of a query/key head in the scores
    v_head_dim: int  # width of a value head


def keys_seen(length: int, window: int = 0) -> float:
    """Keys one query sees, on average over a causal sequence of `length`: min(position + 1, window) (window 0:
    every earlier key), with the query's own key counted half, as the causal convention counts a global layer's
    length / 2 (the [length, length] triangle's area, not length (length + 1) / 2). A local layer's band of the
    score matrix is length x window less the window's own triangle: window - window^2 / (2 length) per query, which
    is length / 2 again once the window reaches the length."""
    seen = min(window, length) if window else length
    return seen - seen * seen / (2 * length)


def keys_in_chunk(length: int, chunk: int) -> float:
    """Keys one query sees, on average, when each attends within its chunk of `chunk` positions (Llama 4): a
    triangle of chunk^2 / 2 per whole chunk and one of the rest, over `length` queries (length / 2 once the chunk
    reaches the length, as a global layer)."""
    whole, rest = divmod(length, chunk)
    return (whole * chunk * chunk + rest * rest) / (2 * length)


def local_keys_seen(cfg: ModelConfig, local: bool) -> float:
    """Keys one query of a layer sees at max_target_length: a local layer's window or chunk, or every earlier key."""
    length = cfg.max_target_length
    if local and cfg.attention_chunk_size:
        return keys_in_chunk(length, cfg.attention_chunk_size)
    return keys_seen(length, cfg.sliding_window if local else 0)


def _gqa_widths(cfg: ModelConfig) -> AttentionWidths:
    e, h = cfg.emb_dim, cfg.num_heads
    q, kv = h * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    gate = q if cfg.attention_output_gate else 0  # the query projection's per-head gate
    return AttentionWidths(e * (q + gate + _kv_projections(cfg) * kv), q * e, h, cfg.head_dim, cfg.head_dim)


def _kv_projections(cfg: ModelConfig) -> int:
    """Key and value projections of a grouped-query layer (its own config: spec/blocks.py `layer_config`): one
    where the values are the keys' projection (`global_values_from_keys`)."""
    return 1 if cfg.global_values_from_keys else 2


def _mla_widths(cfg: ModelConfig) -> AttentionWidths:
    e, h = cfg.emb_dim, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    r = cfg.q_lora_rank
    query = e * r + r * h * qk if r else e * h * qk
    kv = e * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim
                                                                                 + cfg.v_head_dim)
    return AttentionWidths(query + kv, h * cfg.v_head_dim * e, h, qk, cfg.v_head_dim)


def _attention_row(widths: Callable[[ModelConfig], AttentionWidths]) -> dict:
    """params and flops of a softmax-attention row from its widths: q.k is 2 x keys x heads x qk_head_dim and p.v
    2 x keys x heads x v_head_dim per token, keys the ones a query sees (`local_keys_seen`)."""

    def params(cfg: ModelConfig) -> dict[str, int]:
        w = widths(cfg)
        return {"qkv": w.qkv, "out": w.out}

    def flops(cfg: ModelConfig, local: bool) -> float:
        w = widths(cfg)
        return 2 * local_keys_seen(cfg, local) * w.heads * (w.qk_head_dim + w.v_head_dim)

    return {"params": params, "flops": flops}


def _gqa_lora(cfg: ModelConfig) -> dict[str, int]:
    e, q, kv = cfg.emb_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    gate = q if cfg.attention_output_gate else 0  # the gate shares the query's projection, so its adapter
    values = {} if cfg.global_values_from_keys else {"v": e + kv}  # none: the values are the key projection's
    return {"q": e + q + gate, "k": e + kv, **values, "o": q + e}


def _mla_lora(cfg: ModelConfig) -> dict[str, int]:
    """q on the query's projections (both, through its latent), k and v on the latent's up projections."""
    e, h, r, rank = cfg.emb_dim, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    query = (e + r) + (r + h * qk) if r else e + h * qk
    return {"q": query, "k": rank + h * cfg.qk_nope_head_dim, "v": rank + h * cfg.v_head_dim,
            "o": h * cfg.v_head_dim + e}


def _deltanet_lora(cfg: ModelConfig) -> dict[str, int]:
    e = cfg.emb_dim
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return {"q": e + key, "k": e + key, "v": e + value, "o": value + e}


def _deltanet_params(cfg: ModelConfig) -> dict[str, int]:
    """Gated DeltaNet's projections per token: q, k (key heads), v and the output gate z (value heads), the write
    strength beta and the decay's a (one each per value head), and the output projection."""
    e = cfg.emb_dim
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return {"qkv": e * (2 * key + 2 * value + 2 * cfg.linear_num_value_heads), "out": value * e}


def _deltanet_flops(cfg: ModelConfig, local: bool) -> float:
    """Gated DeltaNet's forward FLOPs per token beyond its projections, as the chunked form computes them: the
    depthwise causal convolution over q, k and v (2 x kernel x their width), and per value head the state's three
    products (q.S, k.S and the rank-1 write: 6 x dk x dv) plus the chunk's causal q.k^T and k.k^T (chunk / 2 keys of
    2 x dk each) and scores.v (chunk / 2 of 2 x dv)."""
    dk, dv, c = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.delta_chunk_size
    conv = 2 * cfg.linear_conv_kernel_dim * (2 * cfg.linear_num_key_heads * dk + cfg.linear_num_value_heads * dv)
    return conv + cfg.linear_num_value_heads * (6 * dk * dv + c * (2 * dk + dv))


_QKV_OUT = ("query_proj", "key_proj", "value_proj", "out_proj")
_BUILT_IN = (
    Mixer("gqa", "maxshard.model.layers.attention:Attention", "attention", "kv",
          summary="grouped-query softmax attention; a local layer sees the last sliding_window keys, or its chunk",
          hf=("full_attention",), hf_local=("sliding_attention", "chunked_attention"), remat_names=_QKV_OUT,
          attention=True,
          reused=lambda cfg: {"qkv": _kv_projections(cfg) * cfg.emb_dim * cfg.num_kv_heads * cfg.head_dim},
          lora=_gqa_lora, **_attention_row(_gqa_widths)),
    Mixer("mla", "maxshard.model.layers.mla:LatentAttention", "attention", "latent",
          summary="multi-head latent attention (DeepSeek-V2/V3): keys and values from one cached latent",
          remat_names=_QKV_OUT, attention=True, lora=_mla_lora, **_attention_row(_mla_widths)),
    Mixer("gated_deltanet", "maxshard.model.layers.gated_deltanet:GatedDeltaNet", "linear_attention", "recurrent",
          _deltanet_params, _deltanet_flops,
          summary="gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a [dk, dv] state per value head",
          hf=("linear_attention",), remat_names=_QKV_OUT, lora=_deltanet_lora),
)
_KINDS: dict[str, Mixer] = {m.name: m for m in _BUILT_IN}
KINDS = _BUILT_IN  # the built-in rows; `kinds()` adds the registered ones


def kind(name: str) -> Mixer:
    """The mixer row called `name` (KeyError for an unknown one: the config checks admit only `spellings()`)."""
    return _KINDS[name]


def latent(name: str) -> bool:
    """Whether mixer `name` attends through a compressed latent (its decode cache is "latent"): the kind whose
    heads carry qk_nope/qk_rope/v widths instead of head_dim, and which takes no per-head q/k norm."""
    return kind(name).cache == "latent"


def kinds() -> tuple[Mixer, ...]:
    """Every row, built in and registered."""
    return tuple(_KINDS.values())


def register(row: Mixer) -> Mixer:
    """Add a row from outside this module (a kind that lives elsewhere, a test's toy kind); a name or a spelling
    another row has is refused, so an entry of `layer_types` names one row."""
    taken = {name for other in _KINDS.values() for name in (other.name, *other.hf, *other.hf_local)}
    clash = taken & {row.name, *row.hf, *row.hf_local}
    if clash:
        raise ValueError(f"mixer kind {row.name!r}: {', '.join(sorted(clash))} already name a row")
    if row.cache not in CACHES:
        raise ValueError(f"mixer kind {row.name!r}: cache {row.cache!r} is not one of {', '.join(CACHES)}")
    _KINDS[row.name] = row
    return row


def unregister(name: str) -> None:
    """Remove a registered row (a test's toy kind, after the test); built-in rows stay."""
    if name in {m.name for m in _BUILT_IN}:
        raise ValueError(f"mixer kind {name!r} is built in")
    _KINDS.pop(name, None)


def spellings() -> tuple[str, ...]:
    """Every accepted `layer_types` entry: each row's Hugging Face spellings, then its own name."""
    return tuple(dict.fromkeys(s for m in _KINDS.values() for s in (*m.hf, *m.hf_local, m.name)))


def resolve(entry: str) -> tuple[Mixer, bool]:
    """(the row, whether the layer is local) of one `layer_types` entry; KeyError for an unknown one."""
    for m in _KINDS.values():
        if entry in m.hf_local:
            return m, True
        if entry == m.name or entry in m.hf:
            return m, False
    raise KeyError(entry)


def _dense(cfg: ModelConfig) -> dict[str, int]:
    return {"dense_mlp": 3 * cfg.emb_dim * cfg.mlp_dim}


def _moe(cfg: ModelConfig) -> dict[str, int]:
    """The k routed experts a token visits, the shared experts and the router."""
    expert = 3 * cfg.emb_dim * cfg.expert_dim
    return {"routed_experts": cfg.num_experts_per_tok * expert, "shared_experts": cfg.num_shared_experts * expert,
            "router": cfg.emb_dim * cfg.num_experts}


MLP_KINDS = (MLP("dense", False, _dense, "one gated MLP of mlp_dim"),
             MLP("moe", True, _moe, "routed experts of expert_dim, shared experts and a router"),
             MLP("moe_beside_dense", True, lambda cfg: {**_dense(cfg), **_moe(cfg)},
                 "the dense MLP and beside it routed experts with their router (Gemma 4's MoE block)", dense=True))
_MLPS = {m.name: m for m in MLP_KINDS}


def mlp_kind(name: str) -> MLP:
    return _MLPS[name]
