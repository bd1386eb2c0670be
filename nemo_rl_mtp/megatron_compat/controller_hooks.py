"""megatron-core's private controller steps, hooked in one place: the rollout's controllers
override public hooks, never megatron's underscore methods.

Speculative decoding in megatron's ``TextGenerationController`` runs through private methods its
step calls: ``_dynamic_step_sample_logits_and_verify_tokens`` (verify a step's drafts),
``_compute_serial_mtp_and_sample`` (the draft round), ``_sample_from_logits_2d`` (one depth's
drafts), ``_verify_speculative_tokens`` (the equality check) and, for the verification rows, the
sampling backend's ``sample_speculative`` (0.18 on) or the controller's
``_sample_speculative_logits`` (0.17). The classes here override exactly those and call a public
hook with what it needs:

- :class:`SpeculativeControllerHooks`: ``after_verification()`` and ``draft_round(megatron_round)``
  (counting, drafters);
- :class:`VerificationHooks`: also ``sample_drafts(logits_2d)``, ``verification_rows(logits,
  num_decode, num_prefill)`` and ``before_verifying_drafts(input_tokens_required,
  num_decode_requests)`` (rejection sampling).

Every name reached here is checked when an engine is built (:mod:`engine_probes`): a release that
renames one stops the build naming it, rather than leaving megatron's own behaviour in place
silently. :func:`serving_draft_steps` routes the model's ``compute_mtp_single_step`` to a drafter
for one draft round (set and cleared).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from typing import Callable

import torch
from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

from nemo_rl_mtp.megatron_compat import engine_probes


class SpeculativeControllerHooks(TextGenerationController):
    """megatron's controller whose verification step and draft round call public hooks; by default
    the hooks do what megatron does (nothing after verification; its own draft round)."""

    def _dynamic_step_sample_logits_and_verify_tokens(self, *args, **kwargs):
        result = super()._dynamic_step_sample_logits_and_verify_tokens(*args, **kwargs)
        self.after_verification()
        return result

    def after_verification(self) -> None:
        """After megatron verified a step's drafts (its accepted drafts:
        ``engine_access.accepted_tokens_per_request``)."""

    def _compute_serial_mtp_and_sample(self, *args, **kwargs):
        return self.draft_round(functools.partial(super()._compute_serial_mtp_and_sample, *args, **kwargs))

    def draft_round(self, megatron_round: Callable[[], None]) -> None:
        """One draft round: ``megatron_round()`` runs megatron's own (an override may wrap it)."""
        return megatron_round()


class VerificationHooks(SpeculativeControllerHooks):
    """Also: the drafts of each depth (``sample_drafts``), the tokens of the verification rows
    (``verification_rows``, which a subclass must define) and a look at the drafts megatron's
    equality check is about to verify (``before_verifying_drafts``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if engine_probes.verification_rows_hook(self) == "sampling backend.sample_speculative":
            self._sampling = _VerificationRowsFromController(self._sampling, self)

    def _sample_from_logits_2d(self, logits_2d: torch.Tensor) -> torch.Tensor:
        return self.sample_drafts(logits_2d)

    def sample_drafts(self, logits_2d: torch.Tensor) -> torch.Tensor:
        """One depth's drafts ``[active requests]`` from its logits; megatron's sampling by default."""
        return super()._sample_from_logits_2d(logits_2d)

    def verification_rows(self, logits: torch.Tensor, num_decode: int, num_prefill: int) -> torch.Tensor:
        """Tokens ``[D * (k + 1) + P]`` for the verification rows ``logits`` (decode requests' k + 1
        rows each, then prefill requests' one)."""
        raise NotImplementedError

    def _sample_speculative_logits(self, required_logits: torch.Tensor, request_in_prefill_status_tensor: torch.Tensor):
        """megatron-core 0.17's verification rows (decode requests first): ``(tokens, rows per request)``."""
        num_prefill = int(request_in_prefill_status_tensor.sum())
        num_decode = request_in_prefill_status_tensor.numel() - num_prefill
        repeats = torch.where(request_in_prefill_status_tensor == 0, 1 + self.num_speculative_tokens, 1)
        return self.verification_rows(required_logits, num_decode, num_prefill), repeats

    def _verify_speculative_tokens(self, *args, **kwargs):
        arguments = _VERIFY_SIGNATURE.bind(self, *args, **kwargs).arguments
        self.before_verifying_drafts(arguments["input_tokens_required"], arguments["num_decode_requests"])
        return super()._verify_speculative_tokens(*args, **kwargs)

    def before_verifying_drafts(self, input_tokens_required: torch.Tensor, num_decode_requests: int) -> None:
        """Before megatron's equality check: the step's input tokens (each decode request's k + 1,
        first) and how many decode requests there are."""


# The parameters of megatron's equality check are read by name (their order differs by release).
_VERIFY_SIGNATURE = (
    inspect.signature(TextGenerationController._verify_speculative_tokens)
    if hasattr(TextGenerationController, "_verify_speculative_tokens")
    else None
)


class _VerificationRowsFromController:
    """megatron's sampling backend (0.18 on), with ``sample_speculative`` served by the
    controller's ``verification_rows``; everything else is the backend's own (its ``_backend`` is
    what ``engine_access.sampling_backend`` unwraps)."""

    def __init__(self, backend, controller: VerificationHooks):
        self._backend = backend
        self._controller = controller

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def sample_speculative(self, required_logits, num_decode, num_prefill, num_speculative_tokens, context, *, gather_indices=None, **unused):
        """Tokens for every verification row ([D * (k + 1) + P])."""
        count = num_decode * (num_speculative_tokens + 1) + num_prefill
        logits = required_logits[gather_indices[:count]] if gather_indices is not None else required_logits[:count]
        return self._controller.verification_rows(logits, num_decode, num_prefill)


def pad_rows(values: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to ``rows`` (megatron pads the draft batch for sequence parallelism)."""
    missing = rows - values.shape[0]
    return torch.cat([values, values.new_zeros(missing, *values.shape[1:])]) if missing > 0 else values


@contextlib.contextmanager
def serving_draft_steps(model, drafter):
    """Route the engine's ``compute_mtp_single_step`` calls of one draft round to
    ``drafter.draft_step(next_token_ids, depth)``, counting depths (a repeated layer is called
    without one); the model's own method is back afterwards, and the drafter's round ended."""
    depths = itertools.count()

    def compute_mtp_single_step(hidden_states, next_token_ids, position_ids, depth=None, **unused):
        last_hidden, logits = drafter.draft_step(next_token_ids, next(depths) if depth is None else depth)
        return pad_rows(last_hidden, hidden_states.shape[0]), pad_rows(logits, next_token_ids.shape[1])

    model.compute_mtp_single_step = compute_mtp_single_step
    try:
        yield
    finally:
        del model.compute_mtp_single_step
        drafter.end_round()
