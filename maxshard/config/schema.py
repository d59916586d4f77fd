"""The Config type: every key's type and default, in one place.

`configs/base.yml` repeats every user key with a one-line comment; `tests/test_config.py` checks that the two agree
(same keys, same defaults), so this file stays the single source of truth for types and defaults. Fields marked
`derived` are computed by `config.finalize` and can never be set by a user.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from maxshard import dataset_types
from maxshard.spec import attention_kinds, pipeline_schedule, remat
from maxshard.spec.model_config import ModelConfig
from maxshard.objectives import kinds as objective_kinds

# Mesh axes, outermost first. `stage` holds pipeline stages; its knobs are spelled `*_pipeline_parallelism`.
# `context` splits the length for ring attention (layers/ring_attention.py); inner to `sequence` so a ring's
# neighbours are close devices.
MESH_AXES = (
    "data",
    "stage",
    "fsdp",
    "fsdp_transpose",
    "sequence",
    "context",
    "tensor",
    "tensor_sequence",
    "expert",
    "autoregressive",
)

Attention = Literal[("auto", *attention_kinds.NAMES)]  # maxshard/spec/attention_kinds.py: the implementations
RematPolicy = Literal[("auto", *remat.NAMES)]  # maxshard/spec/remat.py: the table of policies
PipelineSchedule = Literal[pipeline_schedule.NAMES]  # maxshard/spec/pipeline_schedule.py, pipeline_tables.py
DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["none", "int8", "fp8"]  # maxshard/model/quantization.py
LogicalRules = tuple[tuple[str, tuple[str, ...]], ...]
MeshRules = tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
ObjectiveName = Literal[objective_kinds.NAMES]  # maxshard/objectives/kinds.py: the objectives
DpoReference = Literal[objective_kinds.REFERENCES]
GrpoLossType = Literal[objective_kinds.GRPO_LOSS_TYPES]
DatasetType = Literal[dataset_types.NAMES]  # maxshard/dataset_types.py: the readers
Mixture = tuple[tuple[str, float], ...]  # dataset_mixture: (source, weight) pairs


@dataclasses.dataclass(frozen=True)
class MemoryFit:
    """Why a run uses its remat policy: the planned peak per device against the usable device memory
    (maxshard/planning/fit.py decides; the startup summary and metrics.jsonl's first record show it)."""

    requested: str  # the remat_policy key as given ("auto" or a policy)
    policy: str  # the policy the run uses
    planned_bytes: int  # planned peak per device under `policy`
    usable_bytes: int  # capacity x (1 - memory_headroom)
    capacity_bytes: int
    capacity_source: str  # where the capacity comes from, for a person
    fits: bool = True

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def knob_name(family: str, axis: str) -> str:
    """`ici`/`dcn` knob of a mesh axis: ("ici", "fsdp") -> "ici_fsdp_parallelism"."""
    return f"{family}_{'pipeline' if axis == 'stage' else axis}_parallelism"


def _derived(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={"derived": True})


_MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}


def _model_default(key: str) -> Any:
    """A model key's default, from `ModelConfig`, its one home: the run config copies the key into the model, so a
    default written twice could disagree between a trained and a converted or generated model."""
    return _MODEL_DEFAULTS[key]


def _path(default: str = "") -> Any:
    """A filesystem path: `config.finalize` resolves a relative one against the working directory, once."""
    return dataclasses.field(default=default, metadata={"path": True})


def path_keys() -> tuple[str, ...]:
    """Keys that hold a local path or a remote URL (gs://...)."""
    return tuple(f.name for f in dataclasses.fields(Config) if f.metadata.get("path"))


