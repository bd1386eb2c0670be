"""MTP metrics from megatron-core's ``MTPLossLoggingHelper`` tracker, sharing results of the last
pipeline stage, and the backward seed of megatron's auxiliary losses (MTP, MoE load balancing)."""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from nemo_rl_mtp.metrics import MTP_ACCEPTANCE_RATE, MTP_LOSS, MTP_TARGET_TOKENS


def get_mtp_metrics(num_microbatches: int) -> dict[str, float]:
    """Per MTP layer (1-indexed): ``mtp_{i}_loss``, ``mtp_{i}_acceptance_rate`` and
    ``mtp_{i}_target_tokens`` (masked positions the layer predicted); then clears the tracker.
    ``{}`` when the tracker is empty (no MTP loss was computed this step).

    The loss is megatron's per-microbatch token mean, averaged over microbatches and over the
    data-parallel x context-parallel ranks; acceptance is correct / total top-1 predictions of the
    masked positions, in percent, counted over the same ranks.
    """
    tracker = MTPLossLoggingHelper.tracker
    if "loss_values" not in tracker:
        return {}
    MTPLossLoggingHelper.reduce_metrics_in_tracker()
    losses = tracker["loss_values"] / num_microbatches
    acceptance = tracker["correct_values"] / tracker["total_values"].clamp(min=1) * 100.0
    losses, acceptance, targets = torch.stack([losses, acceptance, tracker["total_values"]]).tolist()  # one host sync
    # Drop the keys rather than zero them, so a later step that computes no MTP loss shows as {}.
    tracker.clear()
    metrics = {}
    for layer, (loss, rate, count) in enumerate(zip(losses, acceptance, targets), start=1):
        metrics[MTP_LOSS.key(layer)] = loss
        metrics[MTP_ACCEPTANCE_RATE.key(layer)] = rate
        metrics[MTP_TARGET_TOKENS.key(layer)] = count
    return metrics


def broadcast_from_last_pipeline_stage(values):
    """Values computed on the last pipeline stage, made known to every stage."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    holder = [values]
    torch.distributed.broadcast_object_list(
        holder,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return holder[0]


@contextlib.contextmanager
def backward_seed_over(config, scale_func_attribute: str, global_count: torch.Tensor | None, enabled: bool):
    """For one step, ``config.<scale_func_attribute>`` returns ``loss_scale / global_count`` (the
    backward seed megatron's schedule reads for an auxiliary loss); set and cleared in try/finally."""
    if not enabled:
        yield
        return

    def loss_scale_over_global_count() -> torch.Tensor:
        one = torch.ones(1, device=global_count.device)
        loss_scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
        return loss_scale / global_count.clamp(min=1)

    setattr(config, scale_func_attribute, loss_scale_over_global_count)
    try:
        yield
    finally:
        setattr(config, scale_func_attribute, None)


def sum_over_data_parallel(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A count over this rank's share of the global batch, summed over data-parallel ranks (one
    all-reduce)."""
    total = local.to(device=device, dtype=torch.float32)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return total
