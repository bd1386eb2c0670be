"""The private names of megatron-core's inference engine that the generation path overrides or
reads, probed once per engine build against the installed release.

Our controllers override private controller methods (megatron calls them from its step) and read
private attributes; our engine subclass bumps a private counter; the drafters read the step's
decoder hidden states where megatron keeps them. A release that renames one would not fail: an
override that is never called leaves megatron's own behaviour in place (drafts from one position,
exact-match verification, counts nobody keeps), silently. So every name, and the parameters of
every method we override or call, is checked when an engine is built, for what the configuration
uses (:func:`check_engine_names`): a missing or changed one stops the build in one line naming it.

Where releases differ, each alternative is probed and the one found is used (logged at the build):

- the step's decoder hidden states (sequence and incremental drafts): the inference context's
  ``mtp_decoder_hidden_states`` (0.19) or the model's ``_decoder_hidden_states_cache`` (0.17,
  0.18);
- the verification rows (rejection sampling): the sampling backend's ``sample_speculative``
  (0.18, 0.19) or the controller's ``_sample_speculative_logits`` (0.17);
- the sampling distribution (rejection sampling): the backend's ``log_probs_kernel`` (0.19), or
  :func:`sampling_log_probs`, megatron's torch filters written out, where a probe finds the
  release's sampler drawing exactly from it (0.17, 0.18).

The accessors the hot path reads these names through are in :mod:`engine_access`; behaviour
probes that decide a switch (the release's sampler agreeing with the written-out distribution) run
once per process for each implementation they probe.
"""

from __future__ import annotations

import inspect
import logging

import torch

from nemo_rl_mtp.megatron_compat.engine_access import sampling_backend, sampling_log_probs, unwrapped_model

logger = logging.getLogger(__name__)

# Controller methods we override (mixins) or call, with the leading parameters our overrides
# take by position; ``_verify_speculative_tokens``'s are read by name (their order differs by
# release: VERIFY_PARAMETERS).
COUNTING_METHODS = {"_dynamic_step_sample_logits_and_verify_tokens": [], "_dynamic_step_calculate_log_probs_speculative": []}
DRAFTING_METHODS = {"_compute_serial_mtp_and_sample": []}
REJECTION_SAMPLING_METHODS = {"_compute_serial_mtp_and_sample": [], "_sample_from_logits_2d": ["logits_2d"]}
VERIFY_PARAMETERS = {"_verify_speculative_tokens": ["output_tokens", "input_tokens_required", "num_decode_requests"]}
# Controller attributes we read (set by megatron's constructor).
COUNTING_ATTRIBUTES = ("_accepted_tokens_per_request", "_sampled_tokens_cuda", "sampling_rng")
DRAFTING_ATTRIBUTES = ("_last_accepted_seq_indices",)
REJECTION_SAMPLING_ATTRIBUTES = ("sampling_rng",)
ENGINE_METHODS = {
    "post_process_requests": ["request_ids", "finished_request_ids", "evict_request_ids", "step_time", "sample", "accepted_tokens"],
}
ENGINE_ATTRIBUTES = ("_spec_steps", "num_speculative_tokens")
MODEL_METHODS = {"_scale_logits": ["logits"], "compute_mtp_single_step": ["hidden_states", "next_token_ids", "position_ids", "depth"]}
MTP_LAYER_METHODS = {"forward_single_position": ["hidden_states", "next_token_ids", "position_ids", "embedding"]}
# The verification rows' sampling, by the backend (0.18 on) or the controller (0.17).
BACKEND_SAMPLE_SPECULATIVE = ["required_logits", "num_decode", "num_prefill", "num_speculative_tokens", "context"]
CONTROLLER_SAMPLE_SPECULATIVE = ["required_logits", "request_in_prefill_status_tensor"]
BACKEND_LOG_PROBS = ["logits", "context"]


