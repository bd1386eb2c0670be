"""Drafts under the serving engines' position-0 convention (``mtp_zero_embedding_at_position_0``):
the rollout engine's MTP drafts, incremental and sequence, compute what the training forward
computes with the MTP embedding zeroed at position 0 (real engine, CPU), so the rollouts'
acceptance counts are those the trained convention predicts; control: the same weights' forward
without zeroing drafts something else."""

from __future__ import annotations

import pytest

from tests.support.engine_cases import skip_module_without_speculation

skip_module_without_speculation()

import torch  # noqa: E402

from nemo_rl_mtp.megatron_compat import mtp_position_zero  # noqa: E402
from nemo_rl_mtp.rollout.engine import RolloutEngine  # noqa: E402
from tests.support.engine_cases import PROMPTS, SIZES, engine_overrides, generate  # noqa: E402
from tests.support.helpers import make_policy, tiny_config, train_count_up  # noqa: E402
from tests.unit.rollout.test_incremental_drafts import MIXED_STEPS, _check, draft_gaps  # noqa: E402, F401
from tests.unit.rollout.test_sequence_drafts import (  # noqa: E402, F401
    DRAFT_CONTEXTS,
    GREEDY,
    VARIED_PROMPTS,
    _acceptance_against_training,
    recorded_drafts,
    training_mtp_logits,
)

pytestmark = pytest.mark.usefixtures("megatron_world")

ZEROED = {"megatron_cfg__mtp_zero_embedding_at_position_0": True}


@pytest.fixture(scope="module")
def trained_zeroing_policy(megatron_world):
    """Heads trained under the convention (imitation of count_up) until drafts are often right."""
    policy, cfg = make_policy(**engine_overrides(2, **SIZES), **ZEROED)
    assert mtp_position_zero.zeroes_position_0(policy.model.module)
    return train_count_up(policy, cfg)


def same_weights_without_zeroing(policy):
    twin, _ = make_policy(**engine_overrides(2, **SIZES))
    twin.model.module.load_state_dict(policy.model.module.state_dict())
    assert not mtp_position_zero.zeroes_position_0(twin.model.module)
    return twin


@pytest.mark.parametrize("draft_context", DRAFT_CONTEXTS)
def test_depth_1_drafts_equal_the_zeroed_training_forward_and_not_the_plain_one(trained_zeroing_policy, recorded_drafts, draft_context):
    """Depth 1 (the one vLLM serves) drafting from position j is the zeroed training forward's
    prediction at j, prompt positions included (the drafts over the prompt attend to position 0)."""
    cfg = tiny_config(**engine_overrides(2, **SIZES, **GREEDY, generation__draft_context=draft_context), **ZEROED).policy
    rollouts = generate(RolloutEngine(trained_zeroing_policy, cfg), VARIED_PROMPTS)
    reference = training_mtp_logits(trained_zeroing_policy, rollouts)[0]
    plain = training_mtp_logits(same_weights_without_zeroing(trained_zeroing_policy), rollouts)[0]
    compared, plain_gaps = 0, []
    for (request, position, depth), logits in recorded_drafts.items():
        if depth != 0 or position + 2 >= rollouts["lengths"][request]:
            continue
        torch.testing.assert_close(logits, reference[request, position], rtol=0, atol=1e-5)
        plain_gaps.append(float((logits - plain[request, position]).abs().max()))
        compared += 1
    assert compared >= 20, compared
    assert min(plain_gaps) > 1e-4, "every draft attends to position 0, so the plain forward differs at each"


@pytest.mark.parametrize("draft_context", DRAFT_CONTEXTS)
def test_greedy_rollout_acceptance_is_the_zeroed_training_top1_acceptance(trained_zeroing_policy, draft_context):
    """The engine's proposed and accepted counts equal those replayed from the training forward
    under the same convention: the rollouts' acceptance measures the served convention."""
    measured, expected = _acceptance_against_training(trained_zeroing_policy, draft_context)
    assert measured == expected


@pytest.mark.parametrize("mtp_num_layers, k", [(1, 1), (2, 2)], ids=["one layer", "two layers"])
def test_every_incremental_draft_equals_the_sequence_path_with_position_0_zeroed(draft_gaps, mtp_num_layers, k):
    """The incremental drafts' first round covers position 0 from the KV cache's start; through
    rejections (untrained heads, temperature 0.5) they stay the sequence path's."""
    policy, cfg = make_policy(**engine_overrides(k, mtp_num_layers, **MIXED_STEPS), generation__temperature=0.5, **ZEROED)
    _check(draft_gaps, generate(RolloutEngine(policy, cfg), PROMPTS * 2, seed=3), k)
