"""Range checks: values that type-check but make no sense (steps=0, eval_fraction=1.5, a mesh knob of 0).

Kept apart from loading so `config.py` holds one idea: reading and merging YAML into a typed Config.
"""

from __future__ import annotations

import math
import os
import re
import typing

from maxshard.config import attention_ranges, layer_sharing_ranges
from maxshard.config.schema import MESH_AXES, Config, knob_name
from maxshard.errors import ConfigError
from maxshard.spec import mixer_kinds
from maxshard.spec.model_config import LORA_TARGETS
from maxshard.objectives import kinds as objective_kinds

__all__ = ["check_ranges", "check_group_batch"]


def check_ranges(cfg: Config) -> Config:
    """Values that type-check but make no sense; each message names the key and the allowed range."""
    for key, low in _POSITIVE_INTS.items():
        value = getattr(cfg, key)
        if value < low:
            raise ConfigError(f"{key} must be >= {low}, got {value}")
    for key in _FINITE_FLOATS:
        value = getattr(cfg, key)
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
    if cfg.device_memory_gb < 0:
        raise ConfigError(f"device_memory_gb must be >= 0 (0: detect), got {cfg.device_memory_gb}")
    if not cfg.per_device_batch_size > 0:
        raise ConfigError(f"per_device_batch_size must be > 0, got {cfg.per_device_batch_size}")
    for key, (low, high, closed) in _UNIT_INTERVALS.items():
        value = getattr(cfg, key)
        if not (low <= value <= high if closed else low <= value < high):
            raise ConfigError(f"{key} must be in [{low:g}, {high:g}{']' if closed else ')'}, got {value}")
    if not cfg.run_name or "/" in cfg.run_name:
        raise ConfigError(f"run_name must be a non-empty name without '/', got {cfg.run_name!r}")
    _check_data(cfg)
    _check_rope(cfg)
    attention_ranges.check_layer_types(cfg)
    attention_ranges.check_local_global(cfg)
    attention_ranges.check_positions(cfg)
    attention_ranges.check_global_heads(cfg)
    layer_sharing_ranges.check_kv_sharing(cfg)
    layer_sharing_ranges.check_per_layer_inputs(cfg)
    layer_sharing_ranges.check_rope_proportion(cfg)
    _check_deltanet(cfg)
    for axis in MESH_AXES:
        for family in ("ici", "dcn"):
            value = getattr(cfg, knob_name(family, axis))
            if value == 0 or value < -1:
                raise ConfigError(f"{knob_name(family, axis)} must be a positive size or -1 (fill), got {value}")
    _check_moe(cfg)
    _check_lora(cfg)
    _check_grpo(cfg)
    _check_objective(cfg)
    _check_sampling(cfg)
    if cfg.loss_chunks < 0 or (cfg.loss_chunks and cfg.max_target_length % cfg.loss_chunks):
        raise ConfigError(f"loss_chunks={cfg.loss_chunks} must be 0 (auto) or divide "
                          f"max_target_length={cfg.max_target_length}")
    return cfg


