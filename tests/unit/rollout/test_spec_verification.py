"""Rejection-sampling verification on fixed toy distributions: what it emits is distributed as
the policy, and it accepts sum_x min(p, q) of the drafts; exact match accepts sum_x p q."""

from __future__ import annotations

import math

import torch

from nemo_rl_mtp.rollout.verification import rejection_sample

SAMPLES = 200_000
# Four standard errors of a proportion estimated from SAMPLES draws (at most 0.5 / sqrt(n)).
TOLERANCE = 4 * 0.5 / math.sqrt(SAMPLES)


def _toy(k: int):
    """Policy p and draft distribution q over 4 tokens at each of k positions (+ bonus)."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]])[: k + 1]
    q = torch.tensor([[0.2, 0.2, 0.2, 0.4], [0.1, 0.6, 0.1, 0.2]])[:k]
    return p, q


def _run(k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    p, q = _toy(k)
    drafts = torch.stack([torch.multinomial(q[j], SAMPLES, replacement=True, generator=generator) for j in range(k)], dim=1)
    tokens = rejection_sample(p.expand(SAMPLES, -1, -1), q.expand(SAMPLES, -1, -1), drafts, generator)
    accepted = (tokens[:, :k] == drafts).int().cumprod(dim=1)
    return p, q, drafts, tokens, accepted


def test_first_draft_acceptance_is_the_overlap_of_p_and_q():
    p, q, _, _, accepted = _run(k=1)
    overlap = torch.minimum(p[0], q[0]).sum().item()  # 0.2 + 0.2 + 0.2 + 0.0 = 0.6
    exact_match = (p[0] * q[0]).sum().item()  # 0.1 + 0.06 + 0.04 = 0.2
    assert abs(accepted[:, 0].float().mean().item() - overlap) < TOLERANCE
    assert overlap > exact_match + 10 * TOLERANCE


def test_every_emitted_position_is_distributed_as_the_policy():
    """The first token (accepted draft or residual sample) and, where the first draft was
    accepted, the second follow p at their positions, whatever q is (k = 2)."""
    p, _, _, tokens, accepted = _run(k=2, seed=1)
    first = torch.bincount(tokens[:, 0], minlength=4).double() / SAMPLES
    assert torch.allclose(first, p[0].double(), atol=TOLERANCE)
    second = tokens[accepted[:, 0] == 1, 1]
    assert torch.allclose(torch.bincount(second, minlength=4).double() / second.numel(), p[1].double(), atol=2 * TOLERANCE)


def test_the_bonus_token_follows_the_policy_when_every_draft_is_accepted():
    p, _, _, tokens, accepted = _run(k=2, seed=2)
    all_accepted = accepted[:, 1] == 1
    bonus = tokens[all_accepted, 2]
    assert bonus.numel() > SAMPLES / 20
    assert torch.allclose(torch.bincount(bonus, minlength=4).double() / bonus.numel(), p[2].double(), atol=4 * TOLERANCE)


def test_a_rejected_draft_is_never_emitted_at_its_position():
    """So the engine's equality check stops exactly where rejection sampling did."""
    _, _, drafts, tokens, accepted = _run(k=2, seed=3)
    first_rejected = accepted[:, 0] == 0
    assert first_rejected.any()
    assert not (tokens[first_rejected, 0] == drafts[first_rejected, 0]).any()