def class_names_changed(model, generation_cfg) -> list[str]:
    """Names (with what is wrong) the generation path, as ``generation_cfg`` configures it, needs
    from megatron's classes (controller, model, MTP layer): checked before an engine is built,
    since building one already calls some of them."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    problems = _methods(TextGenerationController, COUNTING_METHODS, "controller")
    problems += _methods(TextGenerationController, VERIFY_PARAMETERS, "controller", by_name=True)
    if generation_cfg.spec_verification == "rejection_sampling":
        problems += _methods(TextGenerationController, REJECTION_SAMPLING_METHODS, "controller")
    if getattr(model, "mtp", None) is not None and generation_cfg.draft_context != "single_position":
        problems += _methods(TextGenerationController, DRAFTING_METHODS, "controller")
        problems += _methods(type(model), MODEL_METHODS, "model")
        problems += _methods(type(model.mtp.layers[0]), MTP_LAYER_METHODS, "MTP layer")
    return list(dict.fromkeys(problems))


def changed_names(engine, generation_cfg) -> list[str]:
    """Names (with what is wrong) the generation path, as ``generation_cfg`` configures it, needs
    from the built ``engine`` and the installed release lacks. Nothing without speculation."""
    if not getattr(engine.controller, "num_speculative_tokens", 0):
        return []
    controller = engine.controller
    model = unwrapped_model(controller)
    problems = class_names_changed(model, generation_cfg)
    problems += _attributes(controller, COUNTING_ATTRIBUTES, "controller")
    if not takes_step_logits(_megatron_class(controller)):  # 0.18 on: the step's logits kept on the controller
        problems += _attributes(controller, ("_all_logits_cuda",), "controller")
    problems += _methods(_megatron_class(engine), ENGINE_METHODS, "engine")
    problems += _attributes(engine, ENGINE_ATTRIBUTES, "engine")
    if "termination_id" not in getattr(controller.inference_wrapped_model.inference_context, "request_metadata", {}):
        problems.append("context.request_metadata['termination_id'] (each request's end-of-sequence token) is missing")
    if generation_cfg.spec_verification == "rejection_sampling":
        problems += _attributes(controller, REJECTION_SAMPLING_ATTRIBUTES, "controller")
        problems += [] if verification_rows_hook(controller) else [_missing_verification_rows()]
    if getattr(model, "mtp", None) is not None and generation_cfg.draft_context != "single_position":
        problems += _attributes(controller, DRAFTING_ATTRIBUTES, "controller")
        problems += [] if decoder_hidden_source(controller) else [_missing_hidden_states()]
    return list(dict.fromkeys(problems))


def check_class_names(model, generation_cfg, num_speculative_tokens: int) -> None:
    """Before an engine with drafts is built: raise naming every class member it needs that the
    installed release does not have (:func:`class_names_changed`)."""
    if num_speculative_tokens:
        _raise_if_changed(class_names_changed(model, generation_cfg))


def _raise_if_changed(problems: list[str]) -> None:
    if problems:
        from nemo_rl_mtp.megatron_compat.engine_release import megatron_release

        raise RuntimeError(
            f"{megatron_release()}: the speculation path of the rollout engine relies on names this release changed: "
            f"{'; '.join(problems)}. Set policy.generation.num_speculative_tokens=0, or adapt "
            "nemo_rl_mtp/rollout and nemo_rl_mtp/megatron_compat to the release"
        )


def check_engine_names(engine, generation_cfg) -> None:
    """Raise naming every private name of megatron-core the generation path needs and the
    installed release does not have (module docstring); log which alternatives are in use."""
    _raise_if_changed(changed_names(engine, generation_cfg))
    controller = engine.controller
    if not getattr(controller, "num_speculative_tokens", 0):
        return
    used = []
    if generation_cfg.spec_verification == "rejection_sampling":
        used.append(f"verification rows from {verification_rows_hook(controller)}")
    if generation_cfg.draft_context != "single_position" and getattr(unwrapped_model(controller), "mtp", None) is not None:
        used.append(f"decoder hidden states from {decoder_hidden_source(controller)}")
    if used:
        logger.info("rollout engine: %s", ", ".join(used))


def decoder_hidden_source(controller) -> str | None:
    """Where the installed release keeps the step's decoder output for its draft step:
    ``context.mtp_decoder_hidden_states`` or ``model._decoder_hidden_states_cache`` (None: neither)."""
    from nemo_rl_mtp.megatron_compat.engine_release import attributes_set_by

    if hasattr(controller.inference_wrapped_model.inference_context, "mtp_decoder_hidden_states"):
        return "context.mtp_decoder_hidden_states"
    if "_decoder_hidden_states_cache" in attributes_set_by(type(unwrapped_model(controller))):
        return "model._decoder_hidden_states_cache"
    return None


def _missing_hidden_states() -> str:
    return "the step's decoder hidden states (neither context.mtp_decoder_hidden_states nor model._decoder_hidden_states_cache)"


def verification_rows_hook(controller) -> str | None:
    """How the installed controller samples its verification rows: ``sampling
    backend.sample_speculative`` or ``controller._sample_speculative_logits`` (None: neither, with
    the parameters rejection sampling replaces)."""
    backend = sampling_backend(controller)
    if backend is not None and _takes(getattr(type(backend), "sample_speculative", None), BACKEND_SAMPLE_SPECULATIVE):
        return "sampling backend.sample_speculative"
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    if _takes(getattr(TextGenerationController, "_sample_speculative_logits", None), CONTROLLER_SAMPLE_SPECULATIVE):
        return "controller._sample_speculative_logits"
    return None


def _missing_verification_rows() -> str:
    return (
        "the sampling of the verification rows (neither controller._sampling.sample_speculative"
        f"{BACKEND_SAMPLE_SPECULATIVE} nor controller._sample_speculative_logits{CONTROLLER_SAMPLE_SPECULATIVE})"
    )


def native_log_probs(controller):
    """The sampling backend's ``log_probs_kernel`` (0.19), or None."""
    backend = sampling_backend(controller)
    method = getattr(type(backend), "log_probs_kernel", None) if backend is not None else None
    return getattr(backend, "log_probs_kernel") if _takes(method, BACKEND_LOG_PROBS) else None


