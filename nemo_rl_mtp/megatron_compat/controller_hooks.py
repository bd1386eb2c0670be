"""megatron-core's private controller steps, hooked in one place: the rollout's controllers
override public hooks, never megatron's underscore methods.

Speculative decoding in megatron's ``TextGenerationController`` runs through private methods its
step calls: ``_dynamic_step_sample_logits_and_verify_tokens`` (verify a step's drafts),
``_compute_serial_mtp_and_sample`` (the draft round), ``_sample_from_logits_2d`` (one depth's
drafts), ``_verify_speculative_tokens`` (the equality check),
``_dynamic_step_calculate_log_probs_speculative`` (a step's log-probs; a decode-only step's lists
vectorised, :mod:`speculative_kernels`) and, for the verification rows, the
sampling backend's ``sample_speculative`` (0.18 on) or the controller's
``_sample_speculative_logits`` (0.17). The classes here override exactly those and call a public
hook with what it needs:

- :class:`SpeculativeControllerHooks`: ``after_verification()``, ``draft_round(megatron_round)``
  (counting, drafters) and ``before_verifying_drafts(input_tokens_required, num_decode_requests)``;
- :class:`VerificationHooks`: also ``sample_drafts(logits_2d)`` and ``verification_rows(logits,
  num_decode, num_prefill)`` (rejection sampling).

One behaviour of megatron's is changed here, because it lives in its verification: megatron ends a
request only when the token it *samples* is the request's ``termination_id``, not when an
*accepted draft* is, so a request whose accepted draft is the end of sequence kept decoding and
drafting (the response is cut at its first end, but those steps cost compute and their drafts
were counted). After megatron's equality check, :func:`end_at_accepted_end_of_sequence` makes a
request's first accepted end-of-sequence draft its step's sampled token (as vLLM stops at it);
``end_of_sequence_drafts`` holds where, for the counts.

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
import logging
from typing import Callable

import torch
from megatron.core.inference.text_generation_controllers.text_generation_controller import TextGenerationController

from nemo_rl_mtp.megatron_compat import engine_access, engine_probes, speculative_kernels

logger = logging.getLogger(__name__)


class SpeculativeControllerHooks(TextGenerationController):
    """megatron's controller whose verification step and draft round call public hooks; by default
    the hooks do what megatron does (nothing after verification; its own draft round). One
    difference from megatron's: a request ends at its first accepted end-of-sequence draft
    (:func:`end_at_accepted_end_of_sequence`); ``end_of_sequence_drafts`` [decode requests] is,
    after each verification, the draft position (1..k) where each ended that way, else 0."""

    end_of_sequence_drafts: torch.Tensor | None = None

    def _dynamic_step_sample_logits_and_verify_tokens(self, *args, **kwargs):
        result = super()._dynamic_step_sample_logits_and_verify_tokens(*args, **kwargs)
        self.after_verification()
        return result

    def _verify_speculative_tokens(self, *args, **kwargs):
        arguments = _VERIFY_SIGNATURE.bind(self, *args, **kwargs).arguments
        num_decode = arguments["num_decode_requests"]
        self.before_verifying_drafts(arguments["input_tokens_required"], num_decode)
        last_one_indices, accepted_tokens_mask, input_tokens = super()._verify_speculative_tokens(*args, **kwargs)
        if not ends_at_accepted_end_of_sequence():
            self.end_of_sequence_drafts = torch.zeros(num_decode, dtype=torch.long, device=last_one_indices.device)
            return last_one_indices, accepted_tokens_mask, input_tokens
        # megatron keeps the end tokens in pinned host memory it rewrites as requests move: copied
        # first, so the asynchronous copy to the device cannot read a later step's.
        termination_ids = engine_access.termination_ids(self, num_decode).clone().to(input_tokens.device, non_blocking=True)
        self.end_of_sequence_drafts = end_at_accepted_end_of_sequence(
            last_one_indices, accepted_tokens_mask, input_tokens, num_decode, self.num_speculative_tokens, termination_ids
        )
        return last_one_indices, accepted_tokens_mask, input_tokens

    def _dynamic_step_calculate_log_probs_speculative(self, *args, **kwargs):
        """megatron's, but for a decode-only step the per-request lists come from
        :func:`speculative_kernels.decode_log_probs` (one host copy, where megatron reads each
        request's count and row apart). Steps with prefill requests are megatron's own."""
        context = self.inference_wrapped_model.inference_context
        if not context.is_decode_only():
            return super()._dynamic_step_calculate_log_probs_speculative(*args, **kwargs)
        # megatron-core 0.17 passes the step's logits; later releases keep them on the controller.
        logits = _LOG_PROBS_SIGNATURE.bind(self, *args, **kwargs).arguments["logits"] if _LOG_PROBS_TAKES_LOGITS else self._all_logits_cuda
        log_probs = torch.nn.functional.log_softmax(logits.squeeze(0).float()[: context.active_token_count], dim=-1)
        lists = speculative_kernels.decode_log_probs(
            log_probs, self._accepted_tokens_per_request, self._sampled_tokens_cuda,
            context.total_request_count - context.paused_request_count, self.num_speculative_tokens,
        )  # fmt: skip
        return lists, log_probs

    def before_verifying_drafts(self, input_tokens_required: torch.Tensor, num_decode_requests: int) -> None:
        """Before megatron's equality check: the step's input tokens (each decode request's k + 1,
        first) and how many decode requests there are."""

    def after_verification(self) -> None:
        """After megatron verified a step's drafts (its accepted drafts:
        ``engine_access.accepted_tokens_per_request``)."""

    def _compute_serial_mtp_and_sample(self, *args, **kwargs):
        return self.draft_round(functools.partial(super()._compute_serial_mtp_and_sample, *args, **kwargs))

    def draft_round(self, megatron_round: Callable[[], None]) -> None:
        """One draft round: ``megatron_round()`` runs megatron's own (an override may wrap it)."""
        return megatron_round()