def _check_objective(cfg: Config) -> None:
    """The objective's hyperparameters, its reference, and whether the data holds what its rows need."""
    for key in ("dpo_beta", "simpo_beta"):
        if not getattr(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0, got {getattr(cfg, key)}")
    if not 0 <= cfg.dpo_label_smoothing < 0.5:
        raise ConfigError(f"dpo_label_smoothing must be in [0, 0.5), got {cfg.dpo_label_smoothing}")
    if cfg.orpo_lambda < 0:
        raise ConfigError(f"orpo_lambda must be >= 0, got {cfg.orpo_lambda}")
    if not cfg.kto_beta > 0:
        raise ConfigError(f"kto_beta must be > 0, got {cfg.kto_beta}")
    for key in ("kto_desirable_weight", "kto_undesirable_weight"):
        if not getattr(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0, got {getattr(cfg, key)}")
    objective = objective_kinds.kind(cfg.objective)
    pair_data = cfg.dataset_type in PAIR_DATASETS and not cfg.dataset_mixture
    if objective.preference and not pair_data:
        raise ConfigError(f"objective={cfg.objective} trains on preference records: set dataset_type to one of "
                          f"{', '.join(PAIR_DATASETS)} (dataset_type={cfg.dataset_type}"
                          f"{', with a dataset_mixture' if cfg.dataset_mixture else ''})")
    if objective.documents and cfg.dataset_type in PAIR_DATASETS[1:]:
        raise ConfigError(f"dataset_type={cfg.dataset_type} holds preference records: set objective to one of "
                          f"{', '.join(objective_kinds.names_where('preference'))} (objective={cfg.objective})")
    if objective.scores != cfg.score_head:
        scorers = ", ".join(objective_kinds.names_where("scores"))
        raise ConfigError(f"score_head={str(cfg.score_head).lower()} with objective={cfg.objective}: a model with a "
                          f"score head trains with objective={scorers}, and that objective needs score_head=true")
    source, key = objective_kinds.reference_source(cfg), objective.reference_key
    if source == "frozen" and cfg.lora_rank:
        raise ConfigError(f"{key}=frozen with lora_rank > 0 would keep a second copy of the frozen base: use "
                          "lora_base (or auto)")
    if source == "precomputed" and cfg.elastic_allow_batch_change:
        raise ConfigError(f"{key}=precomputed stores the reference per global batch: it cannot follow "
                          "elastic_allow_batch_change=true")
    if source == "lora_base" and not cfg.lora_rank:
        raise ConfigError(f"{key}=lora_base needs lora_rank > 0 (the base is the model with its adapters "
                          "off): use frozen (or auto)")


def _check_environment(cfg: Config) -> None:
    """grpo_environment's form, and what it excludes: a second reward, and several turns without it."""
    if not cfg.grpo_environment:
        if cfg.grpo_max_turns > 1:
            raise ConfigError(f"grpo_max_turns={cfg.grpo_max_turns} needs grpo_environment (PATH.py:function), "
                              "which answers the model's turns")
        return
    path, _, function = cfg.grpo_environment.rpartition(":")
    if not (path.endswith(".py") and function.isidentifier()):
        raise ConfigError(f"grpo_environment={cfg.grpo_environment}: PATH.py:function (a Python file and a "
                          "function in it), or \"\" for one completion per prompt")
    if cfg.reward != "exact_match":
        raise ConfigError(f"grpo_environment rewards each episode itself: leave reward at exact_match "
                          f"(reward={cfg.reward} would score it a second time)")


def _check_grpo(cfg: Config) -> None:
    """GRPO's sampling and loss keys, its reward, and its data: prompts are only read by an objective that samples
    (its Kind's `samples`)."""
    if not cfg.grpo_kl_beta >= 0:
        raise ConfigError(f"grpo_kl_beta must be >= 0 (0: no reference kept), got {cfg.grpo_kl_beta}")
    for key in ("grpo_epsilon", "grpo_temperature"):
        if not getattr(cfg, key) > 0:
            raise ConfigError(f"{key} must be > 0, got {getattr(cfg, key)}")
    if not cfg.grpo_epsilon_high >= 0:
        raise ConfigError(f"grpo_epsilon_high must be >= 0 (0: grpo_epsilon), got {cfg.grpo_epsilon_high}")
    if not 0 < cfg.grpo_top_p <= 1:
        raise ConfigError(f"grpo_top_p must be in (0, 1] (1: off), got {cfg.grpo_top_p}")
    if cfg.reward != "exact_match" and not cfg.reward.startswith("model:"):
        path, _, function = cfg.reward.rpartition(":")
        if not (path.endswith(".py") and function.isidentifier()):
            raise ConfigError(f"reward={cfg.reward}: exact_match, model:STEP_DIR (a reward model's checkpoint step), "
                              "or PATH.py:function (a Python file and a function in it)")
    _check_environment(cfg)
    if not cfg.reward_answer_field:
        raise ConfigError("reward_answer_field must name a record field, got an empty string")
    try:
        re.compile(cfg.reward_answer_regex)
    except re.error as e:
        raise ConfigError(f"reward_answer_regex={cfg.reward_answer_regex!r} is not a regular expression: {e}") \
            from None
    if cfg.dataset_type == "prompts" and not objective_kinds.kind(cfg.objective).samples:
        raise ConfigError(f"dataset_type=prompts holds prompts to sample completions from: set objective to "
                          f"{' or '.join(objective_kinds.names_where('samples'))} (objective={cfg.objective})")
    check_group_batch(cfg)


def check_group_batch(cfg: Config) -> Config:
    """objective grpo: the global batch holds whole groups of `grpo_group_size` completions of one prompt each.
    Checked again once `global_batch_size` is derived (0 before: `config.finalize`)."""
    if objective_kinds.kind(cfg.objective).samples and cfg.global_batch_size % cfg.grpo_group_size:
        raise ConfigError(f"global_batch_size={cfg.global_batch_size} (per_device_batch_size x devices) must be a "
                          f"multiple of grpo_group_size={cfg.grpo_group_size} (objective=grpo: a prompt's "
                          "completions are one group)")
    return cfg


PAIR_DATASETS = ("synthetic", "preference")  # dataset types whose rows can hold preference pairs


def _check_sampling(cfg: Config) -> None:
    """Generation keys: a temperature of 0 means greedy; top_p is a probability mass in (0, 1]."""
    if not cfg.temperature >= 0:
        raise ConfigError(f"temperature must be >= 0 (0: greedy), got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1] (1: off), got {cfg.top_p}")


def _check_moe(cfg: Config) -> None:
    """MoE keys that type-check but make no sense."""
    if cfg.num_experts < 1:
        raise ConfigError(f"num_experts must be >= 1 (1: dense), got {cfg.num_experts}")
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ConfigError(f"num_experts_per_tok must be in [1, num_experts={cfg.num_experts}], "
                          f"got {cfg.num_experts_per_tok}")
    _check_dense_first(cfg)
    moe_layers = cfg.num_layers - cfg.first_k_dense_replace
    if cfg.moe_layer_interval < 1 or moe_layers % cfg.moe_layer_interval:
        raise ConfigError(f"moe_layer_interval={cfg.moe_layer_interval} must be >= 1 and divide num_layers - "
                          f"first_k_dense_replace = {moe_layers}")
    if cfg.moe_group_size < 0 or (cfg.moe_group_size and cfg.max_target_length % cfg.moe_group_size):
        raise ConfigError(f"moe_group_size={cfg.moe_group_size} must be 0 (whole sequence) or divide "
                          f"max_target_length={cfg.max_target_length}")
    if cfg.moe_ragged_buffer_factor < 0:
        raise ConfigError(f"moe_ragged_buffer_factor must be >= 0 (0: the buffer no routing overflows), got "
                          f"{cfg.moe_ragged_buffer_factor}")
    if cfg.num_shared_experts < 0:
        raise ConfigError(f"num_shared_experts must be >= 0, got {cfg.num_shared_experts}")
    if cfg.shared_expert_gate and not cfg.num_shared_experts:
        raise ConfigError("shared_expert_gate=true gates the shared experts: set num_shared_experts > 0")
    for key in ("load_balance_loss_weight", "router_z_loss_weight", "moe_seq_balance_loss_weight",
                "moe_bias_update_rate"):
        if not getattr(cfg, key) >= 0:
            raise ConfigError(f"{key} must be >= 0, got {getattr(cfg, key)}")
    _check_routing(cfg)
    if cfg.moe_weights_on_input and (cfg.num_experts_per_tok != 1 or cfg.moe_bias):
        raise ConfigError(f"moe_weights_on_input scales each token by its one expert's weight (top-1 routing, no "
                          f"expert biases): set num_experts_per_tok=1 (got {cfg.num_experts_per_tok}) and "
                          f"moe_bias=false")
    if cfg.moe_beside_mlp and not (cfg.num_experts > 1 and cfg.pre_norms):
        raise ConfigError(f"moe_beside_mlp runs routed experts beside each MoE layer's dense MLP, the router "
                          f"reading the residual before the MLP's norm: it needs num_experts > 1 (got "
                          f"{cfg.num_experts}) and pre_norms=true (got {str(cfg.pre_norms).lower()})")


def _check_routing(cfg: Config) -> None:
    """DeepSeek-V3's group-limited routing and selection bias (layers/moe.py): groups that split the experts, a
    choice that fits in the groups kept, a bias to move."""
    if cfg.moe_n_group < 1 or cfg.num_experts % cfg.moe_n_group:
        raise ConfigError(f"moe_n_group={cfg.moe_n_group} must be >= 1 and divide num_experts={cfg.num_experts}")
    if not 1 <= cfg.moe_topk_group <= cfg.moe_n_group:
        raise ConfigError(f"moe_topk_group={cfg.moe_topk_group} must be in [1, moe_n_group={cfg.moe_n_group}]")
    available = cfg.moe_topk_group * (cfg.num_experts // cfg.moe_n_group)
    if cfg.num_experts_per_tok > available:
        raise ConfigError(f"num_experts_per_tok={cfg.num_experts_per_tok} is more than the {available} experts of "
                          f"moe_topk_group={cfg.moe_topk_group} groups of num_experts / moe_n_group="
                          f"{cfg.num_experts // cfg.moe_n_group}")
    if not cfg.moe_routed_scaling_factor > 0:
        raise ConfigError(f"moe_routed_scaling_factor must be > 0, got {cfg.moe_routed_scaling_factor}")
    if cfg.moe_bias_update_rate > 0 and not (cfg.moe_router_bias and cfg.num_experts > 1):
        raise ConfigError(f"moe_bias_update_rate={cfg.moe_bias_update_rate} moves the experts' selection bias: set "
                          "moe_router_bias=true (in an MoE model, num_experts > 1)")


def _check_dense_first(cfg: Config) -> None:
    """`first_k_dense_replace`: dense layers before the MoE ones, so an MoE model with at least one MoE layer."""
    first = cfg.first_k_dense_replace
    if first and cfg.num_experts == 1:
        raise ConfigError(f"first_k_dense_replace={first} needs an MoE model (num_experts > 1): every layer of a dense"
                          " model is dense already")
    if not 0 <= first < cfg.num_layers:
        raise ConfigError(f"first_k_dense_replace must be in [0, num_layers={cfg.num_layers}), got {first}")
    if cfg.moe_mlp_dim < 0:
        raise ConfigError(f"moe_mlp_dim must be >= 0 (0: mlp_dim), got {cfg.moe_mlp_dim}")


def _check_lora(cfg: Config) -> None:
    """LoRA keys: a rank >= 0, a positive alpha, known targets; adapters train on a base from load_parameters_path."""
    if cfg.lora_rank < 0:
        raise ConfigError(f"lora_rank must be >= 0 (0: no adapters, every parameter trains), got {cfg.lora_rank}")
    unknown = [t for t in cfg.lora_targets if t not in LORA_TARGETS]
    if unknown or not cfg.lora_targets:
        raise ConfigError(f"lora_targets={list(cfg.lora_targets)}: names from {', '.join(LORA_TARGETS)}, at least one")
    dense_mlps = (cfg.num_experts == 1 or cfg.moe_layer_interval > 1 or cfg.first_k_dense_replace > 0
                  or cfg.moe_beside_mlp)
    mlp_targets = [t for t in cfg.lora_targets if t in ("gate", "up", "down")]
    if cfg.lora_rank and mlp_targets and not dense_mlps:
        raise ConfigError(f"lora_targets={list(cfg.lora_targets)}: {', '.join(mlp_targets)} adapt dense MLPs, and "
                          "every layer of this model is MoE (its experts take no adapters): target q, k, v, o")
    if cfg.lora_rank and not cfg.lora_alpha > 0:
        raise ConfigError(f"lora_alpha must be > 0, got {cfg.lora_alpha}")


def _check_data(cfg: Config) -> None:
    """The data keys that can be judged without reading a file (paths are checked when the input is built)."""
    if not cfg.text_field:
        raise ConfigError("text_field must name a field or column, got an empty string")
    if not cfg.messages_field:
        raise ConfigError("messages_field must name a field or column, got an empty string")
    if cfg.chat_template not in ("", "default") and not os.path.isfile(cfg.chat_template):
        raise ConfigError(f"chat_template={cfg.chat_template}: no such file (\"\", default, or a .jinja file)")
    if cfg.dataset_type == "store":  # packed rows of one token store (data/store.py)
        if not cfg.packing:
            raise ConfigError("packing=false: dataset_type=store holds packed rows only; use packing=true, or "
                              "dataset_type=array_record for one document per row")
        if cfg.dataset_mixture:
            raise ConfigError("dataset_mixture: a token store is not a mixture source; prepare the documents into one "
                              "store (dataset_path), or mix with another dataset_type")
        if not cfg.dataset_path:
            raise ConfigError("dataset_path is empty; dataset_type=store reads the directory that "
                              "tools/prepare_data.py --store wrote")
    if cfg.dataset_mixture:
        if cfg.dataset_type == "synthetic":
            raise ConfigError("dataset_mixture needs real data; dataset_type=synthetic makes its own")
        if cfg.dataset_type == "preference":
            raise ConfigError("dataset_mixture mixes documents, not preference pairs; dataset_type=preference reads "
                              "dataset_path (a file, directory or glob)")
        if cfg.dataset_type == "prompts":
            raise ConfigError("dataset_mixture mixes documents, not prompts; dataset_type=prompts reads dataset_path "
                              "(a JSONL file, directory or glob, or a Hugging Face dataset)")
        if cfg.dataset_path:
            raise ConfigError("dataset_path and dataset_mixture are both set; set only one (a mixture lists its paths)")


def _check_rope(cfg: Config) -> None:
    """RoPE base and Llama-3 scaling: the blend runs from low to high (equal: a step, as Llama 4 Scout sets them),
    and a factor < 1 would shorten wavelengths;
    YaRN's ramp runs from beta_fast down to beta_slow turns (equal: a step, as Kimi-K2 sets them); latent attention's
    RoPE part rotates pairs."""
    if not cfg.rope_max_timescale > 1:
        raise ConfigError(f"rope_max_timescale must be > 1, got {cfg.rope_max_timescale}")
    if not cfg.rope_scaling_factor >= 1:
        raise ConfigError(f"rope_scaling_factor must be >= 1, got {cfg.rope_scaling_factor}")
    if not 0 < cfg.rope_low_freq_factor <= cfg.rope_high_freq_factor:
        raise ConfigError(f"rope_low_freq_factor and rope_high_freq_factor must satisfy 0 < low <= high (equal: a "
                          f"step, no blended band), got {cfg.rope_low_freq_factor} and {cfg.rope_high_freq_factor}")
    if cfg.rope_scaling_type == "yarn" and not 0 < cfg.yarn_beta_slow <= cfg.yarn_beta_fast:
        raise ConfigError(f"yarn_beta_slow and yarn_beta_fast must satisfy 0 < slow <= fast (equal: Kimi-K2's step "
                          f"from kept to interpolated), got {cfg.yarn_beta_slow} and {cfg.yarn_beta_fast}")
    if cfg.yarn_mscale < 0 or cfg.yarn_mscale_all_dim < 0:
        raise ConfigError(f"yarn_mscale and yarn_mscale_all_dim must be >= 0 (0: unset), got {cfg.yarn_mscale} and "
                          f"{cfg.yarn_mscale_all_dim}")
    if mixer_kinds.latent(cfg.attention_type) and cfg.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {cfg.qk_rope_head_dim}")
    if mixer_kinds.latent(cfg.attention_type) and cfg.qk_norm:
        raise ConfigError("qk_norm normalises grouped-query heads; attention_type=mla normalises its latents: "
                          "set qk_norm=false")
    if mixer_kinds.latent(cfg.attention_type) and (cfg.qkv_bias or cfg.attention_bias):
        raise ConfigError("attention_bias and qkv_bias bias grouped-query projections; attention_type=mla has none: "
                          "set them false")
    if cfg.qkv_bias and cfg.attention_bias:
        raise ConfigError("qkv_bias: attention_bias already biases the query, key and value projections (and the "
                          "output); set one of them")
    if cfg.qk_norm_all_heads and not cfg.qk_norm:
        raise ConfigError("qk_norm_all_heads says how qk_norm normalises: set qk_norm=true or qk_norm_all_heads=false")
    if not cfg.pre_norms and not cfg.post_norms:
        raise ConfigError("pre_norms=false leaves a layer without norms unless post_norms=true: set one of them")
    rotary = cfg.head_dim * cfg.partial_rotary_factor
    if not 0 < cfg.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
        raise ConfigError(f"partial_rotary_factor={cfg.partial_rotary_factor} must be in (0, 1] with head_dim x it "
                          f"an even whole number (RoPE rotates pairs), head_dim={cfg.head_dim}")
    if cfg.partial_rotary_factor != 1 and mixer_kinds.latent(cfg.attention_type):
        raise ConfigError("partial_rotary_factor applies to grouped-query heads; attention_type=mla has its own RoPE "
                          "part (qk_rope_head_dim): set partial_rotary_factor=1")


def _check_deltanet(cfg: Config) -> None:
    """Gated DeltaNet's value heads repeat its key heads, so they come in whole groups (layers/gated_deltanet.py)."""
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(f"linear_num_value_heads={cfg.linear_num_value_heads} must be a multiple of "
                          f"linear_num_key_heads={cfg.linear_num_key_heads} (each key head serves whole value heads)")


_POSITIVE_INTS = {
    "steps": 1,
    "log_period": 1,
    "num_slices": 1,
    "cpu_device_count": 0,
    "gradient_accumulation_steps": 1,
    "eval_period": 0,
    "eval_steps": 1,
    "emb_dim": 1,
    "num_layers": 1,
    "num_heads": 1,
    "num_kv_heads": 1,
    "head_dim": 1,
    "global_head_dim": 0,
    "global_num_kv_heads": 0,
    "kv_shared_mlp_dim": 0,
    "kv_shared_layers": 0,
    "per_layer_input_dim": 0,
    "per_layer_vocab_size": 0,
    "q_lora_rank": 0,
    "kv_lora_rank": 1,
    "qk_nope_head_dim": 1,
    "qk_rope_head_dim": 2,
    "v_head_dim": 1,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 1,
    "linear_key_head_dim": 1,
    "linear_value_head_dim": 1,
    "linear_conv_kernel_dim": 1,
    "delta_chunk_size": 1,
    "mlp_dim": 1,
    "attention_block_q": 1,
    "attention_block_kv": 1,
    "max_target_length": 1,
    "rope_original_max_position": 1,
    "vocab_size": 0,
    "vocab_size_multiple": 1,
    "checkpoint_period": 1,
    "max_checkpoints_to_keep": 0,
    "checkpoint_local_period": 1,
    "profile_start": 0,
    "profile_steps": 1,
    "distributed_timeout": 1,
    "process_count": 0,
    "process_id": -1,
    "grain_worker_count": 0,
    "grain_prefetch": 0,
    "data_shuffle_seed": 0,
    "max_new_tokens": 1,
    "top_k": 0,
    "grpo_group_size": 2,
    "grpo_updates_per_rollout": 1,
    "grpo_max_new_tokens": 1,
    "grpo_max_prompt_length": 1,
    "grpo_max_turns": 1,
    "grpo_rollout_rows": 0,
    "eval_tasks_period": 0,
    "eval_tasks_limit": 0,
    "eval_batch_size": 1,
}
_UNIT_INTERVALS = {  # key: (low, high, high included)
    "warmup_steps_fraction": (0.0, 1.0, True),
    "eval_fraction": (0.0, 1.0, False),
    "max_bad_record_fraction": (0.0, 1.0, True),
    "cosine_final_fraction": (0.0, 1.0, True),
    "memory_headroom": (0.0, 1.0, False),
}
_FINITE_FLOATS = tuple(key for key, hint in typing.get_type_hints(Config).items() if hint is float)  # every float key: nan/inf never help
