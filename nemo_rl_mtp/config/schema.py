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
