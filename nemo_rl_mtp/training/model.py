"""Build a megatron-core GPTModel or HybridModel (``model_class``, with its MTP block), DDP wrapper
and optimizer from ``policy.megatron_cfg``: its architecture from the architecture keys (a model
built from scratch) or from a Hugging Face checkpoint (``policy.model_name``, through
megatron-bridge, weights loaded), its training settings from the config in both cases."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_rl_mtp.megatron_compat import mtp_position_zero
from nemo_rl_mtp.megatron_compat import shims
from nemo_rl_mtp.megatron_compat.capabilities import multi_latent_attention_refusal
from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
from nemo_rl_mtp.training import hf_checkpoint
from nemo_rl_mtp.training import hybrid
from nemo_rl_mtp.training import moe
from nemo_rl_mtp.training.hf_checkpoint import ModelArchitecture
from nemo_rl_mtp.training.packed_attention import PackedSequenceDotProductAttention

logger = logging.getLogger(__name__)

MTP_CONFIG_KEYS = ("mtp_num_layers", "mtp_loss_scaling_factor", "mtp_use_repeated_layer", "mtp_detach_heads")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class MegatronPolicyModel:
    """What a policy worker trains: the DDP-wrapped model, its optimizer and config."""

    model: DistributedDataParallel
    optimizer: MegatronOptimizer
    config: TransformerConfig
    transformer_impl: str
    # The tokenizer's vocabulary; the output layer may hold a few more (padding) ids.
    vocab_size: int
    # Once-per-policy warnings its training steps have given (train.py), so they are not repeated.
    warned: set = dataclasses.field(default_factory=set)


def initialize_model_parallel(megatron_cfg, rank: int, world_size: int, init_method: str) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU) and megatron's parallel groups."""
    cpu_runtime.install()
    if cpu_runtime.cuda_available():
        torch.cuda.set_device(torch.cuda.current_device())
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=cpu_runtime.distributed_backend(),
            init_method=init_method,
            rank=rank,
            world_size=world_size,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=megatron_cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=megatron_cfg.pipeline_model_parallel_size,
            context_parallel_size=megatron_cfg.context_parallel_size,
        )
    model_parallel_cuda_manual_seed(megatron_cfg.seed)


def build_transformer_config(megatron_cfg, architecture: Optional[ModelArchitecture] = None) -> TransformerConfig:
    """The architecture (``architecture`` of an imported checkpoint, else the config's keys) with
    this project's training settings on top."""
    config_kwargs = dict(architecture.config_fields) if architecture is not None else scratch_architecture(megatron_cfg)
    config_kwargs.update(training_settings(megatron_cfg))
    _apply_mtp_config(config_kwargs, megatron_cfg)
    config_kwargs.update(moe.moe_config_kwargs(megatron_cfg))
    if megatron_cfg.model_class == "hybrid":
        config_kwargs.update(hybrid.transformer_config_kwargs(megatron_cfg))
    config_class = architecture.config_class if architecture is not None else TransformerConfig
    return config_class(**config_kwargs)


def scratch_architecture(megatron_cfg) -> dict:
    """TransformerConfig fields of a GPT built from the config's architecture keys."""
    swiglu = megatron_cfg.activation == "swiglu"
    return dict(
        num_layers=megatron_cfg.num_layers,
        hidden_size=megatron_cfg.hidden_size,
        ffn_hidden_size=megatron_cfg.ffn_hidden_size,
        num_attention_heads=megatron_cfg.num_attention_heads,
        num_query_groups=megatron_cfg.num_query_groups,
        normalization=megatron_cfg.normalization,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=False,
    )


def training_settings(megatron_cfg) -> dict:
    """TransformerConfig fields this project sets whatever the architecture: parallel layout,
    dtype, no dropout, per-token loss normalisation, recompute, host-side initialisation on CPU."""
    dtype = _DTYPES[megatron_cfg.params_dtype]
    return dict(
        tensor_model_parallel_size=megatron_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=megatron_cfg.pipeline_model_parallel_size,
        context_parallel_size=megatron_cfg.context_parallel_size,
        sequence_parallel=megatron_cfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # RL: training logprobs should match the sampler's, so no dropout unless asked for.
        hidden_dropout=megatron_cfg.hidden_dropout,
        attention_dropout=megatron_cfg.attention_dropout,
        # Losses are token sums normalised by the global valid-token count (see train.py);
        # with this flag megatron neither averages over microbatches nor over DP ranks.
        calculate_per_token_loss=True,
        recompute_granularity=megatron_cfg.recompute_granularity,
        recompute_method=megatron_cfg.recompute_method,
        recompute_num_layers=megatron_cfg.recompute_num_layers,
        use_cpu_initialization=not cpu_runtime.cuda_available(),
        perform_initialization=True,
        fp16=False,
        autocast_dtype=dtype,
        **_UNFUSED_PATHS,
    )


