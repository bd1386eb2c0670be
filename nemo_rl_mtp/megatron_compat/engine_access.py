"""Accessors of megatron-core's inference engine for the rollout's hot path: the objects and
values the generation path reads from megatron's controller, model and context, each in one place.

The names these accessors read are checked once per engine build by :mod:`engine_probes` (a
renamed one stops the build naming it); the accessors themselves probe nothing, so a decode step
pays for no signature inspection. Where releases keep a value in different places, the accessor
reads whichever the installed release has, in the order :mod:`engine_probes` documents.

Names we could derive from public ones are derived instead of read: the unwrapped model, the last
pipeline stage, sequence parallelism and the number of draft depths.
"""

from __future__ import annotations

import torch


def unwrapped_model(controller):
    """The GPTModel under the controller's inference wrapper."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(controller.inference_wrapped_model.model)


def is_last_pipeline_stage(controller) -> bool:
    from megatron.core.inference.communication_utils import is_pipeline_last_stage

    return is_pipeline_last_stage(controller.pp_group)


def sequence_parallel_across_ranks(controller) -> bool:
    """Whether the step's activations are scattered over tensor-parallel ranks."""
    from megatron.core import parallel_state

    return bool(controller.model_config.sequence_parallel) and parallel_state.get_tensor_model_parallel_world_size() > 1


def draft_depths(model, num_speculative_tokens: int) -> int:
    """MTP depths megatron's draft loop runs with k drafts per step: k for a repeated layer (the
    configuration check keeps k within the layers where the controller cannot do more), else at
    most one per MTP layer."""
    if not num_speculative_tokens or getattr(model, "mtp", None) is None:
        return 0
    return num_speculative_tokens if model.mtp.mtp_use_repeated_layer else min(num_speculative_tokens, len(model.mtp.layers))


def step_decoder_hidden(controller):
    """The step's decoder output [T, 1, H] (scattered under sequence parallelism), or None where
    this pipeline stage has none: the context's ``mtp_decoder_hidden_states`` (0.19), else the
    model's ``_decoder_hidden_states_cache`` (0.17, 0.18; :func:`engine_probes.decoder_hidden_source`
    checks at the build that one of them exists)."""
    context = controller.inference_wrapped_model.inference_context
    if hasattr(context, "mtp_decoder_hidden_states"):
        return context.mtp_decoder_hidden_states
    return getattr(unwrapped_model(controller), "_decoder_hidden_states_cache", None)


def sampling_backend(controller):
    """megatron's sampling backend of the controller (0.18 on; None before), under rejection
    sampling's wrapper where it is installed."""
    backend = getattr(controller, "_sampling", None)
    return getattr(backend, "_backend", backend)


def sampling_log_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs ``[N, V]`` of the distribution megatron-core's torch sampler draws from for
    ``logits`` ``[N, V]``: divided by the temperature, outside the top-k (top-k > 0) or outside
    the nucleus (top-p > 0; the first token past it kept) -inf, softmax. top-k 1 is its argmax.
    For releases whose backend has no ``log_probs_kernel``; :func:`release_sampler_agrees` checks
    it against the release's own sampler."""
    logits = logits.float()
    if top_k == 1:
        return torch.full_like(logits, float("-inf")).scatter(1, logits.argmax(dim=-1, keepdim=True), 0.0)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 1:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k)[0][..., -1, None], float("-inf"))
    elif top_p > 0.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        beyond = sorted_logits.softmax(dim=-1).cumsum(dim=-1) > top_p
        beyond = torch.cat([torch.zeros_like(beyond[:, :1]), beyond[:, :-1]], dim=1)
        logits = logits.masked_fill(beyond.scatter(1, order, beyond), float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def inference_mode_flag():
    """megatron's process-wide ``InferenceMode`` flag (0.18 on: the models read it to tell an
    engine's forward from a training one), or None where the release has none (0.16, 0.17: the
    models decide by ``not self.training`` with an inference context, so eval mode is the flag)."""
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return None
    if not all(callable(getattr(InferenceMode, name, None)) for name in ("is_active", "set_active", "unset_active")):
        raise RuntimeError(
            "megatron-core's InferenceMode no longer has is_active/set_active/unset_active; the rollouts cannot "
            "set and restore it (nemo_rl_mtp/megatron_compat/engine_access.py)"
        )
    return InferenceMode


def accepted_tokens_per_request(controller) -> torch.Tensor | None:
    """megatron's accepted drafts of the last verified step ``[>= decode requests, k]`` (each row
    a prefix of the request's drafts, -1 after it), or None before the controller has them."""
    return getattr(controller, "_accepted_tokens_per_request", None)


def termination_ids(controller, count: int) -> torch.Tensor:
    """The end-of-sequence token of the first ``count`` active requests ``[count]`` (-1: none), from
    the context's per-request metadata, where megatron's own termination check reads it."""
    context = controller.inference_wrapped_model.inference_context
    return context.request_metadata["termination_id"][context.paused_request_count : context.paused_request_count + count]


def last_accepted_indices(controller) -> torch.Tensor:
    """Per active request, the index of its last accepted token among the step's tokens ``[R]``."""
    return controller._last_accepted_seq_indices


def scale_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """The model's logit scaling (as its output path applies it; identity for most models)."""
    return model._scale_logits(logits)


def count_speculative_step(engine) -> None:
    """Count one speculative step in the engine's own statistics, where its per-request walk is
    told the step had no speculation (``bookkeeping.SpeculativeBookkeepingEngine``)."""
    engine._spec_steps += 1
