"""The inference engine of the installed megatron-core release: how it is assembled, and what it
can do for our rollouts.

megatron-core's ``DynamicInferenceEngine`` changed shape across the releases this project runs on:

- 0.17 on: sized by an ``InferenceConfig`` (``megatron.core.inference.config``), whose
  ``num_speculative_tokens`` turns on speculative decoding with the model's MTP heads; the context
  takes the model's config and it, the engine the controller and the context.
- 0.16: no ``InferenceConfig``. The context takes its sizes as keywords (``params_dtype``,
  ``num_layers``, ...), the inference wrapper an ``InferenceWrapperConfig``, the engine a
  ``random_seed``; there is no speculative decoding.

Which shape is installed is probed (a module, a dataclass field, constructor parameters), never
read off a version string. What a configuration asks of the engine and the installed release does
not have is refused before any worker starts, in one line naming the release and what it lacks
(:func:`unsupported_generation`); the private names the speculation path reaches are probed when
an engine is built (:mod:`engine_probes`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging

logger = logging.getLogger(__name__)


class TokenIdsAsText:
    """The engine detokenizes every finished request; rollouts are token ids, so their text is
    just the ids (which keeps the engine independent of the task's tokenizer)."""

    def detokenize(self, token_ids, **kwargs) -> str:
        return " ".join(str(token) for token in token_ids)


def megatron_release() -> str:
    from nemo_rl_mtp.megatron_compat.installed import megatron_core_version

    return f"megatron-core {megatron_core_version()}"


def inference_config_class():
    """megatron's ``InferenceConfig`` (0.17 on), or None where the engine is sized by keywords."""
    try:
        module = importlib.import_module("megatron.core.inference.config")
    except ModuleNotFoundError:
        return None
    return getattr(module, "InferenceConfig", None)


def speculation_missing() -> str | None:
    """What the installed engine lacks for speculative decoding (None: it has it)."""
    config = inference_config_class()
    if config is None:
        return "its DynamicInferenceEngine has no speculative decoding (no megatron.core.inference.config.InferenceConfig)"
    if "num_speculative_tokens" not in {field.name for field in dataclasses.fields(config)}:
        return "its DynamicInferenceEngine has no speculative decoding (no InferenceConfig.num_speculative_tokens)"
    return None


def repeated_layer_depths_missing() -> str | None:
    """What the installed controller lacks to draft more tokens than a repeated MTP layer has
    depths (None: it has it). megatron-core 0.19's controller runs one draft depth per speculative
    token with a repeated layer (``num_mtp_depths``); 0.17 and 0.18 run ``min(k, mtp_num_layers)``
    depths and leave the other drafts unwritten."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    if "num_mtp_depths" in attributes_set_by(TextGenerationController):
        return None
    return "its controller drafts at most mtp_num_layers tokens per step with a repeated MTP layer (no num_mtp_depths)"


def attributes_set_by(cls: type) -> set[str]:
    """Names of the attributes ``cls``'s methods read or assign on any object (their bytecode's
    ``co_names``): what an instance of ``cls`` can carry, without building one. A method a compat
    shim wrapped counts with the original it wraps (``original``, or ``__wrapped__``)."""
    names = set()
    for _, function in inspect.getmembers(cls, inspect.isfunction):
        while function is not None:
            names |= set(function.__code__.co_names)
            function = getattr(function, "original", None) or getattr(function, "__wrapped__", None)
    return names


def unsupported_generation(generation_cfg, megatron_cfg) -> str | None:
    """One line naming the key, the release and what it lacks, for a generation config the
    installed engine cannot run (None: it can). Checked before any worker starts. ``auto`` on an
    engine without speculative decoding is no error: it chooses 0 (:func:`auto_without_speculation`)."""
    k = generation_cfg.num_speculative_tokens
    if k == 0:
        return None
    if k == "auto":
        if auto_without_speculation(generation_cfg):
            logger.info("policy.generation.num_speculative_tokens=auto: %s: %s; auto chooses 0", megatron_release(), speculation_missing())
        return None
    return unsupported_speculation(k, megatron_cfg)


def auto_without_speculation(generation_cfg) -> bool:
    """Whether ``num_speculative_tokens: auto`` meets an engine without speculative decoding."""
    return generation_cfg.num_speculative_tokens == "auto" and speculation_missing() is not None


def unsupported_speculation(k: int, megatron_cfg) -> str | None:
    """One line naming the release and what it lacks for ``k`` > 0 drafts per step (None: fine)."""
    missing = speculation_missing()
    if missing is not None:
        return f"policy.generation.num_speculative_tokens={k}: {megatron_release()}: {missing}; set policy.generation.num_speculative_tokens=0"
    if megatron_cfg.mtp_use_repeated_layer and k > megatron_cfg.mtp_num_layers:
        missing = repeated_layer_depths_missing()
        if missing is not None:
            return (
                f"policy.generation.num_speculative_tokens={k}: {megatron_release()}: {missing}; set it to at most "
                f"policy.megatron_cfg.mtp_num_layers={megatron_cfg.mtp_num_layers}"
            )
    return None


def assemble(
    model, controller_class: type, engine_class: type, sizing, max_sequence_length: int, num_speculative_tokens: int, buffer_size_gb: float,
    mamba_state: dict,
):  # fmt: skip
    """Context (paged KV cache), inference wrapper, controller and engine around ``model``, as the
    installed release assembles them (module docstring). ``sizing``: ``policy.generation.engine``;
    ``mamba_state``: the ``InferenceConfig`` arguments of a HybridModel's Mamba layers (``{}``
    without; releases whose engine is sized by keywords have no hybrid models)."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper


    config_class = inference_config_class()
    if config_class is None:
        return _assemble_keyword_sized(model, controller_class, engine_class, sizing, max_sequence_length, buffer_size_gb)
    options = {}
    if num_speculative_tokens and _verification_gathers_its_rows():
        # 0.17's controller picks the verification rows out of every position's logits.
        options["materialize_only_last_token_logits"] = False
    inference_config = config_class(
        block_size_tokens=sizing.block_size_tokens,
        buffer_size_gb=buffer_size_gb,
        max_requests=sizing.max_requests,
        max_tokens=sizing.max_tokens,
        max_sequence_length=max_sequence_length,
        num_speculative_tokens=num_speculative_tokens,
        **options,
        **mamba_state,
    )
    context = DynamicInferenceContext(model.config, inference_config)
    controller = controller_class(GPTInferenceWrapper(model, context), tokenizer=TokenIdsAsText())
    return engine_class(controller=controller, context=context)


