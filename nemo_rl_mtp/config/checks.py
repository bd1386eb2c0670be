"""Every rule across config keys that needs nothing but the config: pure (no torch, no megatron,
no file beyond the config), so a bad config is refused in about a second, before anything heavy is
imported and before any worker starts.

Two further stages check a config after these (``grpo.checked_config`` runs all three, in order):
the task's own rules (``tasks.config_checks``) and what the installed megatron-core and
megatron-bridge can do (``megatron_compat.capabilities``). Each refusal is one
:class:`ConfigError` line naming the key and its value.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from nemo_rl_mtp.config.schema import (
    ARCHITECTURE_KEYS,
    CHOICES,
    HYBRID_GPU_ONLY_LAYERS,
    HYBRID_LAYERS,
    HYBRID_MTP_DEPTH,
    HYBRID_PIPELINE_STAGE,
    RANGES,
)


class ConfigError(ValueError):
    """A config that cannot run; the message names the offending key and value."""


def check_config(cfg: DictConfig) -> None:
    """Allowed values, ranges and the rules across keys that hold for every task and every
    megatron-core release; run by every load (``load.load_config``). Allowed values first: the
    rules after them divide by some of those keys."""
    _check_allowed_values(cfg)
    _check_model(cfg)
    _check_grpo(cfg)


def _check_allowed_values(cfg: DictConfig) -> None:
    """Each key of ``schema.CHOICES`` among its choices, each of ``schema.RANGES`` in its range."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            shown = sorted(str(choice) for choice in allowed)
            raise ConfigError(f"{key}={value!r} is not one of {shown}")
    for key, bounds in RANGES.items():
        _require_in_range(key, OmegaConf.select(cfg, key), *bounds)


def _check_model(cfg: DictConfig) -> None:
    """The model's keys against each other: architecture, parallelism, recompute, MoE, hybrid
    layers, MTP loss and frozen heads."""
    policy = cfg.policy
    megatron = policy.megatron_cfg
    if policy.model_name is None:
        for key in ARCHITECTURE_KEYS:
            require(
                key.endswith("moe_ffn_hidden_size") or OmegaConf.select(cfg, key) is not None,
                key,
                None,
                "a model built from scratch needs it (null is only for policy.model_name's checkpoints)",
            )
    require(
        policy.train_global_batch_size % policy.train_micro_batch_size == 0,
        "policy.train_global_batch_size",
        policy.train_global_batch_size,
        f"must be a multiple of policy.train_micro_batch_size={policy.train_micro_batch_size}",
    )
    require(
        megatron.num_attention_heads % megatron.num_query_groups == 0,
        "policy.megatron_cfg.num_query_groups",
        megatron.num_query_groups,
        f"must divide num_attention_heads={megatron.num_attention_heads}",
    )
    require(
        megatron.hidden_size % megatron.num_attention_heads == 0,
        "policy.megatron_cfg.hidden_size",
        megatron.hidden_size,
        f"must be a multiple of num_attention_heads={megatron.num_attention_heads}",
    )
    if megatron.recompute_granularity == "full":
        require(
            megatron.recompute_method is not None and megatron.recompute_num_layers is not None,
            "policy.megatron_cfg.recompute_method",
            megatron.recompute_method,
            "recompute_granularity=full needs recompute_method and recompute_num_layers",
        )
    require(
        not megatron.num_moe_experts or megatron.moe_router_topk <= megatron.num_moe_experts,
        "policy.megatron_cfg.moe_router_topk",
        megatron.moe_router_topk,
        f"must be at most num_moe_experts={megatron.num_moe_experts}",
    )
    require(
        not megatron.sequence_parallel or megatron.tensor_model_parallel_size > 1,
        "policy.megatron_cfg.sequence_parallel",
        megatron.sequence_parallel,
        "needs tensor_model_parallel_size > 1",
    )
    _check_hybrid_layer_pattern(cfg)
    require(
        megatron.mtp_loss_type == "cross_entropy" or megatron.context_parallel_size == 1,
        "policy.megatron_cfg.mtp_loss_type",
        megatron.mtp_loss_type,
        "needs context_parallel_size=1 (the policy's prediction of a head's target may sit on another context-parallel rank)",
    )
    require(
        not policy.mtp_frozen_during_rl or megatron.mtp_num_layers > 0,
        "policy.mtp_frozen_during_rl",
        policy.mtp_frozen_during_rl,
        "needs MTP heads (policy.megatron_cfg.mtp_num_layers > 0)",
    )
    if megatron.context_parallel_size > 1:
        require(
            megatron.transformer_impl == "transformer_engine" and policy.sequence_packing.enabled,
            "policy.megatron_cfg.context_parallel_size",
            megatron.context_parallel_size,
            "context parallelism needs transformer_impl=transformer_engine and sequence_packing.enabled=true",
        )


