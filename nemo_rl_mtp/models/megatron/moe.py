"""Mixture-of-experts trunks (and MTP layers, which reuse the trunk's layer spec as in
DeepSeek-V3), with the router's load-balancing loss normalised like the policy and MTP losses.

Normalisation. Under ``calculate_per_token_loss`` megatron multiplies each microbatch's
auxiliary loss by the microbatch's valid (non-padding) token count n_mb and expects
``finalize_model_grads`` to divide every gradient by the global token count. Our losses are
already divided by their global counts (train.py), so that division is skipped, and the aux-loss
gradient would grow with the batch: twice the tokens, twice the load-balancing pull (NeMo-RL
issue #3888). ``moe_grad_scale`` seeds the aux-loss backward with ``loss_scale / N``, N the
valid tokens of the global batch (every rank), so the step's aux-loss gradient is the
token-weighted mean over the global batch of the microbatches' aux losses, whatever the batch
size. The microbatches must tell megatron which tokens are padding (``padding_mask``), so that
padding neither counts in n_mb nor in the router's load statistics.

What stays split-dependent is megatron's design, not the scale: the load statistic of the
standard aux loss (fraction of tokens per expert) is computed per microbatch, so microbatches with
different token mixes give different aux losses than one microbatch holding them all.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state

from nemo_rl_mtp.models.megatron.common import backward_seed_over

MOE_CONFIG_KEYS = ("num_moe_experts", "moe_router_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type")


def moe_enabled(config) -> bool:
    return bool(getattr(config, "num_moe_experts", None))


def moe_config_kwargs(megatron_cfg) -> dict:
    """TransformerConfig arguments of the MoE keys; {} for a dense trunk. Experts run one after the
    other (no grouped GEMM: it needs CUDA kernels)."""
    if not megatron_cfg.num_moe_experts:
        return {}
    kwargs = {key: megatron_cfg[key] for key in MOE_CONFIG_KEYS}
    kwargs["moe_ffn_hidden_size"] = megatron_cfg.moe_ffn_hidden_size or megatron_cfg.ffn_hidden_size
    kwargs["moe_grouped_gemm"] = False
    return kwargs


def check_moe_supported(megatron_cfg) -> None:
    """Raise ValueError, naming the key, where the installed megatron-core cannot normalise the
    load-balancing loss: before 0.19 its schedule reads no ``moe_grad_scale_func``."""
    from megatron.core.pipeline_parallel import schedules

    if megatron_cfg.num_moe_experts and megatron_cfg.moe_aux_loss_coeff > 0 and not hasattr(schedules, "_get_moe_loss_scale"):
        raise ValueError(
            f"policy.megatron_cfg.moe_aux_loss_coeff={megatron_cfg.moe_aux_loss_coeff}: this megatron-core's schedule "
            "has no moe_grad_scale_func, so the load-balancing loss cannot be normalised like the policy loss "
            "(megatron-core >= 0.19 can); set it to 0 or upgrade"
        )


def count_global_router_tokens(batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """N: non-padding tokens of the global batch (one all-reduce over data parallel)."""
    count = batch["input_lengths"].sum().to(device=device, dtype=torch.float32)
    torch.distributed.all_reduce(count, group=parallel_state.get_data_parallel_group())
    return count


@contextlib.contextmanager
def moe_grad_scale(config, global_router_tokens: torch.Tensor | None):
    """Set ``config.moe_grad_scale_func`` for one step (``loss_scale / N``, module docstring) and
    clear it afterwards, as ``mtp_grad_scale`` does for the MTP loss."""
    with backward_seed_over(config, "moe_grad_scale_func", global_router_tokens, enabled=moe_enabled(config)):
        yield


def get_moe_metrics(config, num_microbatches: int) -> dict[str, float]:
    """The router's load-balancing loss of the step (megatron's MoE metrics tracker: mean over
    MoE layers, MTP layers included, and microbatches, averaged over data parallel), as
    ``moe/<name>``; the tracker is reset. Collective over all ranks. {} without MoE."""
    if not moe_enabled(config):
        return {}
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    losses: dict[str, torch.Tensor] = {}
    get_moe_metrics_tracker().report(
        loss_scale=1.0 / num_microbatches,
        iteration=0,
        total_loss_dict=losses,
        num_layers=config.num_layers,
        mtp_num_layers=config.mtp_num_layers,
    )
    return {f"moe/{name}": float(value) for name, value in losses.items()}
