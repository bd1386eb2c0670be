"""The imitation warm start runs GRPO's training step: the same metrics (MTP ones as ``mtp/...``),
the same per-step MTP guard, megatron's MTP tracker emptied by the step itself."""

from __future__ import annotations

import pytest
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from nemo_rl_mtp.training.imitation import imitation_step
from nemo_rl_mtp.cluster.worker import MegatronPolicyWorker
from tests.support.helpers import make_batch, make_policy
from tests.unit.training.test_mtp_training_step import PG_LOSS, RAGGED_RESPONSES

pytestmark = pytest.mark.usefixtures("megatron_world")

POLICY = dict(megatron_cfg__mtp_num_layers=2, train_micro_batch_size=4, train_global_batch_size=8)


def test_imitation_and_grpo_steps_report_one_metrics_contract():
    worker = MegatronPolicyWorker.__new__(MegatronPolicyWorker)
    worker.policy, worker.policy_cfg = make_policy(**POLICY)
    grpo = worker.train(make_batch(RAGGED_RESPONSES), PG_LOSS)
    assert MTPLossLoggingHelper.tracker == {}
    imitation = imitation_step(worker.policy, make_batch(RAGGED_RESPONSES, seed=1), worker.policy_cfg)
    assert MTPLossLoggingHelper.tracker == {}
    assert imitation.keys() == grpo.keys()
    per_layer = {f"mtp/mtp_{layer}_{name}" for layer in (1, 2) for name in ("loss", "acceptance_rate", "target_tokens")}
    assert per_layer <= imitation.keys()
    assert not [key for key in imitation if key.startswith("mtp_")]  # no unprefixed MTP keys


def test_imitation_step_fails_the_mtp_guard_when_no_mtp_loss_is_tracked(monkeypatch):
    """megatron's tracking taken out (as on releases where RL mode silently skips the MTP loss):
    the warm start fails in one line, as a GRPO step does."""
    policy, cfg = make_policy(**POLICY)
    monkeypatch.setattr(MTPLossLoggingHelper, "save_metrics_to_tracker", staticmethod(lambda *args, **kwargs: None))
    with pytest.raises(RuntimeError, match="computed no MTP loss"):
        imitation_step(policy, make_batch(RAGGED_RESPONSES), cfg)
