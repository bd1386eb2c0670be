"""A request whose accepted draft is the end of sequence ends there (megatron-core ends a request
only on a *sampled* end token, so it used to keep decoding and drafting past an accepted one):
the edit of megatron's verification result on hand-made steps, then the real engine, greedy, with
heads trained until they draft the end of sequence right: same responses as without speculation,
and counts with no drafts after the end (the counts vLLM keeps), where the engine without the fix
counted extra ones."""

from __future__ import annotations

import pytest
import torch

from tests.support.engine_cases import skip_module_without_speculation

skip_module_without_speculation()

from nemo_rl_mtp.megatron_compat import controller_hooks  # noqa: E402
from nemo_rl_mtp.rollout.engine import RolloutEngine  # noqa: E402
from tests.support.engine_cases import SIZES, TOKENIZER, engine_overrides  # noqa: E402
from tests.support.helpers import expected_draft_counts, tiny_config  # noqa: E402
from nemo_rl_mtp.megatron_compat.engine_release import megatron_release  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("megatron_world"),
    pytest.mark.skipif(
        not controller_hooks.ends_at_accepted_end_of_sequence(),
        reason=f"{megatron_release()}: its requests are not ended at an accepted end-of-sequence draft (shown from 0.18 on)",
    ),
]

EOS = TOKENIZER.eos_id
# A digit as the end token, which the policy does not repeat after itself (count_up counts on).
DIGIT_END = TOKENIZER.first_digit_id + 5
GREEDY = {"generation__top_k": 1}
_DRAW = torch.Generator().manual_seed(7)
# 2-3 random digits: count_up answers as many digits, then the end of sequence.
PROMPTS = [TOKENIZER.encode_prompt(torch.randint(0, 10, (2 + i % 2,), generator=_DRAW).tolist()) for i in range(24)]


def test_an_accepted_end_of_sequence_draft_becomes_the_steps_sampled_token():
    """k = 2; three decode requests and a prefill one, laid out as megatron's check returns them."""
    # request 0: draft 1 is the end, accepted; 1: draft 2 is the end, accepted; 2: draft 1 is the
    # end, rejected; 3: its end token is -1 (none), so an accepted end token is just a token.
    tokens = torch.tensor([4, EOS, 6, 4, 5, EOS, 4, EOS, EOS, 4, EOS, 5, 9])
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    last = torch.tensor([1, 5, 6, 11, 12])
    ended = controller_hooks.end_at_accepted_end_of_sequence(last, mask, tokens, 4, 2, torch.tensor([EOS, EOS, EOS, -1]))
    assert ended.tolist() == [1, 2, 0, 0]
    # the row before the end draft is the one whose sample (the end draft itself) the step keeps
    assert last.tolist() == [0, 4, 6, 11, 12]
    assert mask.int().tolist() == [1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1]


def _engine(policy, k: int, verification: str = "exact_match") -> RolloutEngine:
    """Room for 12 tokens: a request that did not end at its accepted end draft has budget left to
    decode past it (with SIZES' 5, count_up's answers of 2-3 digits and the end hit the budget)."""
    sizes = {**SIZES, "generation__max_new_tokens": 12}
    overrides = engine_overrides(k, **sizes, **GREEDY, generation__spec_verification=verification)
    return RolloutEngine(policy, tiny_config(**overrides).policy)


@pytest.fixture
def ends(monkeypatch):
    """Per verified step, where each decode request ended at an accepted end draft (0: did not)."""
    records = []
    edit = controller_hooks.end_at_accepted_end_of_sequence

    def recorded(*args):
        records.append(edit(*args).clone())
        return records[-1]

    monkeypatch.setattr(controller_hooks, "end_at_accepted_end_of_sequence", recorded)
    return records


