"""The private names of megatron-core's inference engine that the speculation path reaches, probed
once per engine build.

Our controllers override private controller methods (megatron calls them from its step) and read
private attributes; our engine subclass bumps a private counter. A release that renames one would
not fail: an override that is never called leaves megatron's own behaviour in place (drafts from
one position, counts nobody keeps), silently. So every name, and the parameters of every method
we override or call, is checked against the installed release when a speculating engine is built;
a missing or changed one stops the build, naming it.
"""

from __future__ import annotations

import inspect

# Controller methods megatron calls and we override (mixins), with the leading parameters our
# overrides take by position.
CONTROLLER_METHODS = {
    "_compute_serial_mtp_and_sample": [],
    "_sample_from_logits_2d": ["logits_2d"],
    "_verify_speculative_tokens": ["output_tokens", "input_tokens_required", "num_decode_requests"],
    "_dynamic_step_sample_logits_and_verify_tokens": [],
}
# Controller attributes we read, set by megatron's constructor or step.
CONTROLLER_ATTRIBUTES = (
    "_is_last_pp_stage",
    "_sp_enabled",
    "_unwrapped_model",
    "_sampling",
    "_accepted_token_counts_per_request",
    "_last_accepted_seq_indices_buf",
    "num_mtp_depths",
    "sampling_rng",
)
# The sampling backend's methods rejection sampling calls or replaces.
SAMPLING_METHODS = {
    "log_probs_kernel": ["logits", "context"],
    "sample_speculative": ["required_logits", "num_decode", "num_prefill", "num_speculative_tokens", "context"],
}
ENGINE_METHODS = {
    "post_process_requests": ["request_ids", "finished_request_ids", "evict_request_ids", "step_time", "sample", "accepted_tokens"],
}
ENGINE_ATTRIBUTES = ("_spec_steps", "num_speculative_tokens")
MODEL_METHODS = {"_scale_logits": ["logits"], "compute_mtp_single_step": ["hidden_states", "next_token_ids", "position_ids", "depth"]}


def changed_names(engine) -> list[str]:
    """Names (with what is wrong) the speculation path needs and the installed engine lacks."""
    controller = engine.controller
    problems = []
    problems += _methods(_megatron_class(controller), CONTROLLER_METHODS, "controller")
    problems += [f"controller.{name} (attribute)" for name in CONTROLLER_ATTRIBUTES if not hasattr(controller, name)]
    backend = getattr(controller._sampling, "_backend", controller._sampling) if hasattr(controller, "_sampling") else None
    if backend is not None:
        problems += _methods(type(backend), SAMPLING_METHODS, "sampling backend")
    problems += _methods(_megatron_class(engine), ENGINE_METHODS, "engine")
    problems += [f"engine.{name} (attribute)" for name in ENGINE_ATTRIBUTES if not hasattr(engine, name)]
    model = getattr(controller, "_unwrapped_model", None)
    if model is not None:
        problems += _methods(type(model), MODEL_METHODS, "model")
    return problems


def check_engine_names(engine) -> None:
    """Raise naming every private name of megatron-core the speculation path needs and the
    installed release does not have (module docstring)."""
    problems = changed_names(engine)
    if problems:
        import megatron.core

        raise RuntimeError(
            f"megatron-core {getattr(megatron.core, '__version__', '?')}: the speculation path of the rollout engine "
            f"relies on names this release changed: {'; '.join(problems)}. Set policy.generation.num_speculative_tokens=0, "
            "or adapt nemo_rl_mtp/models/generation to the release"
        )


def _megatron_class(instance) -> type:
    """The first class in ``instance``'s MRO that megatron-core defines (ours subclass it)."""
    return next(cls for cls in type(instance).__mro__ if cls.__module__.startswith("megatron."))


def _methods(cls: type, expected: dict[str, list[str]], owner: str) -> list[str]:
    problems = []
    for name, leading in expected.items():
        method = getattr(cls, name, None)
        if method is None:
            problems.append(f"{owner}.{name} (gone)")
            continue
        parameters = [parameter for parameter in inspect.signature(method).parameters if parameter != "self"]
        if parameters[: len(leading)] != leading:
            problems.append(f"{owner}.{name} (parameters now {parameters})")
    return problems