def _check_grpo(cfg: DictConfig) -> None:
    """The step against the cluster (data-parallel splits), warmup distractors, sampling and
    speculation."""
    grpo, policy, cluster = cfg.grpo, cfg.policy, cfg.cluster
    megatron = policy.megatron_cfg
    world_size = cluster.num_nodes * cluster.workers_per_node
    model_parallel = (
        megatron.tensor_model_parallel_size * megatron.pipeline_model_parallel_size * megatron.context_parallel_size
    )
    require(
        world_size % model_parallel == 0,
        "cluster.workers_per_node",
        cluster.workers_per_node,
        f"nodes x workers ({world_size}) must be a multiple of tensor x pipeline x context parallel ({model_parallel})",
    )
    data_parallel = world_size // model_parallel
    samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    require(
        samples % policy.train_global_batch_size == 0,
        "policy.train_global_batch_size",
        policy.train_global_batch_size,
        f"must divide the samples per step (num_prompts_per_step x num_generations_per_prompt = {samples})",
    )
    require(
        policy.train_global_batch_size % (policy.train_micro_batch_size * data_parallel) == 0,
        "policy.train_global_batch_size",
        policy.train_global_batch_size,
        f"must be a multiple of train_micro_batch_size x data-parallel size ({policy.train_micro_batch_size} x {data_parallel})",
    )
    require(
        grpo.val_num_prompts % data_parallel == 0,
        "grpo.val_num_prompts",
        grpo.val_num_prompts,
        f"must split evenly over the {data_parallel} data-parallel ranks that generate",
    )
    require(
        grpo.num_prompts_per_step % data_parallel == 0,
        "grpo.num_prompts_per_step",
        grpo.num_prompts_per_step,
        f"must split evenly over the {data_parallel} data-parallel ranks that generate",
    )
    require(
        (grpo.warmup_distractor_task is None) == (grpo.warmup_distractor_fraction == 0.0),
        "grpo.warmup_distractor_fraction",
        grpo.warmup_distractor_fraction,
        f"must be > 0 exactly when grpo.warmup_distractor_task is set (it is {grpo.warmup_distractor_task!r})",
    )
    generation = policy.generation
    require(
        generation.top_k == 0 or generation.top_p == 1.0,
        "policy.generation.top_k",
        generation.top_k,
        f"cannot be combined with top_p={generation.top_p} (megatron samples with one or the other)",
    )
    require(
        generation.max_new_tokens < policy.max_total_sequence_length,
        "policy.generation.max_new_tokens",
        generation.max_new_tokens,
        f"leaves no room for a prompt in policy.max_total_sequence_length={policy.max_total_sequence_length}",
    )
    _check_speculation_key(generation)
    if megatron.mtp_num_layers is None:  # from the checkpoint: checked again once resolved
        return
    check_speculation_depth(generation, megatron)


@dataclass(frozen=True)
class HybridPattern:
    """``hybrid_layer_pattern`` split as megatron-core splits it: the decoder's pipeline stages
    (layer symbols, ``|`` removed) and one pattern per MTP depth (after each ``/``)."""

    stages: tuple[str, ...]
    mtp_depths: tuple[str, ...]

    @property
    def decoder_layers(self) -> str:
        """The decoder's layer symbols, pipeline stages joined."""
        return "".join(self.stages)


