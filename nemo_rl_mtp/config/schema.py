"""Types of every config key. Defaults are not here: they live once, in the exemplar YAML
(``nemo_rl_mtp/config/grpo_mtp.yaml``), which also documents each key.

A field without a default is MISSING until the exemplar fills it, so a key that the exemplar
forgets is an error at load time, not a silent default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass
class OptimizerConfig:
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float


@dataclass
class MegatronConfig:
    seed: int
    transformer_impl: str
    params_dtype: str
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    sequence_parallel: bool
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    normalization: Optional[str]
    activation: Optional[str]
    position_embedding_type: Optional[str]
    rotary_base: int
    share_embeddings_and_output_weights: bool
    model_class: str
    hybrid_layer_pattern: Optional[str]
    hidden_dropout: float
    attention_dropout: float
    recompute_granularity: Optional[str]
    recompute_method: Optional[str]
    recompute_num_layers: Optional[int]
    # None only between loading and resolving a config whose MTP layers come from a checkpoint.
    mtp_num_layers: Optional[int]
    mtp_loss_scaling_factor: float
    mtp_use_repeated_layer: bool
    mtp_detach_heads: bool
    mtp_loss_type: str
    mtp_zero_embedding_at_position_0: Union[bool, str]  # or "auto"
    num_moe_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: Optional[int]
    moe_router_load_balancing_type: str
    moe_aux_loss_coeff: float
    moe_token_dispatcher_type: str
    optimizer: OptimizerConfig


@dataclass
class SequencePackingConfig:
    enabled: bool


@dataclass
class InferenceEngineConfig:
    block_size_tokens: int
    buffer_size_gb: float
    max_requests: Optional[int]
    max_tokens: Optional[int]


@dataclass
class GenerationConfig:
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    num_speculative_tokens: Union[int, str]  # or "auto"
    spec_verification: str
    draft_context: str
    engine: InferenceEngineConfig


@dataclass
class PolicyConfig:
    model_name: Optional[str]
    trust_remote_code: bool
    train_global_batch_size: int
    train_micro_batch_size: int
    max_total_sequence_length: int
    mtp_loss_mask_policy: str
    mtp_frozen_during_rl: bool
    sequence_packing: SequencePackingConfig
    generation: GenerationConfig
    megatron_cfg: MegatronConfig


@dataclass
class GRPOConfig:
    num_prompts_per_step: int
    num_generations_per_prompt: int
    max_num_steps: int
    normalize_rewards: bool
    seed: int
    warmup_imitation_steps: int
    warmup_lr: float
    warmup_distractor_task: Optional[str]
    warmup_distractor_fraction: float
    log_kl_to_start_of_rl: bool
    val_period: int
    val_num_prompts: int


@dataclass
class LossConfig:
    ratio_clip_min: float
    ratio_clip_max: float
    reference_policy_kl_penalty: float
    token_level_loss: bool


@dataclass
class MathEnvConfig:
    verify_timeout_s: float


@dataclass
class EnvConfig:
    name: str
    task: str
    min_digits: int
    max_digits: int
    math: MathEnvConfig


@dataclass
class DataConfig:
    train_data_path: Optional[str]
    val_data_path: Optional[str]
    prompt_key: str
    answer_key: str
    apply_chat_template: bool
    overlong_prompts: str


@dataclass
class ClusterConfig:
    num_nodes: int
    workers_per_node: int
    address: Optional[str]
    worker_python: str
    node_probe_timeout_s: float
    start_timeout_s: float
    cpus_per_worker: int
    gpus_per_worker: int


@dataclass
class WandbConfig:
    project: str
    mode: str


@dataclass
class LoggerConfig:
    log_dir: str
    run_name: Optional[str]
    console: bool
    tensorboard_enabled: bool
    wandb_enabled: bool
    wandb: WandbConfig


@dataclass
class CheckpointingConfig:
    enabled: bool
    checkpoint_dir: Optional[str]
    save_period: int
    keep_last: int


@dataclass
class MasterConfig:
    grpo: GRPOConfig
    loss_fn: LossConfig
    policy: PolicyConfig
    env: EnvConfig
    data: DataConfig
    cluster: ClusterConfig
    logger: LoggerConfig
    checkpointing: CheckpointingConfig


# Allowed values and ranges of keys, next to their types (config.checks.check_config checks them;
# the defaults stay in the exemplar). Allowed values of keys whose type admits more than the project runs:
CHOICES: dict[str, set] = {
    "policy.megatron_cfg.transformer_impl": {"auto", "local", "transformer_engine"},
    "policy.megatron_cfg.model_class": {"gpt", "hybrid"},
    "policy.megatron_cfg.params_dtype": {"float32", "bfloat16"},
    # None: an imported checkpoint's, which these choices cannot name.
    "policy.megatron_cfg.normalization": {"LayerNorm", "RMSNorm", None},
    "policy.megatron_cfg.activation": {"gelu", "swiglu", None},
    "policy.megatron_cfg.position_embedding_type": {"rope", "learned_absolute", None},
    "policy.megatron_cfg.recompute_granularity": {None, "full", "selective"},
    "policy.megatron_cfg.recompute_method": {None, "uniform", "block"},
    "policy.megatron_cfg.moe_router_load_balancing_type": {"global_batch_aux_loss", "aux_loss", "seq_aux_loss", "none"},
    "policy.megatron_cfg.moe_token_dispatcher_type": {"allgather", "alltoall"},
    "policy.generation.spec_verification": {"exact_match", "rejection_sampling"},
    "policy.mtp_loss_mask_policy": {"all_responses", "positive_advantage"},
    "policy.generation.draft_context": {"incremental", "sequence", "single_position"},
    "env.name": {"digits", "math"},
    "env.task": {"reverse", "sort", "count_up"},
    "data.overlong_prompts": {"skip", "truncate"},
    "grpo.warmup_distractor_task": {None, "reverse", "sort", "count_up"},
    "policy.megatron_cfg.mtp_loss_type": {"cross_entropy", "soft_cross_entropy", "total_variation"},
    "policy.megatron_cfg.mtp_zero_embedding_at_position_0": {"auto", True, False},
    "logger.wandb.mode": {"auto", "online", "offline"},
    "cluster.gpus_per_worker": {0, 1},
    "cluster.worker_python": {"driver", "uv"},
}


# Allowed ranges of numeric keys, checked before any rule that divides by one of them:
# key -> (lowest, whether the lowest is allowed, highest or None, whether the highest is allowed).
RANGES: dict[str, tuple] = {
    "grpo.num_prompts_per_step": (1, True, None, False),
    "grpo.num_generations_per_prompt": (2, True, None, False),
    "grpo.max_num_steps": (0, True, None, False),
    "grpo.warmup_imitation_steps": (0, True, None, False),
    "grpo.warmup_lr": (0.0, False, None, False),
    "grpo.warmup_distractor_fraction": (0.0, True, 1.0, True),
    "grpo.val_period": (1, True, None, False),
    "grpo.val_num_prompts": (1, True, None, False),
    "loss_fn.ratio_clip_min": (0.0, True, 1.0, False),
    "loss_fn.ratio_clip_max": (0.0, True, None, False),
    "loss_fn.reference_policy_kl_penalty": (0.0, True, None, False),
    "policy.train_global_batch_size": (1, True, None, False),
    "policy.train_micro_batch_size": (1, True, None, False),
    "policy.max_total_sequence_length": (2, True, None, False),
    "policy.megatron_cfg.tensor_model_parallel_size": (1, True, None, False),
    "policy.megatron_cfg.pipeline_model_parallel_size": (1, True, None, False),
    "policy.megatron_cfg.context_parallel_size": (1, True, None, False),
    "policy.megatron_cfg.num_layers": (1, True, None, False),
    "policy.megatron_cfg.hidden_size": (1, True, None, False),
    "policy.megatron_cfg.ffn_hidden_size": (1, True, None, False),
    "policy.megatron_cfg.num_attention_heads": (1, True, None, False),
    "policy.megatron_cfg.num_query_groups": (1, True, None, False),
    "policy.megatron_cfg.rotary_base": (1, True, None, False),
    "policy.megatron_cfg.mtp_num_layers": (0, True, None, False),
    "policy.megatron_cfg.hidden_dropout": (0.0, True, 1.0, False),
    "policy.megatron_cfg.attention_dropout": (0.0, True, 1.0, False),
    "policy.megatron_cfg.mtp_loss_scaling_factor": (0.0, True, None, False),
    "policy.megatron_cfg.num_moe_experts": (0, True, None, False),
    "policy.megatron_cfg.moe_router_topk": (1, True, None, False),
    "policy.megatron_cfg.moe_ffn_hidden_size": (1, True, None, False),
    "policy.megatron_cfg.moe_aux_loss_coeff": (0.0, True, None, False),
    "policy.megatron_cfg.optimizer.lr": (0.0, False, None, False),
    "policy.megatron_cfg.optimizer.weight_decay": (0.0, True, None, False),
    "policy.megatron_cfg.optimizer.adam_beta1": (0.0, True, 1.0, False),
    "policy.megatron_cfg.optimizer.adam_beta2": (0.0, True, 1.0, False),
    "policy.megatron_cfg.optimizer.adam_eps": (0.0, False, None, False),
    "policy.megatron_cfg.optimizer.clip_grad": (0.0, True, None, False),
    "env.min_digits": (1, True, None, False),
    "env.math.verify_timeout_s": (0.0, False, None, False),
    "cluster.num_nodes": (1, True, None, False),
    "cluster.workers_per_node": (1, True, None, False),
    "cluster.cpus_per_worker": (1, True, None, False),
    "cluster.node_probe_timeout_s": (0.0, False, None, False),
    "cluster.start_timeout_s": (0.0, False, None, False),
    "checkpointing.save_period": (1, True, None, False),
    "checkpointing.keep_last": (0, True, None, False),
    "policy.generation.temperature": (0.0, False, None, False),
    "policy.generation.top_p": (0.0, False, 1.0, True),
    "policy.generation.top_k": (0, True, None, False),
    "policy.generation.max_new_tokens": (1, True, None, False),
    "policy.generation.engine.block_size_tokens": (1, True, None, False),
    "policy.generation.engine.buffer_size_gb": (0.0, False, None, False),
    # null: megatron sizes them.
    "policy.generation.engine.max_requests": (1, True, None, False),
    "policy.generation.engine.max_tokens": (1, True, None, False),
}


# The model's architecture: set from megatron_cfg for a GPT built from scratch, read from the
# checkpoint for an imported one (policy.model_name), where setting one is an error.
ARCHITECTURE_KEYS = tuple(
    f"policy.megatron_cfg.{key}"
    for key in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "normalization",
        "activation", "position_embedding_type", "rotary_base", "share_embeddings_and_output_weights",
        "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
    )
)  # fmt: skip


# hybrid_layer_pattern's symbols (megatron-core's hybrid_layer_allocation.Symbols, those this
# project builds): layers, and the separators of pipeline stages and MTP depths.
HYBRID_LAYERS = {"*": "attention", "-": "MLP", "E": "mixture of experts", "M": "Mamba", "G": "GatedDeltaNet"}
HYBRID_GPU_ONLY_LAYERS = {"M": "Mamba (mamba_ssm, causal-conv1d)", "G": "GatedDeltaNet (fla)"}
HYBRID_PIPELINE_STAGE, HYBRID_MTP_DEPTH = "|", "/"


# policy.megatron_cfg.moe_router_load_balancing_type's own value (the others are megatron's):
# load statistics over the whole global batch (training.moe).
GLOBAL_BATCH_AUX_LOSS = "global_batch_aux_loss"