# The unfused paths this project's training step is tested with, where a checkpoint's provider
# may ask for fused ones (each the TransformerConfig default, where the release has the field).
_UNFUSED_PATHS = {
    key: value
    for key, value in dict(
        cross_entropy_loss_fusion=False, masked_softmax_fusion=False, deallocate_pipeline_outputs=False, recompute_modules=["core_attn"],
        cuda_graph_modules=[],
    ).items()
    if key in {field.name for field in dataclasses.fields(TransformerConfig)}
}


def _apply_mtp_config(config_kwargs: dict, megatron_cfg) -> None:
    """Copy the MTP keys present in ``megatron_cfg`` onto the TransformerConfig arguments.

    With ``mtp_num_layers: 0`` (or absent) nothing is copied, so a non-MTP recipe builds exactly
    the model it would without MTP support. A key the installed release's TransformerConfig lacks
    is left out when it asks for nothing (false); asking for it is rejected earlier
    with the config (``capabilities.check_mtp_features_supported``, from ``grpo.checked_config``).
    """
    if "mtp_num_layers" not in megatron_cfg or not megatron_cfg["mtp_num_layers"]:
        if config_kwargs.get("mtp_num_layers"):  # an imported architecture with MTP layers, turned off
            config_kwargs["mtp_num_layers"] = None
        return
    supported = {field.name for field in dataclasses.fields(TransformerConfig)}
    for key in MTP_CONFIG_KEYS:
        if key not in megatron_cfg:
            continue
        if key in supported:
            config_kwargs[key] = megatron_cfg[key]
        else:
            logger.info("%s=%s left out: this megatron-core has no such field (same behaviour)", key, megatron_cfg[key])


def mtp_enabled(config: TransformerConfig) -> bool:
    return bool(config.mtp_num_layers)


def resolve_transformer_impl(requested: str) -> str:
    if requested != "auto":
        return requested
    if cpu_runtime.cuda_available() and _transformer_engine_importable():
        return "transformer_engine"
    return "local"


def _transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a TE build that cannot load its CUDA libraries
        return False
    return True


