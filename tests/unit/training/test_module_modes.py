"""Passes that switch the model to eval mode (the logprobs pass; the routing pass of a step with
``global_batch_aux_loss``) leave each module in the mode they found it in, not in train mode."""

from __future__ import annotations

import pytest

from nemo_rl_mtp.training.logprobs import compute_logprobs
from nemo_rl_mtp.training.step import forward_backward_global_batch
from tests.support.helpers import make_batch, make_policy
from tests.support.release_gates import requires_config
from tests.unit.training.test_mtp_training_step import BALANCED_RESPONSES, PG_LOSS

pytestmark = pytest.mark.usefixtures("megatron_world")

MOE_GLOBAL_BATCH = {
    "megatron_cfg__num_moe_experts": 4,
    "megatron_cfg__moe_router_topk": 2,
    "megatron_cfg__moe_router_load_balancing_type": "global_batch_aux_loss",
    "megatron_cfg__mtp_num_layers": 1,
    "train_micro_batch_size": 4,
    "train_global_batch_size": 8,
}


def _modes(policy) -> dict[str, bool]:
    return {name: module.training for name, module in policy.model.named_modules()}


@requires_config(**MOE_GLOBAL_BATCH)
def test_eval_passes_restore_each_modules_mode():
    """A mixed state (the trunk in eval mode, the MTP block training) comes back unchanged from
    the logprobs pass and from a training step's routing pass (forcing train() would put the
    trunk in train mode, forcing eval() the MTP block in eval mode)."""
    policy, cfg = make_policy(**MOE_GLOBAL_BATCH)
    policy.model.eval()
    policy.model.module.mtp.train()
    before = _modes(policy)
    assert not before["module.decoder"] and before["module.mtp"]
    compute_logprobs(policy, make_batch(BALANCED_RESPONSES), cfg)
    assert _modes(policy) == before
    forward_backward_global_batch(policy, make_batch(BALANCED_RESPONSES), PG_LOSS, cfg)
    assert _modes(policy) == before