def split_hybrid_pattern(pattern: str) -> HybridPattern:
    """The one split of a layer pattern (``"*-|*-/*-"``): the checks below and the model builder
    (``training.hybrid``) both read it, so they cannot disagree on what a pattern means."""
    decoder, *mtp_depths = pattern.split(HYBRID_MTP_DEPTH)
    return HybridPattern(tuple(decoder.split(HYBRID_PIPELINE_STAGE)), tuple(mtp_depths))


def _check_hybrid_layer_pattern(cfg: DictConfig) -> None:
    """model_class and hybrid_layer_pattern: the pattern's symbols, its MTP depths against
    mtp_num_layers, its layers against num_layers, num_moe_experts and the pipeline stages, and
    layers that need CUDA kernels on CPU workers."""
    megatron = cfg.policy.megatron_cfg
    key, pattern = "policy.megatron_cfg.hybrid_layer_pattern", megatron.hybrid_layer_pattern
    if megatron.model_class == "gpt":
        require(pattern is None, key, pattern, "only model_class=hybrid reads a layer pattern; set policy.megatron_cfg.model_class=hybrid or leave it null")
        return
    require(
        cfg.policy.model_name is None,
        "policy.megatron_cfg.model_class",
        megatron.model_class,
        f"builds a model from hybrid_layer_pattern; policy.model_name={cfg.policy.model_name} brings its own architecture (leave model_class gpt)",
    )
    require(pattern is not None, key, pattern, 'model_class=hybrid needs a layer pattern, e.g. "*-*-/*-"')
    unknown = sorted(set(pattern) - set(HYBRID_LAYERS) - {HYBRID_PIPELINE_STAGE, HYBRID_MTP_DEPTH})
    legend = ", ".join(f"{symbol} {name}" for symbol, name in HYBRID_LAYERS.items())
    require(not unknown, key, pattern, f"{unknown} not layer symbols; use {legend}, | between pipeline stages, / before each MTP layer")
    split = split_hybrid_pattern(pattern)
    stages, mtp_depths, decoder_layers = split.stages, split.mtp_depths, split.decoder_layers
    require("*" in decoder_layers, key, pattern, "the decoder needs an attention layer (*): megatron-core's inference engine, which runs the rollouts, needs one")
    require(
        len(mtp_depths) == megatron.mtp_num_layers,
        key,
        pattern,
        f"{len(mtp_depths)} MTP layer pattern(s) after '/', but policy.megatron_cfg.mtp_num_layers={megatron.mtp_num_layers}; "
        "give one '/<pattern>' per MTP layer",
    )
    require(
        all(depth == mtp_depths[0] and depth and HYBRID_PIPELINE_STAGE not in depth for depth in mtp_depths),
        key,
        pattern,
        "every MTP layer needs the same non-empty pattern without '|' (megatron builds every depth from one pattern)",
    )
    require(
        megatron.num_layers == len(decoder_layers),
        "policy.megatron_cfg.num_layers",
        megatron.num_layers,
        f"hybrid_layer_pattern={pattern!r} has {len(decoder_layers)} decoder layers; set num_layers={len(decoder_layers)}",
    )
    has_experts = "E" in pattern
    require(has_experts or not megatron.num_moe_experts, "policy.megatron_cfg.num_moe_experts", megatron.num_moe_experts,
             f"model_class=hybrid puts experts in E layers only, and hybrid_layer_pattern={pattern!r} has none")  # fmt: skip
    require(not has_experts or megatron.num_moe_experts, key, pattern, "E (mixture of experts) layers need policy.megatron_cfg.num_moe_experts > 0")
    require(
        "E" not in decoder_layers or all("E" in depth for depth in mtp_depths),
        key,
        pattern,
        "with E layers in the decoder every MTP layer needs one too (megatron's router metrics count one MoE layer per MTP "
        "depth, as a GPTModel with experts has)",
    )
    pipeline = megatron.pipeline_model_parallel_size
    require(
        len(stages) == pipeline and len({len(stage) for stage in stages}) == 1,
        key,
        pattern,
        f"has {len(stages)} pipeline stage(s) of {'+'.join(str(len(stage)) for stage in stages)} layers; "
        f"pipeline_model_parallel_size={pipeline} needs {pipeline} of equal length, separated by '|' (megatron's inference "
        "context gives every stage num_layers / stages layers)",
    )
    gpu_only = [name for symbol, name in HYBRID_GPU_ONLY_LAYERS.items() if symbol in pattern]
    require(
        not gpu_only or (cfg.cluster.gpus_per_worker > 0 and megatron.transformer_impl != "local"),
        key,
        pattern,
        f"{' and '.join(gpu_only)} layers need CUDA kernels and transformer_engine, so GPU workers (cluster.gpus_per_worker=1, "
        "transformer_impl auto or transformer_engine); on the CPU use *, - and E layers",
    )


