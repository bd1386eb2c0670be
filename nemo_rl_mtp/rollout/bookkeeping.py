"""megatron-core's per-request speculative bookkeeping, done once per step for the whole batch.

After each step megatron's engine walks the batch's requests in Python
(``DynamicInferenceEngine.post_process_requests``): it appends each request's tokens and, with
speculation, merges its accepted drafts in front of the new token and counts proposed and
accepted drafts per position with four small tensor operations per request. With 32 requests
that cost a speculative step about 0.6 ms on a CPU, as much as a decode step's sampling and
verification together. Here:

- :class:`AcceptanceCounts` (a controller mixin) counts drafts per position for the whole batch
  right after verification, from the accepted counts the controller already holds: each decode
  request proposes k drafts; draft i is accepted when the first i + 1 are (a request ending at an
  accepted end-of-sequence draft proposes none after it);
- :class:`SpeculativeBookkeepingEngine` hands megatron's walk each request's merged tokens
  (accepted drafts, then the new token) and runs it as for a step without speculation, which
  appends them and counts nothing. Requests with stop words (whose trimming changes what counts)
  take megatron's own path;
- (``megatron_compat.kv_rewind``, a compat patch, replaces the controller's KV-cache rewind, a
  Python loop over requests that megatron runs on the host on every machine.)

All are tested against megatron's own bookkeeping: same rollouts, same counts.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

from nemo_rl_mtp.megatron_compat import engine_access

logger = logging.getLogger(__name__)


class AcceptanceCounts:
    """Mixin for megatron's controller under :class:`controller_hooks.SpeculativeControllerHooks`: drafts proposed and accepted per
    position ``[k]`` since :meth:`reset_acceptance_counts`, counted once per step on the device
    of the accepted drafts (read on the host only with :meth:`acceptance_counts`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reset_acceptance_counts()

    def reset_acceptance_counts(self) -> None:
        # megatron's accepted drafts (checked after the build: engine_probes.check_engine_names)
        accepted = engine_access.accepted_tokens_per_request(self)
        device = accepted.device if accepted is not None else torch.device("cpu")
        self.drafts_proposed = torch.zeros(self.num_speculative_tokens, dtype=torch.int64, device=device)
        self.drafts_accepted = torch.zeros(self.num_speculative_tokens, dtype=torch.int64, device=device)

    def acceptance_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of (proposed, accepted) per draft position."""
        return self.drafts_proposed.cpu(), self.drafts_accepted.cpu()

    def after_verification(self) -> None:
        """After megatron's verification: its accepted drafts ``[>= decode requests, k]`` are each
        decode request's accepted prefix, -1 after it, so draft i is accepted where column i is
        not -1.

        A request that ended at an accepted end-of-sequence draft j (``end_of_sequence_drafts``,
        :func:`controller_hooks.end_at_accepted_end_of_sequence`: the draft became the step's
        sampled token, so it is not among megatron's accepted drafts) counts drafts 1..j proposed
        and accepted, and none after: the end-of-sequence draft is accepted as vLLM counts it, and
        only drafts inside the response count (as ``scripts/acceptance_inside_responses.py``
        replays them; vLLM's scheduler also counts the step's drafts after the end, which never
        reach a response, before its stop check)."""
        super().after_verification()
        num_decode = self.inference_wrapped_model.inference_context.num_decode_requests
        if num_decode == 0:
            return
        k = self.num_speculative_tokens
        accepted = (engine_access.accepted_tokens_per_request(self)[:num_decode] != -1).sum(dim=1)
        ended_at, self.end_of_sequence_drafts = self.end_of_sequence_drafts, None  # read once: a stale one would miscount
        if ended_at is None or ended_at.shape[0] != num_decode:
            raise RuntimeError("speculative counts: the step's verification did not record its end-of-sequence drafts")
        ended_at = ended_at.to(accepted.device)
        ended = ended_at > 0
        proposed = torch.where(ended, ended_at, k)
        accepted = accepted + ended.to(accepted.dtype)
        positions = torch.arange(k, device=accepted.device)
        self.drafts_proposed += (positions[None, :] < proposed[:, None]).sum(dim=0)
        self.drafts_accepted += (positions[None, :] < accepted[:, None]).sum(dim=0)


class _TokenRows:
    """Per request, the tokens a step appends, where megatron's walk expects ``sample`` (it
    reads it with ``tolist()``)."""

    def __init__(self, rows: list[list[int]]):
        self.rows = rows

    def tolist(self) -> list[list[int]]:
        return self.rows


def merged_tokens(accepted_tokens: torch.Tensor, sample: torch.Tensor) -> list[list[int]]:
    """Per request (row of ``sample`` [R]), its accepted drafts (``accepted_tokens`` [>= R, k],
    a prefix of each row; -1 after it) followed by the new token."""
    num_requests = sample.shape[0]
    accepted = accepted_tokens[:num_requests].to(sample.device)
    lengths = (accepted != -1).sum(dim=1) + 1
    tokens = torch.cat([accepted, sample[:, None].to(accepted.dtype)], dim=1)
    columns = torch.arange(tokens.shape[1], device=tokens.device)
    tokens = torch.where(columns[None, :] < lengths[:, None] - 1, tokens, sample[:, None].to(tokens.dtype))
    return [row[:length] for row, length in zip(tokens.tolist(), lengths.tolist())]


class RequestSamplingNotes(DynamicInferenceEngine):
    """megatron's engine that tells its controller each request's sampling parameters as it is
    added (a controller with ``note_request_sampling``): on releases whose sampling backend has no
    ``log_probs_kernel``, rejection sampling writes the distribution out from them, without reading
    megatron's per-request metadata back from the device every step."""

    def add_request(self, request_id, prompt, sampling_params=None, *args, **kwargs):
        if sampling_params is not None and hasattr(self.controller, "note_request_sampling"):
            self.controller.note_request_sampling(sampling_params)
        return super().add_request(request_id, prompt, sampling_params, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        if hasattr(self.controller, "note_request_sampling"):
            self.controller.forget_request_sampling()


class SpeculativeBookkeepingEngine(RequestSamplingNotes):
    """megatron's engine whose per-request walk after a speculative step merges and counts
    nothing itself (module docstring); the controller must count (:class:`AcceptanceCounts`)."""

    def add_request(self, request_id, prompt, sampling_params=None, *args, **kwargs):
        if sampling_params is not None and getattr(sampling_params, "stop_words", None):
            self.requests_with_stop_words = True
        return super().add_request(request_id, prompt, sampling_params, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        self.requests_with_stop_words = False
        if isinstance(self.controller, AcceptanceCounts):
            self.controller.reset_acceptance_counts()

    def post_process_requests(self, request_ids, finished_request_ids, evict_request_ids, step_time, sample, accepted_tokens, *args, **kwargs):
        if accepted_tokens is None or self.num_speculative_tokens == 0 or self.requests_with_stop_words:
            return super().post_process_requests(request_ids, finished_request_ids, evict_request_ids, step_time, sample, accepted_tokens, *args, **kwargs)
        rows = _TokenRows(merged_tokens(accepted_tokens, sample))
        engine_access.count_speculative_step(self)
        num_speculative_tokens, self.num_speculative_tokens = self.num_speculative_tokens, 0
        try:
            return super().post_process_requests(request_ids, finished_request_ids, evict_request_ids, step_time, rows, None, *args, **kwargs)
        finally:
            self.num_speculative_tokens = num_speculative_tokens
