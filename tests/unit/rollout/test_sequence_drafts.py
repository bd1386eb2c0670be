"""MTP drafts from each request's own sequence (from the MTP depths' KV caches, or rerun over the
whole sequence), checked against megatron's training forward on the real engine (CPU): the
drafts' logits, their independence from the batch, and the engine's acceptance counts."""

from __future__ import annotations

import pytest

from tests.support.release_gates import on_this_release
from tests.support.engine_cases import skip_module_without_speculation

skip_module_without_speculation()

import torch  # noqa: E402

from nemo_rl_mtp.rollout import incremental_drafts  # noqa: E402
from nemo_rl_mtp.rollout import sequence_drafts  # noqa: E402
from nemo_rl_mtp.rollout.engine import RolloutEngine  # noqa: E402
from nemo_rl_mtp.training.module_modes import eval_mode  # noqa: E402
from tests.support.helpers import eval_forward_logits, expected_draft_counts, make_policy, response_mask, tiny_config  # noqa: E402
from tests.support.engine_cases import PROMPTS, SIZES, TOKENIZER, engine_overrides, generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_world")

GREEDY = {"generation__top_k": 1}
_DRAW = torch.Generator().manual_seed(7)
# Prompts the trained heads have not seen as such: 2-3 random digits.
VARIED_PROMPTS = [TOKENIZER.encode_prompt(torch.randint(0, 10, (2 + i % 2,), generator=_DRAW).tolist()) for i in range(24)]


DRAFT_CONTEXTS = ["incremental", "sequence"]


def _drafting_positions(drafter) -> list[int]:
    """Per request of the round, the position of the hidden state it drafts from."""
    if isinstance(drafter, sequence_drafts.SequenceDrafts):
        return drafter._round["last"].tolist()
    return (drafter._round["verified"] - 1).tolist()


@pytest.fixture
def recorded_drafts(monkeypatch):
    """Every draft's logits, keyed by (request id, position of the hidden state it drafts from,
    depth), as the drafters hand them to the engine."""
    records = {}

    def recording(draft_step):
        def draft_step_recorded(self, next_token_ids, depth):
            last_hidden, logits = draft_step(self, next_token_ids, depth)
            for row, (request_id, position) in enumerate(zip(self._round["request_ids"], _drafting_positions(self))):
                records[(int(request_id), position, depth)] = logits[row, 0].clone()
            return last_hidden, logits

        return draft_step_recorded

    for drafter in (sequence_drafts.SequenceDrafts, incremental_drafts.IncrementalDrafts):
        monkeypatch.setattr(drafter, "draft_step", recording(drafter.draft_step))
    return records


def training_mtp_logits(policy, rollouts) -> list[torch.Tensor]:
    """Per MTP depth, logits [B, S, V] of megatron's forward over the finished sequences."""
    return eval_forward_logits(policy, rollouts["tokens"], response_mask(rollouts))[1]


@pytest.mark.parametrize("draft_context", DRAFT_CONTEXTS)
def test_drafts_equal_the_training_forward_of_the_mtp_heads_at_their_position(trained_policy, recorded_drafts, draft_context):
    """Depth d drafting from the hidden state at position j is training's depth-d prediction at
    j. Depth 1 reads the depth-0 draft where training reads the real token, so it is compared
    where the two agree (heads trained, so that they often do)."""
    cfg = tiny_config(**engine_overrides(2, **SIZES, **GREEDY, generation__draft_context=draft_context)).policy
    rollouts = generate(RolloutEngine(trained_policy, cfg), VARIED_PROMPTS)
    reference = training_mtp_logits(trained_policy, rollouts)
    compared = [0, 0]
    for (request, position, depth), logits in recorded_drafts.items():
        if position + 2 + depth >= rollouts["lengths"][request]:
            continue  # drafted past the end of the response: never verified
        if depth == 1 and recorded_drafts[(request, position, 0)].argmax() != rollouts["tokens"][request, position + 2]:
            continue
        torch.testing.assert_close(logits, reference[depth][request, position], rtol=0, atol=1e-5)
        compared[depth] += 1
    print(f"drafts compared per depth: {compared}")
    assert compared[0] >= 20 and compared[1] >= 10, compared


