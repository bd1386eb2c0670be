"""The trainer-side forecast of rollout acceptance (``mtp/mtp_{i}_expected_acceptance``) on a real
megatron-core training step (CPU), against an overlap computed position by position from megatron's
forward. Microbatch and packing invariance are covered with every other step metric in
test_mtp_training_step.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import eval_forward_logits, make_batch, make_policy
from tests.unit.training.test_mtp_training_step import PG_LOSS, RAGGED_RESPONSES, run_step

pytestmark = pytest.mark.usefixtures("megatron_world")


def reference_forecast(policy, batch, temperature: float) -> list[tuple[float, int]]:
    """Per depth k (0-based): mean over the response tokens t of valid samples that a rollout
    drafts at depth k, those after the first k + 1 response tokens (the policy samples those
    itself), of sum_x min(p(x), q(x)), p the policy's softmax at t - 1 and q depth k's at
    t - 2 - k, both at ``temperature`` over the tokenizer's ids; and the number of such targets."""
    logits, mtp_logits = eval_forward_logits(policy, batch["input_ids"], batch["token_mask"])
    vocab = policy.vocab_size
    first_response = batch["token_mask"].argmax(dim=1)
    results = []
    for depth, draft_logits in enumerate(mtp_logits):
        overlaps = []
        for row, target in (batch["token_mask"] * batch["sample_mask"][:, None]).nonzero().tolist():
            if target < first_response[row] + depth + 1:
                continue
            p = torch.softmax(logits[row, target - 1, :vocab] / temperature, dim=-1)
            q = torch.softmax(draft_logits[row, target - 2 - depth, :vocab] / temperature, dim=-1)
            overlaps.append(float(torch.minimum(p, q).sum()))
        results.append((100.0 * sum(overlaps) / len(overlaps), len(overlaps)))
    return results


@pytest.mark.parametrize("mtp_num_layers, temperature", [(1, 1.0), (2, 0.7)])
def test_forecast_is_the_mean_overlap_of_policy_and_head_over_the_mtp_targets(mtp_num_layers, temperature):
    batch = make_batch(RAGGED_RESPONSES, prompt_length=3, sample_mask=[1, 1, 1, 0, 1, 1, 1, 1])
    policy, cfg = make_policy(
        megatron_cfg__mtp_num_layers=mtp_num_layers,
        train_micro_batch_size=4,
        train_global_batch_size=8,
        generation__temperature=temperature,
    )
    expected = reference_forecast(policy, batch, temperature)
    metrics, _ = run_step(policy, cfg, batch, PG_LOSS)
    response_tokens = sum(length for length, valid in zip(RAGGED_RESPONSES, batch["sample_mask"]) if valid)
    for depth, (forecast, targets) in enumerate(expected, start=1):
        assert metrics[f"mtp/mtp_{depth}_expected_acceptance"] == pytest.approx(forecast, abs=1e-4)
        # megatron's MTP loss also trains the first `depth` response tokens, which no draft targets.
        assert metrics[f"mtp/mtp_{depth}_target_tokens"] == response_tokens > targets
    assert 0 < expected[0][0] < 100
