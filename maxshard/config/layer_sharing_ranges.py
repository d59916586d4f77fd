"""Range checks of Gemma 4's keys that tie layers to each other or give each an input of its own: KV-shared layers
(`kv_shared_layers`), per-layer input embeddings (`per_layer_input_dim`, `per_layer_vocab_size`) and proportional
RoPE (`rope_proportion`). Part of `config/ranges.py`'s checks; the pipeline's own refusal is in
parallel/stages.py."""

from __future__ import annotations

from maxshard.config.schema import Config
from maxshard.errors import ConfigError
from maxshard.spec import mixer_kinds

__all__ = ["check_kv_sharing", "check_per_layer_inputs", "check_rope_proportion", "across_stages"]


def check_kv_sharing(cfg: Config) -> None:
    """The KV-shared layers are the last ones, after at least one whole unit of layers of their own (the layer
    pattern's period: spec/blocks.py), every layer grouped-query attention, and no MoE or prediction layers."""
    shared = cfg.kv_shared_layers
    if not shared:
        if cfg.kv_shared_mlp_dim:
            raise ConfigError(f"kv_shared_mlp_dim={cfg.kv_shared_mlp_dim} widens the KV-shared layers' MLP: set "
                              "kv_shared_layers > 0, or kv_shared_mlp_dim=0")
        return
    own = cfg.num_layers - shared
    period = cfg.pattern_length
    if own < period or own % period:
        raise ConfigError(f"kv_shared_layers={shared} must leave the first num_layers - it layers a whole number "
                          f"(>= 1) of the layer pattern's period {period} (num_layers={cfg.num_layers}): they hold "
                          "the keys and values the shared layers reuse")
    kinds = {mixer_kinds.resolve(e)[0].name for e in cfg.layer_types} if cfg.layer_types else {cfg.attention_type}
    if kinds != {"gqa"}:
        raise ConfigError(f"kv_shared_layers={shared} reuses grouped-query keys and values: every layer must be gqa "
                          f"attention, got {sorted(kinds)}")
    if cfg.num_experts > 1 or cfg.mtp_depth:
        raise ConfigError(f"kv_shared_layers={shared} runs with dense layers and no prediction modules: set "
                          f"num_experts=1 and mtp_depth=0 (got {cfg.num_experts} and {cfg.mtp_depth})")


def check_per_layer_inputs(cfg: Config) -> None:
    """A table of at most the vocabulary's rows, and no prediction modules (which have no per-layer input); both
    keys >= 0 (config/ranges.py `_POSITIVE_INTS`)."""
    width, rows = cfg.per_layer_input_dim, cfg.per_layer_vocab_size
    if rows > cfg.vocab_size:
        raise ConfigError(f"per_layer_vocab_size in [0, vocab_size={cfg.vocab_size}] is the per-layer table's rows "
                          f"(0: vocab_size), got {rows}")
    if width and cfg.mtp_depth:
        raise ConfigError(f"per_layer_input_dim={width} with mtp_depth={cfg.mtp_depth}: the prediction modules' "
                          "layers have no per-layer input; set mtp_depth=0")


def check_rope_proportion(cfg: Config) -> None:
    """Proportional RoPE turns a share in (0, 1] of each grouped-query head's pairs (finite: config/ranges.py)."""
    share = cfg.rope_proportion
    if not 0 < share <= 1:
        raise ConfigError(f"rope_proportion must be in (0, 1] (1: every rotary pair turns), got {share}")
    if share != 1 and (mixer_kinds.latent(cfg.attention_type) or cfg.partial_rotary_factor != 1):
        raise ConfigError(f"rope_proportion={share} turns pairs of whole grouped-query heads: set "
                          "partial_rotary_factor=1 and attention_type=gqa, or rope_proportion=1")


def across_stages(cfg: Config) -> str:
    """What ties the layers to each other or to the embedding, which a pipeline's stages cannot pass on, in words
    ("" for nothing)."""
    if cfg.kv_shared_layers:
        return f"kv_shared_layers={cfg.kv_shared_layers}"
    return f"per_layer_input_dim={cfg.per_layer_input_dim}" if cfg.per_layer_input_dim else ""
