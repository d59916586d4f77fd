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
from maxshard.spec.model_config import ModelConfig, ModelKeys
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
XlaGpuOptions = Literal["default", "tuned"]  # maxshard/parallel/xla_options.py: the GPU option tables
LogicalRules = tuple[tuple[str, tuple[str, ...]], ...]
MeshRules = tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
ObjectiveName = Literal[objective_kinds.NAMES]  # maxshard/objectives/kinds.py: the objectives
ReferenceSource = Literal[objective_kinds.REFERENCES]
GrpoLossType = Literal[objective_kinds.GRPO_LOSS_TYPES]
GrpoKlEstimator = Literal[objective_kinds.GRPO_KL_ESTIMATORS]
GrpoImportanceSampling = Literal[objective_kinds.GRPO_IMPORTANCE_SAMPLING]
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


def _path(default: str = "") -> Any:
    """A filesystem path: `config.finalize` resolves a relative one against the working directory, once."""
    return dataclasses.field(default=default, metadata={"path": True})


def path_keys() -> tuple[str, ...]:
    """Keys that hold a local path or a remote URL (gs://...)."""
    return tuple(f.name for f in dataclasses.fields(Config) if f.metadata.get("path"))


@dataclasses.dataclass(frozen=True)
class Config(ModelKeys):
    """Every YAML key. The model keys the network reads as they are (`emb_dim`, `num_experts`, ...) are inherited
    from `ModelKeys` (spec/model_config.py), their one home; the keys below are the run's own, and the model keys
    whose value is a request the run resolves (`dtype: auto`, `attention: auto`, ...)."""

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

    # ---- model (the network's own keys are ModelKeys's, inherited)
    model_name: str = ""
    override_model_config: bool = False
    vocab_size: int = 0
    vocab_size_multiple: int = 128
    mtp_loss_weight: float = 0.3
    dtype: DType = "auto"
    weight_dtype: DType = "float32"
    quantization: Quantization = "none"
    xla_gpu_options: XlaGpuOptions = "default"
    remat_policy: RematPolicy = "auto"
    memory_headroom: float = 0.1
    device_memory_gb: float = 0.0
    attention: Attention = "auto"
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
    dpo_reference: ReferenceSource = "auto"
    simpo_beta: float = 2.0
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1
    kto_beta: float = 0.1
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    kto_reference: ReferenceSource = "auto"

    # ---- grpo (objective grpo): rollouts from dataset_type prompts, scored by `reward` (maxshard/rewards.py)
    grpo_group_size: int = 4
    grpo_updates_per_rollout: int = 1
    grpo_kl_beta: float = 0.04
    grpo_epsilon: float = 0.2
    grpo_temperature: float = 1.0
    grpo_top_p: float = 1.0
    grpo_max_new_tokens: int = 32
    grpo_max_prompt_length: int = 64
    grpo_loss_type: GrpoLossType = "dapo"
    grpo_kl_estimator: GrpoKlEstimator = "bias_corrected"
    grpo_epsilon_high: float = 0.0
    grpo_importance_sampling: GrpoImportanceSampling = "token"
    grpo_environment: str = ""
    grpo_max_turns: int = 1
    grpo_rollout_rows: int = 0
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
    max_bad_record_fraction: float = 0.01
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

    # ---- moe (the layer's shape and routing are ModelKeys's)
    moe_dropless_impl: Literal["auto", "ragged_dot", "tiled", "dense"] = "auto"
    moe_exchange: Literal["auto", "all_to_all", "ragged"] = "auto"
    moe_bias_update_rate: float = 0.0
    moe_seq_balance_loss_weight: float = 0.0
    load_balance_loss_weight: float = 0.01
    router_z_loss_weight: float = 0.001

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