PROBE_SAMPLING = ((1.0, 0, 0.0), (0.7, 5, 0.0), (1.0, 0, 0.8), (1.0, 1, 0.0))


def release_sampler(controller):
    """The installed release's torch sampling function ``(logits, temperature, top_k, top_p,
    generator) -> tokens``, or None: the backend's ``sample_from_logits`` (0.18, 0.19) or the
    controller's ``_torch_sampling_func`` (0.17, which draws from ``sampling_rng``)."""
    sample = _release_sampling_function(controller)
    if sample is None:
        return None
    if sample is not _controller_sampling_function():
        return lambda logits, t, k, p, generator: sample(logits, t, k, p, generator=generator)

    def drawn_with(logits, t, k, p, generator):
        saved = controller.sampling_rng
        controller.sampling_rng = generator
        try:
            return sample(controller, logits, t, k, p)
        finally:
            controller.sampling_rng = saved

    return drawn_with


def release_sampler_agrees(controller) -> tuple[bool, str]:
    """Probe: the release's sampler and a draw from :func:`sampling_log_probs` pick the same
    tokens from the same generator state, on 64 random rows of 24 ids, for each of
    ``PROBE_SAMPLING``'s (temperature, top-k, top-p). Decided once per process for each sampling
    function (a release's, or one a test put in its place): the verdict is the function's, not
    the controller's."""
    function = _release_sampling_function(controller)
    if function not in _SAMPLER_VERDICTS:
        _SAMPLER_VERDICTS[function] = _sampler_agrees(controller)
    return _SAMPLER_VERDICTS[function]


# The sampler probe's verdict per sampling function (``None``: none found), once per process.
_SAMPLER_VERDICTS: dict = {}


def _release_sampling_function(controller):
    """The function :func:`release_sampler` draws with (None: none)."""
    backend = sampling_backend(controller)
    sample = getattr(type(backend), "sample_from_logits", None) if backend is not None else None
    if _takes(sample, ["last_token_logits", "temperature", "top_k", "top_p"]):
        return sample
    sample = _controller_sampling_function()
    return sample if _takes(sample, ["last_token_logits", "temperature", "top_k", "top_p"]) else None


