"""get_mtp_metrics on megatron's real MTPLossLoggingHelper tracker."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from nemo_rl_mtp.training.aux_losses import get_mtp_metrics

pytestmark = pytest.mark.usefixtures("megatron_world")


def _save(layer: int, num_layers: int, loss: float, correct: float, total: float):
    MTPLossLoggingHelper.save_metrics_to_tracker(
        torch.tensor(loss),
        torch.tensor(correct),
        torch.tensor(total),
        layer_number=layer,
        num_layers=num_layers,
        avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
    )


def test_per_layer_metrics_from_known_tracker_contents():
    MTPLossLoggingHelper.tracker.clear()
    # Two microbatches, two MTP layers.
    _save(0, 2, loss=2.0, correct=3, total=10)
    _save(1, 2, loss=3.0, correct=1, total=10)
    _save(0, 2, loss=4.0, correct=5, total=10)
    _save(1, 2, loss=5.0, correct=0, total=10)
    metrics = get_mtp_metrics(num_microbatches=2)
    assert metrics == pytest.approx(
        {
            "mtp_1_loss": 3.0,
            "mtp_1_acceptance_rate": 40.0,
            "mtp_1_target_tokens": 20.0,
            "mtp_2_loss": 4.0,
            "mtp_2_acceptance_rate": 5.0,
            "mtp_2_target_tokens": 20.0,
        }
    )
    assert MTPLossLoggingHelper.tracker == {}
    assert get_mtp_metrics(num_microbatches=2) == {}


def test_empty_tracker_gives_no_metrics():
    MTPLossLoggingHelper.tracker.clear()
    assert get_mtp_metrics(num_microbatches=4) == {}


def test_zero_total_gives_zero_acceptance_not_nan():
    MTPLossLoggingHelper.tracker.clear()
    _save(0, 1, loss=0.0, correct=0, total=0)
    assert get_mtp_metrics(num_microbatches=1) == {"mtp_1_loss": 0.0, "mtp_1_acceptance_rate": 0.0, "mtp_1_target_tokens": 0.0}