def build_layer_spec(transformer_impl: str, config: TransformerConfig):
    if transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=False,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
        )
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm, normalization=config.normalization
    )
    # The local spec's attention rejects packed sequences; ours handles them (see packed_attention).
    spec.submodules.self_attention.submodules.core_attention = PackedSequenceDotProductAttention
    return spec


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """Vocab rounded up so the output layer splits evenly over tensor-parallel ranks (logprobs and
    sampling mask the padding ids out)."""
    return -(-vocab_size // tensor_model_parallel_size) * tensor_model_parallel_size


def build_model(
    megatron_cfg,
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    architecture: Optional[ModelArchitecture] = None,
) -> tuple[DistributedDataParallel, str]:
    """The GPTModel or HybridModel (``model_class``), DDP-wrapped; an imported ``architecture``
    gives the output layer's size and the position-embedding arguments, else the config's keys do
    (``vocab_size`` padded to the tensor-parallel size)."""
    transformer_impl = resolve_transformer_impl(megatron_cfg.transformer_impl)
    if config.multi_latent_attention and transformer_impl != "transformer_engine":
        raise ValueError(
            multi_latent_attention_refusal(
                "policy.megatron_cfg.transformer_impl", megatron_cfg.transformer_impl, "this worker (no CUDA or no transformer_engine here)"
            )
        )
    layer_spec = build_layer_spec(transformer_impl, config)
    if architecture is not None:
        model_kwargs = dict(architecture.model_kwargs, vocab_size=architecture.padded_vocab_size)
    else:
        model_kwargs = dict(
            vocab_size=padded_vocab_size(vocab_size, config.tensor_model_parallel_size),
            share_embeddings_and_output_weights=megatron_cfg.share_embeddings_and_output_weights,
            position_embedding_type=megatron_cfg.position_embedding_type,
            rotary_base=megatron_cfg.rotary_base,
        )
    model_kwargs.update(
        max_sequence_length=max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    with cpu_runtime.device_scope():  # construction moves tied embeddings with .cuda() under PP
        if megatron_cfg.model_class == "hybrid":
            pattern = megatron_cfg.hybrid_layer_pattern
            stack_spec = hybrid.hybrid_stack_spec(transformer_impl, config, layer_spec, pattern)
            model = hybrid.build_hybrid_model(config, stack_spec, pattern, **model_kwargs)
        else:
            mtp_block_spec = None
            if mtp_enabled(config):
                mtp_block_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=transformer_impl == "transformer_engine")
            model = GPTModel(config=config, transformer_layer_spec=layer_spec, mtp_block_spec=mtp_block_spec, **model_kwargs)
    if cpu_runtime.cuda_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    with cpu_runtime.device_scope():
        ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    logger.info(
        "built %s (%s spec%s): %d parameters, MTP layers: %s, experts per MoE layer: %s",
        type(model).__name__,
        transformer_impl,
        f", layers {megatron_cfg.hybrid_layer_pattern!r}" if megatron_cfg.model_class == "hybrid" else "",
        sum(p.numel() for p in model.parameters()),
        config.mtp_num_layers or 0,
        config.num_moe_experts or "none (dense)",
    )
    return ddp_model, transformer_impl


def build_optimizer(model: DistributedDataParallel, megatron_cfg) -> MegatronOptimizer:
    optimizer_cfg = megatron_cfg.optimizer
    dtype = _DTYPES[megatron_cfg.params_dtype]
    config = OptimizerConfig(
        optimizer="adam",
        lr=optimizer_cfg.lr,
        weight_decay=optimizer_cfg.weight_decay,
        adam_beta1=optimizer_cfg.adam_beta1,
        adam_beta2=optimizer_cfg.adam_beta2,
        adam_eps=optimizer_cfg.adam_eps,
        clip_grad=optimizer_cfg.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=False,
    )
    with cpu_runtime.device_scope():
        return get_megatron_optimizer(config, [model])


def load_imported_weights(checkpoint, model: DistributedDataParallel, policy_cfg, config: TransformerConfig) -> None:
    """The checkpoint's weights; MTP layers it has none of keep megatron's initialisation (normal
    with the checkpoint's init_method_std, norms at 1), and the log says so."""
    new_mtp_layers = mtp_enabled(config) and hf_checkpoint.checkpoint_mtp_layers(checkpoint) == 0
    hf_checkpoint.load_hf_weights(checkpoint, model, new_mtp_layers)
    logger.info("loaded the weights of %s through megatron-bridge", policy_cfg.model_name)
    if new_mtp_layers:
        logger.info(
            "%s has no MTP weights: its %d MTP layer(s) are new, initialised by megatron-core (normal, std %g; norms 1)",
            policy_cfg.model_name,
            config.mtp_num_layers,
            config.init_method_std,
        )


def finalize_grads_of_prenormalised_loss(model, num_tokens=None, **kwargs) -> None:
    """megatron's finalize_model_grads without its division by the token count: our losses are
    already divided by the global valid-token count (train.py), so dividing again would be wrong."""
    finalize_model_grads(model, None, **kwargs)


def apply_serving_position_0_convention(model, megatron_cfg, checkpoint=None) -> bool:
    """``policy.megatron_cfg.mtp_zero_embedding_at_position_0`` resolved for the model's checkpoint
    (None: built from scratch) and applied to ``model`` (unwrapped), logged with why: whether its
    MTP layers zero their token embedding at position 0, as the engines that serve the export
    draft (training and the rollouts' drafts both follow the model's choice)."""
    architecture, model_type = hf_checkpoint.hf_architecture(checkpoint) if checkpoint is not None else (None, None)
    zero, reason = hf_checkpoint.mtp_position_0_zeroing(megatron_cfg.mtp_zero_embedding_at_position_0, architecture, model_type)
    if zero:
        mtp_position_zero.zero_embedding_at_position_0(model)
    logger.info("MTP token embedding at position 0: %s (%s)", "zeroed" if zero else "megatron's (not zeroed)", reason)
    return zero


def setup_megatron_policy(policy_cfg, vocab_size: int) -> MegatronPolicyModel:
    """Model, optimizer and the config hooks megatron's schedule reads during a step; with
    ``policy.model_name`` the checkpoint's architecture and weights (``vocab_size``: the
    tokenizer's, the ids the policy may sample)."""
    megatron_cfg = policy_cfg.megatron_cfg
    checkpoint = architecture = None
    if policy_cfg.model_name is not None:
        checkpoint = hf_checkpoint.open_checkpoint(policy_cfg.model_name, policy_cfg.trust_remote_code)
        architecture = hf_checkpoint.imported_architecture(checkpoint, megatron_cfg.tensor_model_parallel_size)
    config = build_transformer_config(megatron_cfg, architecture)
    if mtp_enabled(config):
        shims.apply_mtp_compat_shims()
    # Weights initialised on the CPU draw from torch's default generator: seed it, so every
    # data-parallel replica (and every rerun) starts from the same weights.
    torch.manual_seed(megatron_cfg.seed)
    model, transformer_impl = build_model(megatron_cfg, config, vocab_size, policy_cfg.max_total_sequence_length, architecture)
    if checkpoint is not None:
        load_imported_weights(checkpoint, model, policy_cfg, config)
    if mtp_enabled(config):
        shims.log_shim_coverage(model.module)
        apply_serving_position_0_convention(model.module, megatron_cfg, checkpoint)
    optimizer = build_optimizer(model, megatron_cfg)
    config.finalize_model_grads_func = finalize_grads_of_prenormalised_loss
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    return MegatronPolicyModel(
        model=model, optimizer=optimizer, config=config, transformer_impl=transformer_impl, vocab_size=vocab_size
    )

