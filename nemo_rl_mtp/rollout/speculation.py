"""Speculative decoding with the policy's own MTP heads, as megatron-core's inference engine does
it, and the acceptance metrics of a rollout.

The path, step by step (all of it inside the engine, over the live training model):
  1. drafts        - after each verified step the MTP layers run serially from the last accepted
                     token: depth d proposes draft d + 1 from the token before it, sampled with the
                     request's sampling parameters (``num_speculative_tokens`` drafts per request;
                     a repeated MTP layer may propose more than it has layers). Each depth sees
                     the request's whole verified sequence, as in training: from its own KV cache
                     (``draft_context: incremental``, default, :mod:`incremental_drafts`) or by
                     rerunning over the sequence (``sequence``, :mod:`sequence_drafts`);
                     megatron's own step (``single_position``) sees the last position only
  2. verification  - the next forward pass runs the policy over [last token, drafts] at once.
                     ``spec_verification: rejection_sampling`` (default, :mod:`spec_verification`)
                     accepts draft x with probability min(1, p(x)/q(x)) and draws the token at the
                     first rejection from max(0, p - q); ``exact_match`` (megatron's own) accepts a
                     draft when it equals the policy's sample at its position. Either way the first
                     rejection ends the run and the output is what sampling without speculation
                     would draw.
  3. metrics       - per draft position i, drafts proposed and accepted (``speculation_counts``),
                     summed over data-parallel ranks (``Policy.generate``), logged as
                     ``rollout/...`` (``speculation_metrics``) next to the training-side
                     ``mtp_{i}_acceptance_rate``.

Verification by equality accepts a draft x with probability p(x) (p: policy, q: MTP head), so
acceptance at temperature > 0 is sum_x p(x) q(x); rejection sampling reaches sum_x min(p, q).
"""

from __future__ import annotations

import torch

from nemo_rl_mtp.config.checks import check_speculation_depth, speculative_tokens_limit
from nemo_rl_mtp.megatron_compat import engine_release
from nemo_rl_mtp.metrics import (
    ACCEPTED_DRAFTS_PER_DECODE_STEP,
    DRAFT_ACCEPTANCE_RATE,
    DRAFT_ACCEPTED,
    DRAFT_ACCEPTED_COUNTS,
    DRAFT_PROPOSED,
    DRAFT_PROPOSED_COUNTS,
    ENGINE_TOKENS_PER_S,
    EXPECTED_TOKENS_PER_S,
    NUM_SPECULATIVE_TOKENS,
    ROLLOUT,
    SPECULATIVE_TOKENS,
    TOKENS_PER_DECODE_STEP,
    in_scope,
)
from nemo_rl_mtp.megatron_compat.capabilities import check_speculation_release


def max_speculative_tokens(megatron_cfg) -> int | None:
    """The most drafts per step the installed engine accepts for this model: what the model's
    heads allow (``config.checks.speculative_tokens_limit``: ``mtp_num_layers``, unlimited (None)
    for a repeated MTP layer), capped where the engine has no speculative decoding (0) or drafts at
    most ``mtp_num_layers`` with a repeated layer (:mod:`engine_release`)."""
    if engine_release.speculation_missing() is not None:
        return 0
    limit = speculative_tokens_limit(megatron_cfg)
    if limit is None and engine_release.repeated_layer_depths_missing() is not None:
        return megatron_cfg.mtp_num_layers
    return limit


def check_speculation_supported(generation_cfg, megatron_cfg) -> None:
    """Raise ValueError (a ConfigError), one line naming the key, when the installed engine cannot
    speculate as configured: the release's half (``capabilities.check_speculation_release``) and
    the model's (``config.checks.check_speculation_depth``), each kept in its own room."""
    check_speculation_release(generation_cfg, megatron_cfg)
    check_speculation_depth(generation_cfg, megatron_cfg)


def speculation_counts(engine) -> dict[str, torch.Tensor]:
    """Drafts proposed and accepted per position ``[k]`` since the engine's last reset, as the
    controller counts them once per step (:class:`engine_bookkeeping.AcceptanceCounts`, megatron's
    rule: a decode request proposes at every position; draft i counts as accepted when the drafts
    before it were). ``[0]`` without speculation."""
    controller = engine.controller
    if not hasattr(controller, "acceptance_counts"):
        return {DRAFT_PROPOSED_COUNTS: torch.zeros(0, dtype=torch.int64), DRAFT_ACCEPTED_COUNTS: torch.zeros(0, dtype=torch.int64)}
    proposed, accepted = controller.acceptance_counts()
    return {DRAFT_PROPOSED_COUNTS: proposed.clone(), DRAFT_ACCEPTED_COUNTS: accepted.clone()}


def through_first_end(tokens: list[int], eos_id: int) -> list[int]:
    """A response's tokens through its first end-of-sequence token: accepted drafts may run past
    it within a step."""
    return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def speculation_metrics(counts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per draft position i (1-indexed): proposed, accepted, acceptance rate in percent; and the
    tokens a request gains per decode step (1 + accepted drafts). With ``auto``: the drafts per
    step it chose and the tokens/s it expected and the engine delivered. ``{}`` without
    speculation."""
    metrics = {}
    if SPECULATIVE_TOKENS in counts:
        metrics[in_scope(ROLLOUT, NUM_SPECULATIVE_TOKENS)] = float(counts[SPECULATIVE_TOKENS])
        metrics[in_scope(ROLLOUT, EXPECTED_TOKENS_PER_S)] = float(counts[EXPECTED_TOKENS_PER_S])
        metrics[in_scope(ROLLOUT, ENGINE_TOKENS_PER_S)] = float(counts[ENGINE_TOKENS_PER_S])
    proposed, accepted = counts[DRAFT_PROPOSED_COUNTS].double(), counts[DRAFT_ACCEPTED_COUNTS].double()
    if proposed.numel() == 0:
        return metrics
    for position, (num_proposed, num_accepted) in enumerate(zip(proposed.tolist(), accepted.tolist()), start=1):
        metrics[DRAFT_PROPOSED.under(ROLLOUT).key(position)] = num_proposed
        metrics[DRAFT_ACCEPTED.under(ROLLOUT).key(position)] = num_accepted
        metrics[DRAFT_ACCEPTANCE_RATE.under(ROLLOUT).key(position)] = 100.0 * num_accepted / max(num_proposed, 1.0)
    accepted_per_step = float(accepted.sum() / proposed[0].clamp(min=1))
    metrics[in_scope(ROLLOUT, ACCEPTED_DRAFTS_PER_DECODE_STEP)] = accepted_per_step
    metrics[in_scope(ROLLOUT, TOKENS_PER_DECODE_STEP)] = 1.0 + accepted_per_step
    return metrics
