"""MTP acceptance tracking for releases before megatron-core 0.19.

0.19 tracks, per MTP layer, ``loss_values``, ``correct_values`` and ``total_values`` through
``MTPLossLoggingHelper.save_metrics_to_tracker`` / ``reduce_metrics_in_tracker``; earlier
releases track the loss only (``save_loss_to_tracker``). The back-ported loss (rl_labels) writes
0.19's tracker through these two methods, which this shim adds with 0.19's semantics.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from nemo_rl_mtp.megatron_compat._marks import is_shim, mark_shim


def probe() -> tuple[bool, str]:
    save = getattr(MTPLossLoggingHelper, "save_metrics_to_tracker", None)
    if save is not None and is_shim(save):
        return True, "installed earlier in this process"
    if save is None:
        return True, "MTPLossLoggingHelper tracks no acceptance (no save_metrics_to_tracker)"
    return False, "MTPLossLoggingHelper.save_metrics_to_tracker exists (acceptance tracked upstream)"


def is_applied() -> bool:
    save = getattr(MTPLossLoggingHelper, "save_metrics_to_tracker", None)
    return save is not None and is_shim(save)


def apply() -> str:
    if is_applied():
        return "already installed (idempotent)"
    MTPLossLoggingHelper.save_metrics_to_tracker = staticmethod(mark_shim(save_metrics_to_tracker))
    MTPLossLoggingHelper.reduce_metrics_in_tracker = staticmethod(reduce_metrics_in_tracker)
    return "MTPLossLoggingHelper: save_metrics_to_tracker and reduce_metrics_in_tracker (0.19 semantics) added"


def save_metrics_to_tracker(loss, correct, total, layer_number, num_layers, reduce_group=None, avg_group=None):
    if layer_number is None:
        return
    tracker = MTPLossLoggingHelper.tracker
    for key in ("loss_values", "correct_values", "total_values"):
        if key not in tracker:
            tracker[key] = torch.zeros(num_layers, device=torch.cuda.current_device())
    tracker["loss_values"][layer_number] += loss.detach()
    tracker["correct_values"][layer_number] += correct.detach()
    tracker["total_values"][layer_number] += total.detach()
    tracker["reduce_group"] = reduce_group
    tracker["avg_group"] = avg_group


def reduce_metrics_in_tracker():
    """Loss averaged over ``avg_group``; correct and total summed (after ``reduce_group``)."""
    tracker = MTPLossLoggingHelper.tracker
    if "loss_values" not in tracker:
        return
    reduce_group, avg_group = tracker.get("reduce_group"), tracker.get("avg_group")
    for key in ("loss_values", "correct_values", "total_values"):
        if reduce_group is not None:
            torch.distributed.all_reduce(tracker[key], group=reduce_group)
        if avg_group is not None:
            op = torch.distributed.ReduceOp.AVG if key == "loss_values" else torch.distributed.ReduceOp.SUM
            torch.distributed.all_reduce(tracker[key], group=avg_group, op=op)