def _without_the_fix(monkeypatch) -> None:
    """megatron's verification as released: nothing edited, nothing ends at a draft."""
    monkeypatch.setattr(
        controller_hooks,
        "end_at_accepted_end_of_sequence",
        lambda last_one_indices, *rest: torch.zeros(rest[2], dtype=torch.long, device=last_one_indices.device),
    )


def _generate(engine: RolloutEngine, end: int) -> dict[str, torch.Tensor]:
    return engine.generate(PROMPTS, end, TOKENIZER.pad_id, 0)


@pytest.mark.parametrize("end", [EOS, DIGIT_END], ids=["eos", "digit"])
def test_greedy_requests_end_at_an_accepted_end_draft_and_count_only_drafts_inside_the_response(trained_policy, ends, end):
    """One draft per step: the responses are the greedy ones without speculation; the counts are
    exactly the drafts inside the responses, the end draft accepted (replayed from the training
    forward: ``expected_draft_counts``)."""
    plain = _generate(_engine(trained_policy, 0), end)
    fixed = _generate(_engine(trained_policy, 1), end)
    assert sum(int((step > 0).sum()) for step in ends) > 0, "no accepted end draft: the heads are too weak for the test to bite"
    assert torch.equal(fixed["tokens"], plain["tokens"]) and torch.equal(fixed["lengths"], plain["lengths"])
    assert (int(fixed["draft_proposed"][0]), int(fixed["draft_accepted"][0])) == expected_draft_counts(trained_policy, fixed)


def test_control_without_the_fix_requests_decode_and_draft_past_an_accepted_end(trained_policy, ends, monkeypatch):
    """Control: megatron's verification as released, one draft per step, the end a digit (which
    the policy does not repeat: after an accepted end-of-sequence draft the trained policy samples
    the end again, ending the request in the same step either way). Same responses, but more drafts
    proposed than the responses hold, at least one more per request that passed an accepted end;
    the fix proposes exactly those inside."""
    fixed = _generate(_engine(trained_policy, 1), DIGIT_END)
    ended = sum(int((step > 0).sum()) for step in ends)
    assert ended > 0
    _without_the_fix(monkeypatch)
    released = _generate(_engine(trained_policy, 1), DIGIT_END)
    assert torch.equal(released["tokens"], fixed["tokens"])
    inside = expected_draft_counts(trained_policy, released)[0]
    print(f"{ended} requests ended at an accepted end draft; drafts proposed: {inside} inside the responses, "
          f"{int(fixed['draft_proposed'][0])} with the fix, {int(released['draft_proposed'][0])} without")
    assert int(fixed["draft_proposed"][0]) == inside
    assert int(released["draft_proposed"][0]) >= inside + ended


@pytest.mark.parametrize("verification", ["exact_match", "rejection_sampling"])
def test_with_two_drafts_no_draft_is_counted_after_an_accepted_end(trained_policy, ends, monkeypatch, verification):
    """k = 2, greedy: the same responses as without speculation; a request ending at draft 1
    proposes no draft 2 there, so position 2 is proposed fewer times than position 1 by exactly
    those; without the fix both positions are proposed once per decode step, more often."""
    plain = _generate(_engine(trained_policy, 0), DIGIT_END)
    fixed = _generate(_engine(trained_policy, 2, verification), DIGIT_END)
    assert torch.equal(fixed["tokens"], plain["tokens"]) and torch.equal(fixed["lengths"], plain["lengths"])
    at_first = sum(int((step == 1).sum()) for step in ends)
    assert at_first > 0 and sum(int((step == 2).sum()) for step in ends) > 0
    proposed = fixed["draft_proposed"]
    assert int(proposed[0] - proposed[1]) == at_first

    _without_the_fix(monkeypatch)
    released = _generate(_engine(trained_policy, 2, verification), DIGIT_END)
    assert torch.equal(released["tokens"], plain["tokens"])
    assert released["draft_proposed"][0] == released["draft_proposed"][1]
    assert int(released["draft_proposed"][0]) > int(proposed[0])
