"""Lossless verification of the MTP drafts by rejection sampling
(``policy.generation.spec_verification: rejection_sampling``).

megatron-core's engine accepts a draft only when it equals the token the policy samples at the
draft's position (``exact_match``). That is exact, but at temperature > 0 the acceptance is
sum_x p(x) q(x) (p: policy, q: MTP head), not the sum_x min(p(x), q(x)) speculative sampling
reaches: two equal uniform distributions over two tokens accept half the drafts instead of all.

Speculative sampling (Leviathan et al., Chen et al., 2023) accepts draft x with probability
min(1, p(x) / q(x)); at the first rejection it samples from the normalised max(0, p - q), and
when all k drafts are accepted it samples the bonus token from p. The tokens it emits are
distributed exactly as the policy's.

It plugs into the engine without changing its verification: the "policy samples" handed to the
engine's equality check are the accepted drafts themselves, then the residual (or bonus) sample,
which never equals the rejected draft. The check therefore accepts exactly the drafts rejection
sampling accepted, and the engine's KV-cache rewind, its log-probs (the policy's, read from the
verification rows) and its acceptance counters work as they do for exact match. p and q are the
distributions megatron's sampler draws from (temperature, top-k, top-p: its own
``log_probs_kernel``, or on releases without one the same filters written out and checked
against its sampler), so the two verifications differ only in the acceptance rule.

A greedy rollout (top-k 1 for every request) is verified as megatron verifies greedy ones: p and
q are then point masses, rejection sampling accepts a draft exactly when it is the policy's most
likely token, which is what the equality check does with the argmax of each verification row
(megatron's sampler at top-k 1 is that argmax). No
distribution is written out and nothing is drawn (as vLLM's greedy rejection sampler).
"""

from __future__ import annotations

import logging

import torch

from nemo_rl_mtp.megatron_compat import engine_access, engine_probes
from nemo_rl_mtp.megatron_compat.controller_hooks import VerificationHooks