def check_mtp_depth(mtp_num_layers: int, longest_sequence: int) -> None:
    """MTP depth k at position t predicts the token k + 1 places ahead, so it has a target only
    where a response token sits at a position p >= k; p is at most longest_sequence - 2. Called by
    the task's checks (``tasks.config_checks``): how long a sequence can be is the task's to say."""
    deepest = longest_sequence - 2
    require(
        mtp_num_layers <= deepest,
        "policy.megatron_cfg.mtp_num_layers",
        mtp_num_layers,
        f"sequences here are at most {longest_sequence} tokens (longest prompt + max_new_tokens), so MTP layers "
        f"{deepest + 1}-{mtp_num_layers} would never get a target; use at most {deepest}",
    )


def _check_speculation_key(generation) -> None:
    """The key's form: an integer >= 0 or ``auto``."""
    k = generation.num_speculative_tokens
    require(
        k == "auto" or (isinstance(k, int) and k >= 0),
        "policy.generation.num_speculative_tokens",
        k,
        "must be an integer >= 0 or auto",
    )


def speculative_tokens_limit(megatron_cfg) -> int | None:
    """The most drafts per step the model's MTP heads can propose: one per MTP layer, unlimited
    (None) for a repeated MTP layer, which drafts a depth per token. Whether the installed engine
    speculates at all, and how far with a repeated layer, is the release's
    (``megatron_compat.capabilities``)."""
    if megatron_cfg.mtp_num_layers and megatron_cfg.mtp_use_repeated_layer:
        return None
    return megatron_cfg.mtp_num_layers


def check_speculation_depth(generation_cfg, megatron_cfg) -> None:
    """Raise ConfigError, one line naming the key, for more drafts per step than the model's heads
    can propose (``auto`` chooses within what the model allows). Pure: the same on every release."""
    k = generation_cfg.num_speculative_tokens
    if k == "auto" or k <= 0:
        return
    if not megatron_cfg.mtp_num_layers:
        raise ConfigError(
            f"policy.generation.num_speculative_tokens={k}: the model has no MTP heads to draft with; set "
            "policy.megatron_cfg.mtp_num_layers > 0 or num_speculative_tokens=0"
        )
    limit = speculative_tokens_limit(megatron_cfg)
    if limit is not None and k > limit:
        raise ConfigError(
            f"policy.generation.num_speculative_tokens={k}: this model's MTP heads can propose at most {limit} "
            f"draft(s) per step (policy.megatron_cfg.mtp_num_layers={megatron_cfg.mtp_num_layers}, "
            f"mtp_use_repeated_layer={megatron_cfg.mtp_use_repeated_layer}); lower it or add MTP layers"
        )


def _require_in_range(key: str, value, lowest, lowest_allowed: bool, highest, highest_allowed: bool) -> None:
    if value is None:  # an optional key left unset
        return
    above = value >= lowest if lowest_allowed else value > lowest
    below = highest is None or (value <= highest if highest_allowed else value < highest)
    if not (above and below):
        opening, closing = "[" if lowest_allowed else "(", "]" if highest_allowed else ")"
        shown = f"{opening}{lowest}, {'inf' if highest is None else highest}{closing}"
        raise ConfigError(f"{key}={value!r}: must be in {shown}")


def require(condition: bool, key: str, value, reason: str) -> None:
    """Raise ConfigError ``key=value: reason`` unless ``condition`` (for the checks of other rooms too)."""
    if not condition:
        raise ConfigError(f"{key}={value!r}: {reason}")