@pytest.mark.parametrize("draft_context", DRAFT_CONTEXTS)
def test_a_requests_drafts_do_not_depend_on_the_other_requests_of_the_batch(recorded_drafts, draft_context):
    """Each prompt alone, then all in one batch: the same drafts at the same positions."""
    policy, cfg = make_policy(**engine_overrides(2, **GREEDY, generation__draft_context=draft_context))
    engine = RolloutEngine(policy, cfg)
    alone = {}
    for index, prompt in enumerate(PROMPTS[:4]):
        generate(engine, [prompt])
        alone.update({(index, position, depth): logits for (_, position, depth), logits in recorded_drafts.items()})
        recorded_drafts.clear()
    generate(engine, PROMPTS[:4])
    assert recorded_drafts.keys() == alone.keys() and len(alone) > 20
    worst = max(float((recorded_drafts[key] - alone[key]).abs().max()) for key in alone)
    assert worst <= 1e-6, worst


def upstream_draft_step_misses_context(policy) -> bool:
    """Probe of megatron's defect that ``single_position`` keeps: its serial draft step
    (``compute_mtp_single_step``) runs the MTP layer on the drafting position alone, so a draft
    differs from the training forward's MTP output wherever there is context to attend to.

    Megatron's draft step and its training forward are fed the same hidden states (the MTP block's
    input) and tokens. At position 0 there is nothing to miss (and the rotary embedding is the
    identity), so the two must agree there, which checks the probe itself; the defect is their
    disagreement at the last position. An upstream fix (the draft step given the request's
    context) makes them agree there too."""
    model = policy.model.module
    tokens = torch.tensor([[3, 5, 7, 9, 11, 13, 15, 17]])
    captured = {}
    hook = model.mtp.register_forward_pre_hook(lambda module, args, kwargs: captured.update(hidden=kwargs["hidden_states"]), with_kwargs=True)
    try:
        training = eval_forward_logits(policy, tokens, torch.ones_like(tokens))[1][0][0]  # depth 1: [S, V]
    finally:
        hook.remove()

    def drafted(position: int) -> torch.Tensor:
        with eval_mode(model):
            _, logits = model.compute_mtp_single_step(
                hidden_states=captured["hidden"][position : position + 1],
                next_token_ids=tokens[:, position + 1 : position + 2],
                position_ids=torch.tensor([[position + 1]]),
                depth=0,
            )
        return logits[0, 0].float()

    torch.testing.assert_close(drafted(0), training[0].float(), rtol=0, atol=1e-4, msg="the probe's plumbing")
    last = tokens.shape[1] - 2
    return not torch.allclose(drafted(last), training[last].float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("draft_context", DRAFT_CONTEXTS)
def test_greedy_rollout_acceptance_is_the_training_top1_acceptance_of_the_heads(trained_policy, draft_context):
    """Heads trained until drafts are often right: the engine's proposed and accepted counts equal
    those replayed from the training forward's top-1 predictions."""
    measured, expected = _acceptance_against_training(trained_policy, draft_context)
    assert measured == expected


def test_megatrons_draft_step_misses_training_acceptance_while_upstream_lacks_context(trained_policy):
    """Control: megatron's own draft step (single_position) misses the counts training predicts,
    because its drafts see no context; gated on the probe of that defect, so an upstream fix
    skips this control, saying so, rather than failing the suite."""
    if not upstream_draft_step_misses_context(trained_policy):
        pytest.skip(on_this_release("megatron's draft step sees the request's context (upstream fixed): single_position is no longer a control"))
    measured, expected = _acceptance_against_training(trained_policy, "single_position")
    assert measured != expected


def _acceptance_against_training(policy, draft_context: str) -> tuple[tuple[int, int], tuple[int, int]]:
    cfg = tiny_config(**engine_overrides(1, **SIZES, **GREEDY, generation__draft_context=draft_context)).policy
    rollouts = generate(RolloutEngine(policy, cfg), VARIED_PROMPTS)
    measured = (int(rollouts["draft_proposed"][0]), int(rollouts["draft_accepted"][0]))
    expected = expected_draft_counts(policy, rollouts)
    print(f"{draft_context}: engine proposed/accepted {measured}, replayed from training {expected}")
    assert expected[1] > 0.5 * expected[0], f"{expected}: heads too weak for the test to bite"
    return measured, expected