class VerificationHooks(SpeculativeControllerHooks):
    """Also: the drafts of each depth (``sample_drafts``) and the tokens of the verification rows
    (``verification_rows``, which a subclass must define)."""

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


# The parameters of megatron's equality check are read by name (their order differs by release).
_VERIFY_SIGNATURE = (
    inspect.signature(TextGenerationController._verify_speculative_tokens)
    if hasattr(TextGenerationController, "_verify_speculative_tokens")
    else None
)


# The step's logits reach megatron's speculative log-probs as an argument on 0.17 only.
_LOG_PROBS_SIGNATURE = (
    inspect.signature(TextGenerationController._dynamic_step_calculate_log_probs_speculative)
    if hasattr(TextGenerationController, "_dynamic_step_calculate_log_probs_speculative")
    else None
)
_LOG_PROBS_TAKES_LOGITS = engine_probes.takes_step_logits(TextGenerationController)


# The oldest release on which an accepted end-of-sequence draft is shown to end its request (the
# release matrix: on 0.17.1 greedy responses then differed from those without speculation).
END_AT_ACCEPTED_END_SINCE = (0, 18)


@functools.cache
def ends_at_accepted_end_of_sequence() -> bool:
    """Whether the installed release gets :func:`end_at_accepted_end_of_sequence` (logged once
    where it does not: requests there decode past an accepted end draft, and its drafts count)."""
    from nemo_rl_mtp.megatron_compat.installed import megatron_core_version

    version = megatron_core_version()
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if release >= END_AT_ACCEPTED_END_SINCE:
        return True
    logger.info("megatron-core %s: a request does not end at an accepted end-of-sequence draft (shown from 0.18 on); "
                "its later drafts count in the acceptance", version)  # fmt: skip
    return False


def end_at_accepted_end_of_sequence(
    last_one_indices: torch.Tensor,
    accepted_tokens_mask: torch.Tensor,
    input_tokens: torch.Tensor,
    num_decode: int,
    k: int,
    termination_ids: torch.Tensor,
) -> torch.Tensor:
    """Make each decode request's first accepted end-of-sequence draft its step's sampled token, so
    megatron's termination check (which reads only the sampled token) ends the request there.

    megatron's check returns, per request, its k + 1 input tokens' acceptance (``accepted_tokens_mask``:
    the base token, then the accepted prefix of the drafts) and the index of its last accepted one
    (``last_one_indices``), whose output row becomes the step's sampled token. An accepted draft at
    position j (1..k) equals the token sampled at row j - 1, so moving the last accepted index to
    j - 1 and un-accepting drafts j.. makes that draft the sampled token: the request's tokens are the
    same through it, and tokens after an end of sequence are never in a response, so the response's
    distribution (exact match or rejection sampling) is unchanged. Edited in place, on the device
    (no host synchronisation). ``termination_ids`` [num_decode]: each decode request's end token
    (-1: none). Returns [num_decode]: j where a request ended at its draft j, else 0."""
    stride = k + 1
    rows = num_decode * stride
    if num_decode == 0:
        return torch.zeros(0, dtype=torch.long, device=last_one_indices.device)
    mask = accepted_tokens_mask.view(-1)[:rows].view(num_decode, stride)
    tokens = input_tokens.reshape(-1)[:rows].view(num_decode, stride)
    ends = mask.bool() & (tokens == termination_ids[:, None].to(tokens.dtype))
    ends[:, 0] = False  # the base token was sampled last step: megatron's check saw it then
    ended = ends.any(dim=1)
    position = torch.where(ended, ends.int().argmax(dim=1), 0)
    columns = torch.arange(stride, device=mask.device)
    keep = ~ended[:, None] | (columns[None, :] < position[:, None])
    mask.copy_((mask.bool() & keep).to(mask.dtype))
    request_rows = torch.arange(num_decode, device=last_one_indices.device) * stride
    last_one_indices[:num_decode] = torch.where(ended, request_rows + position - 1, last_one_indices[:num_decode])
    return position


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