def _controller_sampling_function():
    from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

    return getattr(TextGenerationController, "_torch_sampling_func", None)


def _sampler_agrees(controller) -> tuple[bool, str]:
    sample = release_sampler(controller)
    if sample is None:
        return False, "no torch sampling function found (neither sampling backend.sample_from_logits nor controller._torch_sampling_func)"
    logits = torch.randn(64, 24, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in PROBE_SAMPLING:
        theirs = sample(logits.clone(), temperature, top_k, top_p, torch.Generator().manual_seed(1))
        probs = sampling_log_probs(logits, temperature, top_k, top_p).exp()
        ours = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(1)).view(-1)
        if not torch.equal(theirs.view(-1).cpu(), ours):
            return False, f"the release's sampler draws differently at temperature {temperature}, top-k {top_k}, top-p {top_p}"
    return True, "the release's sampler draws exactly from its temperature/top-k/top-p distribution"


def upstream_drafts_have_context(model) -> bool:
    """Whether the installed engine's draft step can see earlier positions of a request: it
    would need an inference context or a KV cache to read them. 0.19.2's takes neither (its
    ``cache_key`` names a CUDA graph). Decides whether the rollout's drafters serve the draft
    rounds (``policy.generation.draft_context``)."""
    parameters = inspect.signature(model.compute_mtp_single_step).parameters
    return any("context" in name or "kv" in name for name in parameters)


def serial_step_leak(model) -> float | None:
    """How much megatron's serial draft step changes the second request's draft logits when only
    the first request's input changes (0.0: requests are independent), measured once per process
    for each draft-step implementation (None after the first: it was logged then). A figure for
    the log, deciding nothing (:func:`upstream_drafts_have_context` decides); the defect itself is
    a test on each release (tests/unit/rollout/test_sequence_drafts.py). Call in rollout mode."""
    implementation = getattr(type(model), "compute_mtp_single_step", None)
    if implementation in _LEAK_MEASURED:
        return None
    _LEAK_MEASURED.add(implementation)
    hidden = torch.randn(2, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(next(model.parameters()).device, model.config.params_dtype)
    ids = torch.zeros(1, 2, dtype=torch.long, device=hidden.device)
    with torch.no_grad():
        _, first = model.compute_mtp_single_step(hidden, ids, ids, depth=0)
        hidden[0] += 1.0
        _, second = model.compute_mtp_single_step(hidden, ids, ids, depth=0)
    return float((first[1] - second[1]).abs().max())


_LEAK_MEASURED: set = set()


def _megatron_class(instance) -> type:
    """The first class in ``instance``'s MRO that megatron-core defines (ours subclass it)."""
    return next(cls for cls in type(instance).__mro__ if cls.__module__.startswith("megatron."))


def _takes(method, leading: list[str]) -> bool:
    if method is None:
        return False
    parameters = [name for name in inspect.signature(method).parameters if name != "self"]
    return parameters[: len(leading)] == leading


def takes_step_logits(controller_class: type) -> bool:
    """Whether megatron's speculative log-probs take the step's logits as an argument (0.17)."""
    method = getattr(controller_class, "_dynamic_step_calculate_log_probs_speculative", None)
    return method is not None and "logits" in inspect.signature(method).parameters


def _attributes(instance, names, owner: str) -> list[str]:
    return [f"{owner}.{name} (attribute)" for name in names if not hasattr(instance, name)]


def _methods(cls: type, expected: dict[str, list[str]], owner: str, by_name: bool = False) -> list[str]:
    """Problems with ``cls``'s methods: gone, or parameters changed (the expected ones leading,
    in order; anywhere with ``by_name``)."""
    problems = []
    for name, needed in expected.items():
        method = getattr(cls, name, None)
        if method is None:
            problems.append(f"{owner}.{name} (gone)")
            continue
        parameters = [parameter for parameter in inspect.signature(method).parameters if parameter != "self"]
        if not (set(needed) <= set(parameters) if by_name else parameters[: len(needed)] == needed):
            problems.append(f"{owner}.{name} (parameters now {parameters})")
    return problems
