"""Which tokens the losses average over, on real megatron-core (CPU): the sequence-level loss
(``loss_fn.token_level_loss: false``) with attached MTP heads, and the MTP loss mask policy
(``policy.mtp_loss_mask_policy``)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

from nemo_rl_mtp.training.losses import loss_sample_weights
from nemo_rl_mtp.training.logprobs import compute_logprobs
from tests.support.helpers import make_batch, make_policy
from tests.unit.training.test_mtp_training_step import (
    PG_LOSS,
    RAGGED_RESPONSES,
    assert_same_gradients,
    reference_mtp_loss,
    run_step,
    zero_policy_loss,
)

pytestmark = pytest.mark.usefixtures("megatron_world")

SAMPLE_MASK = [1, 1, 0, 1, 1, 1, 1, 1]


def _sequence_level(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**batch, "sample_mask": loss_sample_weights(batch["token_mask"], batch["sample_mask"], token_level_loss=False)}


def test_sequence_level_policy_loss_is_the_mean_over_samples_of_their_token_means():
    """At ratio 1 each sample's token mean of -advantage is -advantage: the sequence-level loss is
    minus the mean advantage over valid samples, whatever their lengths; the token-level one
    weighs samples by length."""
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    valid = torch.tensor(SAMPLE_MASK, dtype=torch.bool)
    advantage = batch["advantages"][:, 0]
    lengths = torch.tensor(RAGGED_RESPONSES, dtype=torch.float)
    for weighted, expected in (
        (_sequence_level(batch), -advantage[valid].mean()),
        (batch, -(advantage * lengths)[valid].sum() / lengths[valid].sum()),
    ):
        policy, cfg = make_policy(megatron_cfg__mtp_num_layers=1, train_micro_batch_size=2, train_global_batch_size=8)
        weighted = {**weighted, "prev_logprobs": compute_logprobs(policy, weighted, cfg)}
        metrics, _ = run_step(policy, cfg, weighted, PG_LOSS)
        assert metrics["loss"] == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("mtp_num_layers", [1, 2])
def test_sequence_level_mtp_gradient_equals_independent_reference(mtp_num_layers):
    """Each valid sample's MTP cross-entropies weighted 1 / (its response tokens), summed and
    divided by the number of valid samples: the weights are written out here from the response
    lengths the batch was built with."""
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    policy, cfg = make_policy(
        megatron_cfg__mtp_num_layers=mtp_num_layers,
        megatron_cfg__mtp_loss_scaling_factor=0.3,
        megatron_cfg__mtp_loss_type="cross_entropy",  # the reference is megatron's loss
        train_micro_batch_size=2,
        train_global_batch_size=8,
    )
    _, step_grads = run_step(policy, cfg, _sequence_level(batch), zero_policy_loss)

    by_hand = {**batch, "sample_mask": torch.tensor([mask / length for mask, length in zip(SAMPLE_MASK, RAGGED_RESPONSES)])}
    MTPLossAutoScaler.set_loss_scale(torch.zeros(1))
    reference = reference_mtp_loss(policy, by_hand, mtp_num_layers, 0.3)
    MTPLossLoggingHelper.tracker.clear()
    params = dict(policy.model.module.named_parameters())
    reference_grads = torch.autograd.grad(reference, list(params.values()), allow_unused=True)
    for (name, _), reference_grad in zip(params.items(), reference_grads):
        if reference_grad is not None:
            torch.testing.assert_close(step_grads[name], reference_grad, rtol=2e-4, atol=1e-7, msg=name)
    token_level = run_step(*make_policy(
        megatron_cfg__mtp_num_layers=mtp_num_layers, megatron_cfg__mtp_loss_scaling_factor=0.3, train_micro_batch_size=2, train_global_batch_size=8
    ), batch, zero_policy_loss)[1]
    assert not torch.allclose(token_level["mtp.layers.0.eh_proj.weight"], step_grads["mtp.layers.0.eh_proj.weight"])


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_one_vs_four_microbatches_give_the_same_step_at_either_loss_level(token_level_loss):
    batch = make_batch(RAGGED_RESPONSES, sample_mask=SAMPLE_MASK)
    batch["sample_mask"] = loss_sample_weights(batch["token_mask"], batch["sample_mask"], token_level_loss)
    results = []
    for micro_batch_size in (8, 2):
        policy, cfg = make_policy(megatron_cfg__mtp_num_layers=2, train_micro_batch_size=micro_batch_size, train_global_batch_size=8)
        results.append(run_step(policy, cfg, batch, PG_LOSS))
    (metrics_one, grads_one), (metrics_four, grads_four) = results
    assert_same_gradients(grads_one, grads_four)
    for key in metrics_one:
        if key.endswith("_loss") and key.startswith("mtp/mtp_"):
            continue  # megatron logs the mean over microbatches of each microbatch's mean
        assert metrics_four[key] == pytest.approx(metrics_one[key], rel=1e-4, abs=1e-6), key


def test_positive_advantage_policy_trains_the_heads_on_positive_samples_only():
    """MTP gradients under ``positive_advantage`` equal those of ``all_responses`` on the same
    batch with every sample of non-positive advantage masked out (policy loss off), and differ
    from ``all_responses`` on the whole batch."""
    batch = make_batch(RAGGED_RESPONSES)
    positive = (batch["advantages"][:, 0] > 0).float()
    assert 0 < positive.sum() < len(RAGGED_RESPONSES)
    gradients = {}
    for name, rows, mask_policy in (
        ("gated", batch, "positive_advantage"),
        ("masked by hand", {**batch, "sample_mask": positive}, "all_responses"),
        ("all", batch, "all_responses"),
    ):
        policy, cfg = make_policy(megatron_cfg__mtp_num_layers=2, mtp_loss_mask_policy=mask_policy, train_micro_batch_size=4, train_global_batch_size=8)
        metrics, gradients[name] = run_step(policy, cfg, rows, zero_policy_loss)
        trained_samples = torch.ones_like(positive) if name == "all" else positive
        assert metrics["mtp/global_valid_tokens"] == float((rows["token_mask"][:, 1:] * trained_samples[:, None]).sum())
    assert_same_gradients(gradients["gated"], gradients["masked by hand"])
    assert not torch.allclose(gradients["gated"]["mtp.layers.0.eh_proj.weight"], gradients["all"]["mtp.layers.0.eh_proj.weight"])
