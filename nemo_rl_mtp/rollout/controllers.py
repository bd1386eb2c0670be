"""The text-generation controllers a speculative rollout engine runs, one class per combination of
draft source and verification, and the table that chooses one.

Each is megatron's ``TextGenerationController`` under :mod:`controller_hooks` (the only place its
private step methods are overridden), counting drafts per position once per step
(:class:`bookkeeping.AcceptanceCounts`), verifying by exact match (megatron's own check) or by
rejection sampling (:class:`verification.RejectionSamplingController`), and drafting with
megatron's own draft step or a drafter of ours that gives the heads the request's context: from
each request's sequence (:mod:`sequence_drafts`) or from the MTP depths' KV caches
(:mod:`incremental_drafts`). Bases are in method-resolution order: drafts, counts, verification.
Without speculation the engine runs megatron's controller itself.
"""

from __future__ import annotations

from nemo_rl_mtp.megatron_compat.controller_hooks import SpeculativeControllerHooks
from nemo_rl_mtp.rollout.bookkeeping import AcceptanceCounts
from nemo_rl_mtp.rollout.incremental_drafts import IncrementalDraftsController
from nemo_rl_mtp.rollout.sequence_drafts import SequenceDraftsController
from nemo_rl_mtp.rollout.verification import RejectionSamplingController

# Draft sources: megatron's own draft step (``single_position``, or an upstream step that sees the
# request's context), each request's sequence, the MTP depths' KV caches.
MEGATRON_DRAFTS, SEQUENCE_DRAFTS, INCREMENTAL_DRAFTS = "megatron", "sequence", "incremental"


class CountingExactMatchController(AcceptanceCounts, SpeculativeControllerHooks):
    """megatron's drafts and verification; drafts counted."""


class CountingRejectionSamplingController(AcceptanceCounts, RejectionSamplingController):
    """megatron's drafts, verified by rejection sampling; drafts counted."""


class SequenceDraftsExactMatchController(SequenceDraftsController, AcceptanceCounts, SpeculativeControllerHooks):
    """Drafts from each request's sequence, verified by megatron's exact match; drafts counted."""


class SequenceDraftsRejectionSamplingController(SequenceDraftsController, AcceptanceCounts, RejectionSamplingController):
    """Drafts from each request's sequence, verified by rejection sampling; drafts counted."""


class IncrementalDraftsExactMatchController(IncrementalDraftsController, AcceptanceCounts, SpeculativeControllerHooks):
    """Drafts from the MTP depths' KV caches, verified by megatron's exact match; drafts counted."""


class IncrementalDraftsRejectionSamplingController(IncrementalDraftsController, AcceptanceCounts, RejectionSamplingController):
    """Drafts from the MTP depths' KV caches, verified by rejection sampling; drafts counted."""


# (draft source, policy.generation.spec_verification) -> the controller that runs.
CONTROLLERS: dict[tuple[str, str], type] = {
    (MEGATRON_DRAFTS, "exact_match"): CountingExactMatchController,
    (MEGATRON_DRAFTS, "rejection_sampling"): CountingRejectionSamplingController,
    (SEQUENCE_DRAFTS, "exact_match"): SequenceDraftsExactMatchController,
    (SEQUENCE_DRAFTS, "rejection_sampling"): SequenceDraftsRejectionSamplingController,
    (INCREMENTAL_DRAFTS, "exact_match"): IncrementalDraftsExactMatchController,
    (INCREMENTAL_DRAFTS, "rejection_sampling"): IncrementalDraftsRejectionSamplingController,
}
