"""Load, merge and validate configs.

Every config is the exemplar (``nemo_rl_mtp/config/grpo_mtp.yaml``, the one place defaults live;
package data, so an installed wheel has it) merged with a recipe (which may inherit from other
recipes with ``defaults:``) and then with ``key=value`` overrides. Keys are typed by :mod:`nemo_rl_mtp.config.schema`; an unknown key,
a wrong type or a value outside its allowed set raises :class:`ConfigError` naming the key.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Iterable, Optional, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_rl_mtp.config.schema import MasterConfig

# Read through importlib.resources: the package's own data, wherever (and however) it is installed.
EXEMPLAR_CONFIG = resources.files("nemo_rl_mtp") / "config" / "grpo_mtp.yaml"

_CHOICES = {
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
    "logger.wandb.mode": {"auto", "online", "offline"},
    "cluster.gpus_per_worker": {0, 1},
    "cluster.worker_python": {"driver", "uv"},
}


# Allowed ranges of numeric keys, checked before any rule that divides by one of them:
# key -> (lowest, whether the lowest is allowed, highest or None, whether the highest is allowed).
_RANGES = {
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


class ConfigError(ValueError):
    """A config that cannot run; the message names the offending key and value."""


def load_config(path: Optional[str | Path] = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Exemplar <- recipe at ``path`` (with its ``defaults:`` chain) <- ``overrides``."""
    layers = [("exemplar " + str(EXEMPLAR_CONFIG), load_exemplar())]
    if path is not None:
        layers.append((str(path), _load_yaml_with_defaults(Path(path))))
    if overrides:
        layers.append(("command-line overrides", _parse_overrides(overrides)))

    cfg = OmegaConf.structured(MasterConfig)
    for source, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as error:
            raise ConfigError(f"{source}: {_describe(error)}") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"keys without a value (add them to {EXEMPLAR_CONFIG}): {missing}")
    _defer_checkpoint_keys(cfg, set().union(*(_leaf_keys(layer) for _, layer in layers[1:])))
    validate_config(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def load_exemplar() -> DictConfig:
    """The exemplar's keys and defaults, unvalidated (a fresh object each call: callers may change it)."""
    return OmegaConf.create(EXEMPLAR_CONFIG.read_text(encoding="utf-8"))


def _defer_checkpoint_keys(cfg: DictConfig, set_keys: set[str]) -> None:
    """With ``policy.model_name``, refuse architecture keys set by a recipe or an override (the
    checkpoint has its own), and leave ``mtp_num_layers`` to the checkpoint (None until the
    driver resolves it) unless one set it."""
    if cfg.policy.model_name is None:
        return
    for key in ARCHITECTURE_KEYS:
        if key in set_keys:
            raise ConfigError(
                f"{key}={OmegaConf.select(cfg, key)!r}: the architecture comes from policy.model_name="
                f"{cfg.policy.model_name}; remove the key"
            )
    if "policy.megatron_cfg.mtp_num_layers" not in set_keys:
        cfg.policy.megatron_cfg.mtp_num_layers = None


def load_saved_config(path: str | Path) -> DictConfig:
    """A run's saved ``config.yaml`` (already resolved, every key set), over the exemplar for keys
    added since it was written; validated."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(MasterConfig), load_exemplar(), OmegaConf.load(path))
    except OmegaConfBaseException as error:
        raise ConfigError(f"{path}: {_describe(error)}") from None
    validate_config(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def resolve_checkpoint_keys(cfg: DictConfig, facts) -> DictConfig:
    """``cfg`` with its architecture keys and MTP layer count as the imported checkpoint has them
    (``facts``: ``hf_checkpoint.CheckpointFacts``), validated again; raises ConfigError where the
    config and the checkpoint disagree."""
    megatron = cfg.policy.megatron_cfg
    mtp_num_layers = megatron.mtp_num_layers
    if facts.mtp_num_layers and mtp_num_layers is not None and mtp_num_layers != facts.mtp_num_layers:
        raise ConfigError(
            f"policy.megatron_cfg.mtp_num_layers={mtp_num_layers}: {facts.model_name} has {facts.mtp_num_layers} MTP "
            f"layer(s) with weights; leave the key unset (or set it to {facts.mtp_num_layers})"
        )
    if mtp_num_layers is None:
        mtp_num_layers = facts.mtp_num_layers or load_exemplar().policy.megatron_cfg.mtp_num_layers
    _require(
        cfg.policy.max_total_sequence_length <= facts.max_position_embeddings,
        "policy.max_total_sequence_length",
        cfg.policy.max_total_sequence_length,
        f"exceeds the {facts.max_position_embeddings} positions {facts.model_name} was built for",
    )
    resolved = OmegaConf.merge(cfg, {"policy": {"megatron_cfg": {**facts.architecture_keys, "mtp_num_layers": mtp_num_layers}}})
    validate_config(resolved)
    OmegaConf.set_readonly(resolved, True)
    return resolved


def _leaf_keys(layer: DictConfig) -> set[str]:
    """Dotted keys of every leaf a config layer sets."""

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    return set(walk(OmegaConf.to_container(layer), ""))


def validate_config(cfg: DictConfig) -> None:
    """Checks across keys and on allowed values, run before any worker starts."""
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            shown = sorted(str(choice) for choice in allowed)
            raise ConfigError(f"{key}={value!r} is not one of {shown}")

    for key, bounds in _RANGES.items():
        _require_in_range(key, OmegaConf.select(cfg, key), *bounds)

    policy = cfg.policy
    megatron = policy.megatron_cfg
    if policy.model_name is None:
        for key in ARCHITECTURE_KEYS:
            _require(
                key.endswith("moe_ffn_hidden_size") or OmegaConf.select(cfg, key) is not None,
                key,
                None,
                "a model built from scratch needs it (null is only for policy.model_name's checkpoints)",
            )
    _require(
        policy.train_global_batch_size % policy.train_micro_batch_size == 0,
        "policy.train_global_batch_size",
        policy.train_global_batch_size,
        f"must be a multiple of policy.train_micro_batch_size={policy.train_micro_batch_size}",
    )
    _require(
        megatron.num_attention_heads % megatron.num_query_groups == 0,
        "policy.megatron_cfg.num_query_groups",
        megatron.num_query_groups,
        f"must divide num_attention_heads={megatron.num_attention_heads}",
    )
    _require(
        megatron.hidden_size % megatron.num_attention_heads == 0,
        "policy.megatron_cfg.hidden_size",
        megatron.hidden_size,
        f"must be a multiple of num_attention_heads={megatron.num_attention_heads}",
    )
    if megatron.recompute_granularity == "full":
        _require(
            megatron.recompute_method is not None and megatron.recompute_num_layers is not None,
            "policy.megatron_cfg.recompute_method",
            megatron.recompute_method,
            "recompute_granularity=full needs recompute_method and recompute_num_layers",
        )
    _require(
        not megatron.num_moe_experts or megatron.moe_router_topk <= megatron.num_moe_experts,
        "policy.megatron_cfg.moe_router_topk",
        megatron.moe_router_topk,
        f"must be at most num_moe_experts={megatron.num_moe_experts}",
    )
    _require(
        not megatron.sequence_parallel or megatron.tensor_model_parallel_size > 1,
        "policy.megatron_cfg.sequence_parallel",
        megatron.sequence_parallel,
        "needs tensor_model_parallel_size > 1",
    )
    _validate_hybrid_layer_pattern(cfg)
    _require(
        megatron.mtp_loss_type == "cross_entropy" or megatron.context_parallel_size == 1,
        "policy.megatron_cfg.mtp_loss_type",
        megatron.mtp_loss_type,
        "needs context_parallel_size=1 (the policy's prediction of a head's target may sit on another context-parallel rank)",
    )
    _require(
        not policy.mtp_frozen_during_rl or megatron.mtp_num_layers > 0,
        "policy.mtp_frozen_during_rl",
        policy.mtp_frozen_during_rl,
        "needs MTP heads (policy.megatron_cfg.mtp_num_layers > 0)",
    )
    if megatron.context_parallel_size > 1:
        _require(
            megatron.transformer_impl == "transformer_engine" and policy.sequence_packing.enabled,
            "policy.megatron_cfg.context_parallel_size",
            megatron.context_parallel_size,
            "context parallelism needs transformer_impl=transformer_engine and sequence_packing.enabled=true",
        )
    _validate_grpo(cfg)


def _validate_grpo(cfg: DictConfig) -> None:
    grpo, policy, env, cluster = cfg.grpo, cfg.policy, cfg.env, cfg.cluster
    megatron = policy.megatron_cfg
    world_size = cluster.num_nodes * cluster.workers_per_node
    model_parallel = (
        megatron.tensor_model_parallel_size * megatron.pipeline_model_parallel_size * megatron.context_parallel_size
    )
    _require(
        world_size % model_parallel == 0,
        "cluster.workers_per_node",
        cluster.workers_per_node,
        f"nodes x workers ({world_size}) must be a multiple of tensor x pipeline x context parallel ({model_parallel})",
    )
    data_parallel = world_size // model_parallel
    samples = grpo.num_prompts_per_step * grpo.num_generations_per_prompt
    _require(
        samples % policy.train_global_batch_size == 0,
        "policy.train_global_batch_size",
        policy.train_global_batch_size,
        f"must divide the samples per step (num_prompts_per_step x num_generations_per_prompt = {samples})",
    )
    _require(
        policy.train_global_batch_size % (policy.train_micro_batch_size * data_parallel) == 0,
        "policy.train_global_batch_size",
        policy.train_global_batch_size,
        f"must be a multiple of train_micro_batch_size x data-parallel size ({policy.train_micro_batch_size} x {data_parallel})",
    )
    _require(
        grpo.val_num_prompts % data_parallel == 0,
        "grpo.val_num_prompts",
        grpo.val_num_prompts,
        f"must split evenly over the {data_parallel} data-parallel ranks that generate",
    )
    _require(
        grpo.num_prompts_per_step % data_parallel == 0,
        "grpo.num_prompts_per_step",
        grpo.num_prompts_per_step,
        f"must split evenly over the {data_parallel} data-parallel ranks that generate",
    )
    _require(
        (grpo.warmup_distractor_task is None) == (grpo.warmup_distractor_fraction == 0.0),
        "grpo.warmup_distractor_fraction",
        grpo.warmup_distractor_fraction,
        f"must be > 0 exactly when grpo.warmup_distractor_task is set (it is {grpo.warmup_distractor_task!r})",
    )
    _validate_task(cfg)
    generation = policy.generation
    _require(
        generation.top_k == 0 or generation.top_p == 1.0,
        "policy.generation.top_k",
        generation.top_k,
        f"cannot be combined with top_p={generation.top_p} (megatron samples with one or the other)",
    )
    _require(
        generation.max_new_tokens < policy.max_total_sequence_length,
        "policy.generation.max_new_tokens",
        generation.max_new_tokens,
        f"leaves no room for a prompt in policy.max_total_sequence_length={policy.max_total_sequence_length}",
    )
    if policy.model_name is not None:
        _check_bridge_imports(policy.model_name)
    if megatron.mtp_num_layers is None:  # from the checkpoint: checked again once resolved
        return
    _validate_speculation(generation)
    _check_installed_release(policy)
    longest_sequence = policy.max_total_sequence_length
    if policy.model_name is None and env.name == "digits":
        longest_prompt = env.max_digits + 2  # <bos> digits =
        _require(
            longest_prompt + generation.max_new_tokens <= policy.max_total_sequence_length,
            "policy.max_total_sequence_length",
            policy.max_total_sequence_length,
            f"too short for the longest prompt ({longest_prompt} tokens) plus max_new_tokens={generation.max_new_tokens}",
        )
        longest_sequence = longest_prompt + generation.max_new_tokens
    _validate_mtp_depth(megatron.mtp_num_layers, longest_sequence)


# hybrid_layer_pattern's symbols (megatron-core's hybrid_layer_allocation.Symbols, those this
# project builds): layers, and the separators of pipeline stages and MTP depths.
HYBRID_LAYERS = {"*": "attention", "-": "MLP", "E": "mixture of experts", "M": "Mamba", "G": "GatedDeltaNet"}
HYBRID_GPU_ONLY_LAYERS = {"M": "Mamba (mamba_ssm, causal-conv1d)", "G": "GatedDeltaNet (fla)"}
HYBRID_PIPELINE_STAGE, HYBRID_MTP_DEPTH = "|", "/"


def _validate_hybrid_layer_pattern(cfg: DictConfig) -> None:
    """model_class and hybrid_layer_pattern: the pattern's symbols, its MTP depths against
    mtp_num_layers, its layers against num_layers, num_moe_experts and the pipeline stages, and
    layers that need CUDA kernels on CPU workers."""
    megatron = cfg.policy.megatron_cfg
    key, pattern = "policy.megatron_cfg.hybrid_layer_pattern", megatron.hybrid_layer_pattern
    if megatron.model_class == "gpt":
        _require(pattern is None, key, pattern, "only model_class=hybrid reads a layer pattern; set policy.megatron_cfg.model_class=hybrid or leave it null")
        return
    _require(
        cfg.policy.model_name is None,
        "policy.megatron_cfg.model_class",
        megatron.model_class,
        f"builds a model from hybrid_layer_pattern; policy.model_name={cfg.policy.model_name} brings its own architecture (leave model_class gpt)",
    )
    _require(pattern is not None, key, pattern, 'model_class=hybrid needs a layer pattern, e.g. "*-*-/*-"')
    unknown = sorted(set(pattern) - set(HYBRID_LAYERS) - {HYBRID_PIPELINE_STAGE, HYBRID_MTP_DEPTH})
    legend = ", ".join(f"{symbol} {name}" for symbol, name in HYBRID_LAYERS.items())
    _require(not unknown, key, pattern, f"{unknown} not layer symbols; use {legend}, | between pipeline stages, / before each MTP layer")
    decoder, *mtp_depths = pattern.split(HYBRID_MTP_DEPTH)
    stages = decoder.split(HYBRID_PIPELINE_STAGE)
    decoder_layers = "".join(stages)
    _require("*" in decoder_layers, key, pattern, "the decoder needs an attention layer (*): megatron-core's inference engine, which runs the rollouts, needs one")
    _require(
        len(mtp_depths) == megatron.mtp_num_layers,
        key,
        pattern,
        f"{len(mtp_depths)} MTP layer pattern(s) after '/', but policy.megatron_cfg.mtp_num_layers={megatron.mtp_num_layers}; "
        "give one '/<pattern>' per MTP layer",
    )
    _require(
        all(depth == mtp_depths[0] and depth and HYBRID_PIPELINE_STAGE not in depth for depth in mtp_depths),
        key,
        pattern,
        "every MTP layer needs the same non-empty pattern without '|' (megatron builds every depth from one pattern)",
    )
    _require(
        megatron.num_layers == len(decoder_layers),
        "policy.megatron_cfg.num_layers",
        megatron.num_layers,
        f"hybrid_layer_pattern={pattern!r} has {len(decoder_layers)} decoder layers; set num_layers={len(decoder_layers)}",
    )
    has_experts = "E" in pattern
    _require(has_experts or not megatron.num_moe_experts, "policy.megatron_cfg.num_moe_experts", megatron.num_moe_experts,
             f"model_class=hybrid puts experts in E layers only, and hybrid_layer_pattern={pattern!r} has none")  # fmt: skip
    _require(not has_experts or megatron.num_moe_experts, key, pattern, "E (mixture of experts) layers need policy.megatron_cfg.num_moe_experts > 0")
    _require(
        "E" not in decoder_layers or all("E" in depth for depth in mtp_depths),
        key,
        pattern,
        "with E layers in the decoder every MTP layer needs one too (megatron's router metrics count one MoE layer per MTP "
        "depth, as a GPTModel with experts has)",
    )
    pipeline = megatron.pipeline_model_parallel_size
    _require(
        len(stages) == pipeline and len({len(stage) for stage in stages}) == 1,
        key,
        pattern,
        f"has {len(stages)} pipeline stage(s) of {'+'.join(str(len(stage)) for stage in stages)} layers; "
        f"pipeline_model_parallel_size={pipeline} needs {pipeline} of equal length, separated by '|' (megatron's inference "
        "context gives every stage num_layers / stages layers)",
    )
    gpu_only = [name for symbol, name in HYBRID_GPU_ONLY_LAYERS.items() if symbol in pattern]
    _require(
        not gpu_only or (cfg.cluster.gpus_per_worker > 0 and megatron.transformer_impl != "local"),
        key,
        pattern,
        f"{' and '.join(gpu_only)} layers need CUDA kernels and transformer_engine, so GPU workers (cluster.gpus_per_worker=1, "
        "transformer_impl auto or transformer_engine); on the CPU use *, - and E layers",
    )


def _validate_task(cfg: DictConfig) -> None:
    """The environment, where its prompts come from, and the tokenizer it needs."""
    env, data, grpo = cfg.env, cfg.data, cfg.grpo
    if env.name == "digits":
        for key in ("train_data_path", "val_data_path"):
            _require(data[key] is None, f"data.{key}", data[key], "the digits environment makes its own prompts; leave it unset")
        _require(env.min_digits <= env.max_digits, "env.min_digits", env.min_digits, f"must be <= env.max_digits={env.max_digits}")
        prompt_space = sum(10**length for length in range(env.min_digits, env.max_digits + 1))
        _require(
            grpo.val_num_prompts <= prompt_space // 4,
            "grpo.val_num_prompts",
            grpo.val_num_prompts,
            f"must hold out at most a quarter of the task's {prompt_space} prompts (env.min_digits..max_digits)",
        )
        _require(
            grpo.warmup_distractor_task != env.task,
            "grpo.warmup_distractor_task",
            grpo.warmup_distractor_task,
            f"must differ from env.task={env.task!r}",
        )
        return
    _require(
        grpo.warmup_distractor_task is None,
        "grpo.warmup_distractor_task",
        grpo.warmup_distractor_task,
        f"distractor demonstrations are digit tasks' answers; env.name={env.name} has none",
    )
    _require(
        cfg.policy.model_name is not None,
        "env.name",
        env.name,
        "judges text, which needs a tokenizer: set policy.model_name to a Hugging Face checkpoint",
    )
    for key in ("train_data_path", "val_data_path"):
        _require(data[key] is not None, f"data.{key}", data[key], f"env.name={env.name} takes its prompts from JSONL files; set it")


def _validate_mtp_depth(mtp_num_layers: int, longest_sequence: int) -> None:
    """MTP depth k at position t predicts the token k + 1 places ahead, so it has a target only
    where a response token sits at a position p >= k; p is at most longest_sequence - 2."""
    deepest = longest_sequence - 2
    _require(
        mtp_num_layers <= deepest,
        "policy.megatron_cfg.mtp_num_layers",
        mtp_num_layers,
        f"sequences here are at most {longest_sequence} tokens (longest prompt + max_new_tokens), so MTP layers "
        f"{deepest + 1}-{mtp_num_layers} would never get a target; use at most {deepest}",
    )


def _validate_speculation(generation) -> None:
    """The key's form; how many drafts the model and the installed engine allow is
    ``speculation.check_speculation_supported``'s (``_check_installed_release``)."""
    k = generation.num_speculative_tokens
    _require(
        k == "auto" or (isinstance(k, int) and k >= 0),
        "policy.generation.num_speculative_tokens",
        k,
        "must be an integer >= 0 or auto",
    )


def _check_installed_release(policy) -> None:
    """What the config asks of the installed megatron-core (MTP features, MTP loss types, the
    MoE loss normalisation, HybridModel, speculation): checked here, once per config, so every entry
    point (the GRPO driver, benchmarks, tests) refuses it in one line before any model is built."""
    from nemo_rl_mtp.rollout.speculation import check_speculation_supported
    from nemo_rl_mtp.megatron_compat.shims import check_mtp_features_supported
    from nemo_rl_mtp.training.hybrid import check_hybrid_supported
    from nemo_rl_mtp.training.moe import check_moe_supported

    try:
        check_mtp_features_supported(policy.megatron_cfg)
        check_moe_supported(policy.megatron_cfg)
        if policy.megatron_cfg.model_class == "hybrid":
            check_hybrid_supported()
        check_speculation_supported(policy.generation, policy.megatron_cfg)
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_bridge_imports(model_name: str) -> None:
    """An imported checkpoint goes through megatron-bridge, which does not import on every
    megatron-core release: refused in one line here rather than when the driver opens it."""
    from nemo_rl_mtp.megatron_compat.megatron_bridge import bridge_unavailable

    reason = bridge_unavailable()
    if reason is not None:
        raise ConfigError(f"policy.model_name={model_name}: {reason}; build the model from scratch (policy.model_name=null) or use megatron-core >= 0.18")


def _require_in_range(key: str, value, lowest, lowest_allowed: bool, highest, highest_allowed: bool) -> None:
    if value is None:  # an optional key left unset
        return
    above = value >= lowest if lowest_allowed else value > lowest
    below = highest is None or (value <= highest if highest_allowed else value < highest)
    if not (above and below):
        opening, closing = "[" if lowest_allowed else "(", "]" if highest_allowed else ")"
        shown = f"{opening}{lowest}, {'inf' if highest is None else highest}{closing}"
        raise ConfigError(f"{key}={value!r}: must be in {shown}")


def _require(condition: bool, key: str, value, reason: str) -> None:
    if not condition:
        raise ConfigError(f"{key}={value!r}: {reason}")


def _load_yaml_with_defaults(path: Path, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """A YAML file merged over the files its ``defaults:`` key names (relative to it). The bare name
    of the exemplar (``defaults: grpo_mtp.yaml``) names the packaged exemplar wherever the recipe
    lives; it is skipped here because the exemplar is always the base layer."""
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path in _seen:
        raise ConfigError(f"defaults cycle: {' -> '.join(map(str, _seen + (path,)))}")
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"{path}: not valid YAML{line}: {getattr(error, 'problem', None) or error}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: top level must be a mapping")
    parents = raw.pop("defaults", None)
    if parents is None:
        return raw
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, (list, ListConfig)):
        raise ConfigError(f"{path}: defaults must be a file name or a list of them, got {parents!r}")
    merged = OmegaConf.create()
    for parent in parents:
        if str(parent) == EXEMPLAR_CONFIG.name:
            continue  # the exemplar is always the base layer
        parent_path = (path.parent / str(parent)).resolve()
        merged = OmegaConf.merge(merged, _load_yaml_with_defaults(parent_path, _seen + (path,)))
    return OmegaConf.merge(merged, raw)


def _parse_overrides(overrides: Iterable[str]) -> DictConfig:
    for override in overrides:
        if "=" not in override or override.startswith("="):
            raise ConfigError(f"override {override!r} is not of the form key=value")
    for override in overrides:  # one at a time, to name the one that is not YAML
        try:
            yaml.safe_load(override.split("=", 1)[1])
        except yaml.YAMLError as error:
            raise ConfigError(
                f"override {override!r}: its value is not YAML ({getattr(error, 'problem', None) or error}); quote it, "
                f"e.g. {override.split('=', 1)[0]}='\"{override.split('=', 1)[1]}\"'"
            ) from None
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as error:
        raise ConfigError(f"command-line overrides: {_describe(error)}") from None


def _describe(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None)
    message = str(error).splitlines()[0]
    return f"{key}: {message}" if key else message