def _verification_gathers_its_rows() -> bool:
    """Whether the controller's verification step takes the whole logits tensor and gathers the
    rows it verifies itself (0.17), which needs every position's logits materialised."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    method = getattr(TextGenerationController, "_dynamic_step_sample_logits_and_verify_tokens", None)
    return method is not None and "logits" in inspect.signature(method).parameters


def _assemble_keyword_sized(model, controller_class: type, engine_class: type, sizing, max_sequence_length: int, buffer_size_gb: float):
    """megatron-core 0.16's assembly: the context sized by keywords (as its own
    ``DynamicInferenceContext.from_config`` sizes it from a model), the wrapper configured by an
    ``InferenceWrapperConfig``, the engine seeded with ``random_seed`` (reseeded per rollout)."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig


    parameters = inspect.signature(DynamicInferenceContext.__init__).parameters
    if "params_dtype" not in parameters:
        raise RuntimeError(
            f"{megatron_release()}: its inference engine is neither sized by an InferenceConfig nor by keywords "
            f"(DynamicInferenceContext takes {list(parameters)[1:]}); the rollouts cannot build it"
        )
    config = model.config
    sizes = {"max_requests": sizing.max_requests, "max_tokens": sizing.max_tokens}
    context = DynamicInferenceContext(
        params_dtype=config.params_dtype,
        num_layers=config.num_layers // config.pipeline_model_parallel_size,
        kv_channels=config.kv_channels,
        num_attention_heads=config.num_query_groups,
        max_sequence_length=max_sequence_length,
        buffer_size_gb=buffer_size_gb,
        block_size_tokens=sizing.block_size_tokens,
        materialize_only_last_token_logits=False,
        **{key: value for key, value in sizes.items() if value is not None},
    )
    wrapper_config = InferenceWrapperConfig(
        hidden_size=config.hidden_size,
        params_dtype=config.params_dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=model.vocab_size,
        inference_max_seq_length=max_sequence_length,
    )
    controller = controller_class(GPTInferenceWrapper(model, wrapper_config, context), tokenizer=TokenIdsAsText())
    return engine_class(controller=controller, context=context, random_seed=0)
