"""MTP heads frozen for the GRPO steps (``policy.mtp_frozen_during_rl``) on real megatron-core
(CPU): no MTP gradient anywhere, no optimizer update of the MTP parameters even with Adam's
momentum from earlier steps, the metrics still logged; the warm start still trains them."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_mtp.training.checkpoint import save_policy
from nemo_rl_mtp.training.step import IMITATION, MTPTraining, forward_backward_global_batch, train_global_batch
from nemo_rl_mtp.cluster.worker import MegatronPolicyWorker
from tests.support.helpers import gradients, make_batch, make_policy
from tests.unit.training.test_mtp_training_step import PG_LOSS, RAGGED_RESPONSES

pytestmark = pytest.mark.usefixtures("megatron_world")

POLICY = dict(megatron_cfg__mtp_num_layers=2, train_micro_batch_size=2, train_global_batch_size=8)


def weights(policy) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in policy.model.module.named_parameters()}


def step(policy, cfg, batch, mtp=None):
    return train_global_batch(policy, batch, PG_LOSS, cfg, mtp)


@pytest.mark.parametrize("loss_type", ["cross_entropy", "total_variation"])
def test_frozen_heads_do_not_move_while_the_rest_trains(loss_type, tmp_path):
    policy, cfg = make_policy(mtp_frozen_during_rl=True, megatron_cfg__mtp_loss_type=loss_type, **POLICY)
    batch = make_batch(RAGGED_RESPONSES)
    warm = step(policy, cfg, batch, IMITATION)  # the warm start trains the heads and gives Adam momentum
    assert warm["mtp/grad_norm"] > 0
    before = weights(policy)
    metrics = step(policy, cfg, make_batch(RAGGED_RESPONSES, seed=1))
    after = weights(policy)
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and not any(name.startswith("mtp.") for name in moved), moved
    assert "output_layer.weight" in moved and "decoder.layers.0.mlp.linear_fc1.weight" in moved
    assert metrics["mtp/grad_norm"] == 0.0
    for key in ("mtp/mtp_1_loss", "mtp/mtp_2_acceptance_rate", "mtp/mtp_1_expected_acceptance", "mtp/mtp_2_expected_acceptance"):
        assert metrics[key] > 0, key
    # megatron's checkpoint keeps one optimizer step count for all parameters: a frozen step counts
    # for the heads too, and the run can still be saved.
    steps = {float(state["step"]) for state in policy.optimizer.optimizer.state.values()}
    assert steps == {2.0}, steps
    save_policy(policy, tmp_path / "step_000002")


def test_frozen_heads_send_no_gradient_anywhere():
    """Attached heads: the frozen step's gradients are bit for bit those of a step whose MTP loss
    weighs 0 (the MTP block then gets exact zeros too)."""
    batch = make_batch(RAGGED_RESPONSES, sample_mask=[1, 1, 0, 1, 1, 1, 1, 1])
    results = []
    for frozen, factor in ((True, 0.1), (False, 0.0)):
        policy, cfg = make_policy(megatron_cfg__mtp_loss_scaling_factor=factor, **POLICY)
        metrics = forward_backward_global_batch(policy, batch, PG_LOSS, cfg, MTPTraining("cross_entropy", frozen))
        results.append(gradients(policy))
    frozen_grads, zero_weight_grads = results
    for name, grad in frozen_grads.items():
        assert torch.equal(grad, zero_weight_grads[name]), name
        if name.startswith("mtp."):
            assert grad.abs().max() == 0, name


def test_worker_train_step_with_frozen_heads_passes_the_guard():
    """The worker's GRPO step: the guard that fails a step without MTP gradient knows frozen heads
    get none."""
    worker = MegatronPolicyWorker.__new__(MegatronPolicyWorker)
    worker.policy, worker.policy_cfg = make_policy(mtp_frozen_during_rl=True, **POLICY)
    metrics = worker.train(make_batch(RAGGED_RESPONSES), PG_LOSS)
    assert metrics["mtp/grad_norm"] == 0.0 and metrics["mtp/mtp_1_loss"] > 0
    assert torch.is_grad_enabled()