logger = logging.getLogger(__name__)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Speculative sampling for N requests with k drafts each.

    p: [N, k + 1, V] policy probabilities at the k draft positions and the bonus position;
    q: [N, k, V] the distributions the drafts were sampled from; drafts: [N, k].
    Returns [N, k + 1] tokens: the accepted drafts, then one token from max(0, p - q) at the first
    rejection (from p at the bonus position when none is rejected); positions after that repeat
    drafts, which the engine never reads (its check stops at the first mismatch: the residual
    token never equals the rejected draft, whose p < q leaves it no residual mass)."""
    num_requests, k = drafts.shape
    rows = torch.arange(num_requests, device=p.device)
    p_of_draft = p[:, :k].gather(2, drafts[..., None]).squeeze(2)
    q_of_draft = q.gather(2, drafts[..., None]).squeeze(2)
    uniform = torch.rand(num_requests, k, generator=generator, device=p.device)
    rejected_so_far = (uniform * q_of_draft >= p_of_draft).cumsum(dim=1) > 0
    first_rejection = (~rejected_so_far).sum(dim=1)  # k when every draft is accepted
    corrections = torch.cat([(p[:, :k] - q).clamp(min=0), p[:, k:]], dim=1)
    correction = torch.multinomial(corrections[rows, first_rejection], 1, generator=generator).view(-1)
    tokens = torch.cat([drafts, drafts[:, :1]], dim=1)
    tokens[rows, first_rejection] = correction
    return tokens


class RejectionSamplingController(VerificationHooks):
    """megatron's controller, recording the distribution each draft is sampled from and
    verifying drafts by rejection sampling. The release's hooks for the verification rows and
    its sampling distribution are probed (:mod:`engine_probes`) and reached through
    :class:`controller_hooks.VerificationHooks`: the backend's ``log_probs_kernel`` or
    :func:`engine_access.sampling_log_probs` with the rollout's sampling parameters, where a probe
    finds the release's sampler drawing exactly from it (once per process)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._native_log_probs = engine_probes.native_log_probs(self)
        if self._native_log_probs is None:
            agrees, reason = engine_probes.release_sampler_agrees(self)
            if not agrees:
                from nemo_rl_mtp.megatron_compat.engine_release import megatron_release

                raise RuntimeError(
                    f"policy.generation.spec_verification=rejection_sampling: {megatron_release()}'s sampling backend has "
                    f"no log_probs_kernel and {reason}; set policy.generation.spec_verification=exact_match"
                )
            logger.info("rejection sampling: the sampling distribution written out (no log_probs_kernel): %s", reason)
        self.request_sampling = None
        self.greedy_only = None  # every request of the rollout greedy (top-k 1); None before one is added
        self._draft_request_ids = None
        self._draft_tokens: list[torch.Tensor] = []
        self._draft_probs: list[torch.Tensor] = []

    def note_request_sampling(self, sampling_params) -> None:
        """A request's sampling parameters, as added to the engine (before a rollout: None). The
        written-out distribution serves one set of parameters per rollout."""
        params = (float(sampling_params.temperature), int(sampling_params.top_k), float(sampling_params.top_p))
        if self._native_log_probs is None and self.request_sampling not in (None, params):
            raise ValueError(
                "rejection sampling without the sampling backend's log_probs_kernel serves one (temperature, top_k, "
                f"top_p) per rollout; got {self.request_sampling} and {params}"
            )
        self.request_sampling = params
        self.greedy_only = params[1] == 1 and self.greedy_only is not False

    def forget_request_sampling(self) -> None:
        """Before a rollout: no request's parameters noted yet."""
        self.request_sampling = None
        self.greedy_only = None

    def sampling_probs(self, logits: torch.Tensor, token_to_request_index: torch.Tensor | None = None) -> torch.Tensor:
        """[N, V]: the distribution megatron's sampler draws each row of ``logits`` [N, V] from
        (temperature, top-k, top-p of the row's request)."""
        if self._native_log_probs is not None:
            context = self.inference_wrapped_model.inference_context
            return self._native_log_probs(logits, context, token_to_request_index=token_to_request_index).exp()
        return engine_access.sampling_log_probs(logits, *self.request_sampling).exp()

    def draft_round(self, megatron_round) -> None:
        context = self.inference_wrapped_model.inference_context
        self._draft_request_ids = context.request_ids[context.paused_request_count : context.total_request_count].clone()
        self._draft_tokens, self._draft_probs = [], []
        super().draft_round(megatron_round)

    def sample_drafts(self, logits_2d: torch.Tensor) -> torch.Tensor:
        """One depth of drafts ([active requests]), drawn from q, megatron's sampling distribution
        of the logits (temperature, top-k, top-p), which is recorded; greedy: the argmax."""
        if self.greedy_only:
            tokens = logits_2d.argmax(dim=-1)
            self._draft_tokens.append(tokens)
            return tokens
        probs = self.sampling_probs(logits_2d)
        tokens = torch.multinomial(probs, 1, generator=self.sampling_rng).view(-1)
        self._draft_tokens.append(tokens)
        self._draft_probs.append(probs)
        return tokens

    def drafts_of_decode_requests(self, num_decode: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [D, k] and their distributions [D, k, V] (None when greedy) of the first ``num_decode`` active
        requests, found by request id (the engine reorders requests between steps). The check
        that every one has drafts is asserted on the device: no host synchronisation."""
        context = self.inference_wrapped_model.inference_context
        active_ids = context.request_ids[context.paused_request_count : context.total_request_count][:num_decode]
        matches = active_ids.to(self._draft_request_ids.device)[:, None] == self._draft_request_ids[None, :]
        torch._assert_async(matches.any(dim=1).all(), "rejection sampling: a decode request has no recorded MTP drafts")
        where = matches.int().argmax(dim=1)
        drafts = torch.stack(self._draft_tokens, dim=1)[where]
        probs = torch.stack(self._draft_probs, dim=1)[where] if self._draft_probs else None
        return drafts, probs

    def verification_rows(self, logits: torch.Tensor, num_decode: int, num_prefill: int) -> torch.Tensor:
        """Tokens for the verification rows ``logits`` [D * (k + 1) + P, V] (decode requests' k + 1
        rows each, then prefill requests' one): decode requests' rows by rejection sampling,
        prefill requests' from p; greedy: every row's argmax."""
        if self.greedy_only:
            return logits.argmax(dim=-1)
        k = self.num_speculative_tokens
        decode_rows = num_decode * (k + 1)
        request_of_row = torch.cat(
            [torch.arange(num_decode).repeat_interleave(k + 1), torch.arange(num_decode, num_decode + num_prefill)]
        )
        p = self.sampling_probs(logits, token_to_request_index=request_of_row)
        parts = []
        if num_decode:
            drafts, q = self.drafts_of_decode_requests(num_decode)
            p_decode = p[:decode_rows].view(num_decode, k + 1, -1)
            parts.append(rejection_sample(p_decode, q, drafts.to(p.device), self.sampling_rng).view(-1))
        if num_prefill:
            parts.append(torch.multinomial(p[decode_rows:], 1, generator=self.sampling_rng).view(-1))
        return torch.cat(parts)

    def before_verifying_drafts(self, input_tokens_required: torch.Tensor, num_decode_requests: int) -> None:
        """Assert (on the device) that the drafts the engine's equality check verifies are the
        ones rejection sampling judged. A greedy rollout's verification judges none (its rows are
        the argmax, whatever the drafts): nothing to check, and a batch-1 step saves its ~45 us."""
        if num_decode_requests and not self.greedy_only:
            stride = self.num_speculative_tokens + 1
            verified = input_tokens_required.reshape(-1)[: num_decode_requests * stride].view(num_decode_requests, stride)[:, 1:]
            recorded, _ = self.drafts_of_decode_requests(num_decode_requests)
            torch._assert_async(
                (verified == recorded.to(verified.device)).all(),
                "rejection sampling: the drafts in the engine's input are not the recorded ones",
            )
