"""Range checks of the attention keys: which layers are local (a sliding window or a chunk) and how, which rotate
their queries and keys, and the per-layer list `layer_types`. Part of `config/ranges.py`'s checks, kept apart as
the attention's share."""

from __future__ import annotations

from maxshard.config.schema import Config
from maxshard.errors import ConfigError
from maxshard.spec import mixer_kinds

__all__ = ["check_layer_types", "check_local_global", "check_positions"]

# layer_types' spellings of a local layer that name how it is local (Hugging Face's), for the key that sets it
_LOCAL_SPELLINGS = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


def check_layer_types(cfg: Config) -> None:
    """layer_types (spec/mixer_kinds.py): one known mixer a layer; an attention entry is attention_type's kind (the
    attention keys configure every attention layer); which layers are local is its to say, so attention_pattern
    stays [global] beside it."""
    types = cfg.layer_types
    if not types:
        return
    allowed = ", ".join(mixer_kinds.spellings())
    if len(types) != cfg.num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries and num_layers={cfg.num_layers}: one a layer, each "
                          f"one of {allowed}")
    for i, entry in enumerate(types):
        try:
            row, _ = mixer_kinds.resolve(entry)
        except KeyError:
            raise ConfigError(f"layer_types[{i}]={entry!r}: expected one of {allowed}") from None
        if row.attention and row.name != cfg.attention_type:
            raise ConfigError(f"layer_types[{i}]={entry!r} is {row.name} attention with attention_type="
                              f"{cfg.attention_type}: set attention_type={row.name} (one attention kind a model)")
    if tuple(cfg.attention_pattern) != ("global",):
        raise ConfigError(f"attention_pattern={list(cfg.attention_pattern)} with layer_types: layer_types says which "
                          "layers are local (sliding_attention, chunked_attention); leave attention_pattern at "
                          "[global]")


def check_local_global(cfg: Config) -> None:
    """The local/global attention keys (Gemma 2/3, GPT-OSS): a pattern of known kinds, a window for its local layers,
    caps and scales that are unset (0) or positive."""
    pattern = cfg.attention_pattern
    if not pattern or any(kind not in ("local", "global") for kind in pattern):
        raise ConfigError(f"attention_pattern={list(pattern)}: a non-empty list of local and global")
    for key in ("sliding_window", "attention_chunk_size"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0 (0: no local layers), got {getattr(cfg, key)}")
    if cfg.sliding_window and cfg.attention_chunk_size:
        raise ConfigError(f"sliding_window={cfg.sliding_window} and attention_chunk_size={cfg.attention_chunk_size}: "
                          "local layers see a window or a chunk; set one of them to 0")
    _check_local_spelling(cfg)
    local = any(mixer_kinds.resolve(e)[1] for e in cfg.layer_types) if cfg.layer_types else "local" in pattern
    if local != (cfg.local_span > 0):
        where = "layer_types" if cfg.layer_types else f"attention_pattern={list(pattern)}"
        raise ConfigError(f"sliding_window={cfg.sliding_window}, attention_chunk_size={cfg.attention_chunk_size} "
                          f"with {where}: local layers need one of them > 0, and each needs a local layer")
    if "local" in pattern and mixer_kinds.latent(cfg.attention_type):
        raise ConfigError("attention_pattern with local layers needs attention_type=gqa (latent attention has no "
                          "sliding window)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        if not getattr(cfg, key) >= 0:
            raise ConfigError(f"{key} must be >= 0 (0: unset), got {getattr(cfg, key)}")
    if cfg.rope_local_max_timescale and not cfg.rope_local_max_timescale > 1:
        raise ConfigError(f"rope_local_max_timescale must be 0 (as global layers) or > 1, got "
                          f"{cfg.rope_local_max_timescale}")
    if cfg.mtp_depth < 0 or cfg.mtp_loss_weight < 0:
        raise ConfigError(f"mtp_depth and mtp_loss_weight must be >= 0, got {cfg.mtp_depth} and {cfg.mtp_loss_weight}")
    if cfg.mlp_activation == "clamped_swiglu" and not (cfg.swiglu_limit > 0 and cfg.swiglu_alpha > 0):
        raise ConfigError(f"swiglu_limit and swiglu_alpha must be > 0, got {cfg.swiglu_limit} and {cfg.swiglu_alpha}")


def check_global_heads(cfg: Config) -> None:
    """The global layers' own head shape and values (Gemma 4): grouped-query attention, whole groups of query heads,
    an even width under RoPE."""
    width, kv_heads = cfg.global_head_dim, cfg.global_num_kv_heads
    if not (width or kv_heads or cfg.global_values_from_keys):
        return
    if mixer_kinds.latent(cfg.attention_type):
        raise ConfigError(f"global_head_dim={width}, global_num_kv_heads={kv_heads}, global_values_from_keys="
                          f"{str(cfg.global_values_from_keys).lower()} shape grouped-query heads: set "
                          "attention_type=gqa, or 0, 0 and false")
    if kv_heads and cfg.num_heads % kv_heads:
        raise ConfigError(f"global_num_kv_heads={kv_heads} must divide num_heads={cfg.num_heads} (0: num_kv_heads)")
    if width % 2:
        raise ConfigError(f"global_head_dim={width} must be even (RoPE rotates pairs; 0: head_dim)")


def _check_local_spelling(cfg: Config) -> None:
    """A layer_types entry that says how its layer is local (sliding_attention, chunked_attention) agrees with the
    key that is set."""
    for i, entry in enumerate(cfg.layer_types):
        key = _LOCAL_SPELLINGS.get(entry)
        if key and not getattr(cfg, key):
            raise ConfigError(f"layer_types[{i}]={entry!r} needs {key} > 0 (the local layers here see "
                              f"{'a chunk' if cfg.attention_chunk_size else 'a window'})")


def check_positions(cfg: Config) -> None:
    """Llama 4's position keys: rope_layers one 0 or 1 a layer, NoPE only where a layer's attention takes it
    (grouped-query heads: latent attention's RoPE part is its own), a temperature where a layer has no RoPE, and
    the L2 q/k norm apart from qk_norm."""
    flags = cfg.rope_layers
    if flags and len(flags) != cfg.num_layers:
        raise ConfigError(f"rope_layers has {len(flags)} entries and num_layers={cfg.num_layers}: one 0 or 1 a layer")
    nope = [i for i, flag in enumerate(flags) if not flag]
    for i in nope:
        row = mixer_kinds.resolve(cfg.layer_types[i])[0] if cfg.layer_types else mixer_kinds.kind(cfg.attention_type)
        if not row.attention or mixer_kinds.latent(row.name):
            raise ConfigError(f"rope_layers[{i}]=0: layer {i} is {row.name}, which has no RoPE to leave out; NoPE "
                              "layers are grouped-query attention")
    if cfg.nope_temperature_scale < 0 or cfg.nope_temperature_floor < 1:
        raise ConfigError(f"nope_temperature_scale must be >= 0 and nope_temperature_floor >= 1, got "
                          f"{cfg.nope_temperature_scale} and {cfg.nope_temperature_floor}")
    if cfg.nope_temperature_scale and not nope:
        raise ConfigError(f"nope_temperature_scale={cfg.nope_temperature_scale} scales the queries of NoPE layers: "
                          "rope_layers has no 0")
    if cfg.qk_l2_norm and (cfg.qk_norm or mixer_kinds.latent(cfg.attention_type)):
        raise ConfigError("qk_l2_norm normalises grouped-query heads without a scale; with qk_norm (a learned one) "
                          "or attention_type=mla set it false")