@dataclasses.dataclass(frozen=True)
class Config:
    # ---- run
    run_name: str = "default"
    base_output_directory: str = _path("runs")
    steps: int = 300
    seed: int = 0
    log_period: int = 10
    eval_period: int = 100
    eval_steps: int = 4

    # ---- devices and mesh
    cpu_device_count: int = 0
    num_slices: int = 1
    mesh_selector: str = ""
    mesh_rules: MeshRules = ()
    ici_data_parallelism: int = 1
    ici_pipeline_parallelism: int = 1
    ici_fsdp_parallelism: int = -1
    ici_fsdp_transpose_parallelism: int = 1
    ici_sequence_parallelism: int = 1
    ici_context_parallelism: int = 1
    ici_tensor_parallelism: int = 1
    ici_tensor_sequence_parallelism: int = 1
    ici_expert_parallelism: int = 1
    ici_autoregressive_parallelism: int = 1
    dcn_data_parallelism: int = -1
    dcn_pipeline_parallelism: int = 1
    dcn_fsdp_parallelism: int = 1
    dcn_fsdp_transpose_parallelism: int = 1
    dcn_sequence_parallelism: int = 1
    dcn_context_parallelism: int = 1
    dcn_tensor_parallelism: int = 1
    dcn_tensor_sequence_parallelism: int = 1
    dcn_expert_parallelism: int = 1
    dcn_autoregressive_parallelism: int = 1
    logical_axis_rules: LogicalRules = ()
    check_sharding: bool = False
    max_replicated_fraction: float = 0.02

    # ---- model
    model_name: str = ""
    override_model_config: bool = False
    vocab_size: int = 0
    vocab_size_multiple: int = 128
    emb_dim: int = _model_default("emb_dim")
    num_layers: int = _model_default("num_layers")
    num_heads: int = _model_default("num_heads")
    num_kv_heads: int = _model_default("num_kv_heads")
    head_dim: int = _model_default("head_dim")
    mlp_dim: int = _model_default("mlp_dim")
    max_target_length: int = _model_default("max_target_length")
    logits_via_embedding: bool = _model_default("logits_via_embedding")
    norm_epsilon: float = _model_default("norm_epsilon")
    qk_norm: bool = _model_default("qk_norm")
    attention_type: Literal["gqa", "mla"] = _model_default("attention_type")
    q_lora_rank: int = _model_default("q_lora_rank")
    kv_lora_rank: int = _model_default("kv_lora_rank")
    qk_nope_head_dim: int = _model_default("qk_nope_head_dim")
    qk_rope_head_dim: int = _model_default("qk_rope_head_dim")
    v_head_dim: int = _model_default("v_head_dim")
    sliding_window: int = _model_default("sliding_window")
    attention_pattern: tuple[str, ...] = _model_default("attention_pattern")
    rope_local_max_timescale: float = _model_default("rope_local_max_timescale")
    attn_logit_softcapping: float = _model_default("attn_logit_softcapping")
    final_logit_softcapping: float = _model_default("final_logit_softcapping")
    query_pre_attn_scalar: float = _model_default("query_pre_attn_scalar")
    attention_sinks: bool = _model_default("attention_sinks")
    attention_bias: bool = _model_default("attention_bias")
    norm_unit_offset: bool = _model_default("norm_unit_offset")
    post_norms: bool = _model_default("post_norms")
    mlp_activation: Literal["silu", "gelu_tanh", "clamped_swiglu"] = _model_default("mlp_activation")
    swiglu_limit: float = _model_default("swiglu_limit")
    swiglu_alpha: float = _model_default("swiglu_alpha")
    embed_scale: bool = _model_default("embed_scale")
    mtp_depth: int = _model_default("mtp_depth")
    mtp_loss_weight: float = 0.3
    rope_max_timescale: float = _model_default("rope_max_timescale")
    rope_scaling_type: Literal["none", "linear", "llama3", "yarn"] = _model_default("rope_scaling_type")
    rope_scaling_factor: float = _model_default("rope_scaling_factor")
    rope_low_freq_factor: float = _model_default("rope_low_freq_factor")
    rope_high_freq_factor: float = _model_default("rope_high_freq_factor")
    rope_original_max_position: int = _model_default("rope_original_max_position")
    yarn_beta_fast: float = _model_default("yarn_beta_fast")
    yarn_beta_slow: float = _model_default("yarn_beta_slow")
    yarn_mscale: float = _model_default("yarn_mscale")
    yarn_mscale_all_dim: float = _model_default("yarn_mscale_all_dim")
    yarn_truncate: bool = _model_default("yarn_truncate")
    dtype: DType = "auto"
    weight_dtype: DType = _model_default("weight_dtype")
    quantization: Quantization = "none"
    scan_layers: bool = _model_default("scan_layers")
    remat_policy: RematPolicy = "auto"
    memory_headroom: float = 0.1
    device_memory_gb: float = 0.0
    attention: Attention = "auto"
    attention_block_q: int = _model_default("attention_block_q")
    attention_block_kv: int = _model_default("attention_block_kv")
    loss_chunks: int = 0

    # ---- training
    per_device_batch_size: float = 2.0
    gradient_accumulation_steps: int = 1
    elastic: bool = True
    elastic_allow_batch_change: bool = False
    learning_rate: float = 3e-3
    warmup_steps_fraction: float = 0.05
    learning_rate_schedule_steps: int = -1
    cosine_final_fraction: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0

    # ---- objective (maxshard/objectives): what the step minimises
    objective: ObjectiveName = "lm"
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0
    dpo_reference: DpoReference = "auto"
    simpo_beta: float = 2.0
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1

    # ---- grpo (objective grpo): rollouts from dataset_type prompts, scored by `reward` (maxshard/rewards.py)
    grpo_group_size: int = 4
    grpo_updates_per_rollout: int = 1
    grpo_kl_beta: float = 0.04
    grpo_epsilon: float = 0.2
    grpo_temperature: float = 1.0
    grpo_top_p: float = 1.0
    grpo_max_new_tokens: int = 32
    grpo_max_prompt_length: int = 64
    grpo_loss_type: GrpoLossType = "grpo"
    reward: str = "exact_match"
    reward_answer_field: str = "answer"
    reward_answer_regex: str = ""

    # ---- data
    dataset_type: DatasetType = "text"
    dataset_path: str = _path()
    dataset_mixture: Mixture = ()
    text_field: str = "text"
    messages_field: str = "messages"
    chat_template: str = ""
    hf_split: str = "train"
    hf_streaming: Literal["auto", "always", "never"] = "auto"
    data_cache_dir: str = _path()
    tokenizer_path: str = _path()
    packing: bool = True
    data_shuffle_seed: int = 0
    eval_fraction: float = 0.02
    grain_worker_count: int = 0
    grain_prefetch: int = 2

    # ---- metrics
    enable_tensorboard: bool = True
    profiler: Literal["", "xplane"] = ""
    profile_start: int = 5
    profile_steps: int = 3

    # ---- distributed
    coordinator_address: str = ""
    process_count: int = 0
    process_id: int = -1
    distributed_timeout: int = 300

    # ---- moe
    num_experts: int = _model_default("num_experts")
    num_experts_per_tok: int = _model_default("num_experts_per_tok")
    capacity_factor: float = _model_default("capacity_factor")
    moe_layer_interval: int = _model_default("moe_layer_interval")
    moe_group_size: int = _model_default("moe_group_size")
    moe_dropless_impl: Literal["auto", "ragged_dot", "tiled", "dense"] = "auto"
    moe_exchange: Literal["auto", "all_to_all", "ragged"] = "auto"
    moe_ragged_buffer_factor: float = _model_default("moe_ragged_buffer_factor")
    num_shared_experts: int = _model_default("num_shared_experts")
    moe_renormalize_top_k: bool = _model_default("moe_renormalize_top_k")
    moe_mlp_dim: int = _model_default("moe_mlp_dim")
    first_k_dense_replace: int = _model_default("first_k_dense_replace")
    moe_router: Literal["softmax", "sigmoid"] = _model_default("moe_router")
    moe_n_group: int = _model_default("moe_n_group")
    moe_topk_group: int = _model_default("moe_topk_group")
    moe_routed_scaling_factor: float = _model_default("moe_routed_scaling_factor")
    moe_router_bias: bool = _model_default("moe_router_bias")
    moe_bias: bool = _model_default("moe_bias")
    moe_bias_update_rate: float = 0.0
    moe_seq_balance_loss_weight: float = 0.0
    load_balance_loss_weight: float = 0.01
    router_z_loss_weight: float = 0.001

    # ---- LoRA (maxshard/model/layers/lora.py): adapters train, the base parameters of load_parameters_path stay frozen
    lora_rank: int = _model_default("lora_rank")
    lora_alpha: float = _model_default("lora_alpha")
    lora_targets: tuple[str, ...] = _model_default("lora_targets")

    # ---- pipeline
    num_layers_per_pipeline_stage: int = 1
    num_pipeline_repeats: int = -1
    num_pipeline_microbatches: int = -1
    pipeline_schedule: PipelineSchedule = "circular"

    # ---- checkpoint
    enable_checkpointing: bool = True
    async_checkpointing: bool = True
    checkpoint_period: int = 100
    max_checkpoints_to_keep: int = 3
    checkpoint_local_dir: str = _path()
    checkpoint_local_period: int = 10
    load_parameters_path: str = _path()
    load_full_state_path: str = _path()

    # ---- generation (python -m maxshard.generate; see maxshard/generate.py)
    prompt: str = ""
    prompts_file: str = _path()
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    generate_output: str = _path()

    # ---- lm-eval-harness tasks (python -m maxshard.eval, and in training; see maxshard/evaluation/)
    tasks: str = ""
    eval_tasks: str = ""
    eval_tasks_period: int = 0
    eval_tasks_limit: int = 0
    eval_tasks_dir: str = _path()
    eval_batch_size: int = 8
    eval_output: str = _path()

    # ---- derived (set by config.finalize)
    explicit_keys: tuple[str, ...] = _derived(())
    mesh_rule_applied: str = _derived("")
    num_devices: int = _derived(0)
    num_processes: int = _derived(1)
    device_kind: str = _derived("")
    global_batch_size: int = _derived(0)
    schedule_steps: int = _derived(0)
    warmup_steps: int = _derived(0)
    run_dir: str = _derived("")
    checkpoint_dir: str = _derived("")
    tensorboard_dir: str = _derived("")
    model: ModelConfig | None = _derived(None)  # the network, derived once when a run is loaded (maxshard.run.loading)
    memory_fit: MemoryFit | None = _derived(None)  # the planned peak vs the device, when a run checked it

    def parallelism(self, family: str, axis: str) -> int:
        """The `ici`/`dcn` knob of a mesh axis."""
        return getattr(self, knob_name(family, axis))
