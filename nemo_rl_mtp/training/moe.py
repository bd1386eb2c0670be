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

The load statistic. megatron's ``aux_loss`` measures each expert's share of tokens f_e over one
microbatch, so microbatches with different token mixes give a different loss than one microbatch
holding them all. ``global_batch_aux_loss`` (ours; megatron runs it as ``aux_loss``) measures f_e
over the whole global batch instead (Qiu et al. 2025, "global load balancing", arXiv
2501.11873): a forward-only pass routes every microbatch first and counts the tokens each router
sends to each expert (padding excluded, summed over ranks). Every microbatch's aux loss
E * c / (k T^2) * sum_e F_e * sum_{x in microbatch} p_e(x) then uses those counts F_e and token
total T, so the losses of the microbatches add up to the global batch's, whatever the split. The
price is that extra forward pass per step. The TransformerConfig says ``global_aux_loss``
(megatron's load balancing at global-batch level, whose running average over the microbatches
seen so far depends on the split), and during training the routers' global aux loss is this one.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging

import torch
from megatron.core import parallel_state

from nemo_rl_mtp.config.schema import GLOBAL_BATCH_AUX_LOSS
from nemo_rl_mtp.megatron_compat.capabilities import MOE_METRICS_MODULE
from nemo_rl_mtp.megatron_compat.moe_router import MEGATRON_GLOBAL_AUX_LOSS, global_load_statistics  # noqa: F401 (re-exported)
from nemo_rl_mtp.training.aux_losses import backward_seed_over, sum_over_data_parallel
from nemo_rl_mtp.metrics import MOE, all_in_scope

logger = logging.getLogger(__name__)

MOE_CONFIG_KEYS = ("num_moe_experts", "moe_router_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type")


def moe_enabled(config) -> bool:
    return bool(getattr(config, "num_moe_experts", None))




def uses_global_load_statistics(megatron_cfg) -> bool:
    return bool(megatron_cfg.num_moe_experts) and megatron_cfg.moe_router_load_balancing_type == GLOBAL_BATCH_AUX_LOSS


def moe_config_kwargs(megatron_cfg) -> dict:
    """TransformerConfig arguments of the MoE keys; {} for a dense trunk. Experts run one after the
    other (no grouped GEMM: it needs CUDA kernels)."""
    if not megatron_cfg.num_moe_experts:
        return {}
    kwargs = {key: megatron_cfg[key] for key in MOE_CONFIG_KEYS}
    if uses_global_load_statistics(megatron_cfg):
        kwargs["moe_router_load_balancing_type"] = MEGATRON_GLOBAL_AUX_LOSS  # computed as ours in training
    kwargs["moe_ffn_hidden_size"] = megatron_cfg.moe_ffn_hidden_size or megatron_cfg.ffn_hidden_size
    kwargs["moe_grouped_gemm"] = False
    return kwargs


def count_global_router_tokens(batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """N: non-padding tokens of the global batch (one all-reduce over data parallel)."""
    return sum_over_data_parallel(batch["input_lengths"].sum(), device)


@contextlib.contextmanager
def moe_grad_scale(config, global_router_tokens: torch.Tensor | None):
    """Set ``config.moe_grad_scale_func`` for one step (``loss_scale / N``, module docstring) and
    clear it afterwards, as ``mtp_grad_scale`` does for the MTP loss."""
    with backward_seed_over(config, "moe_grad_scale_func", global_router_tokens, enabled=moe_enabled(config)):
        yield


def routers_of(gpt_model) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [module for module in gpt_model.modules() if isinstance(module, TopKRouter)]


@contextlib.contextmanager
def counting_routed_tokens(routers: list):
    """Yields {router: [E] tokens routed to each expert} that fills during forwards: padding
    excluded (the router's padding mask), top-k choices counted once each."""
    counts = {router: None for router in routers}

    def count(router, args, kwargs, output):
        routing_map = output[1]
        # By name, wherever the caller put it (check_moe_supported probed the parameter).
        padding = inspect.signature(router.forward).bind(*args, **kwargs).arguments.get("padding_mask")
        if padding is not None:
            routing_map = routing_map & ~padding.reshape(-1, 1)
        tokens = routing_map.sum(dim=0).float()
        counts[router] = tokens if counts[router] is None else counts[router] + tokens

    handles = [router.register_forward_hook(count, with_kwargs=True) for router in routers]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def sum_over_ranks(counts: dict) -> dict:
    """Each router's counts summed over the ranks holding other tokens: its tensor/context group
    (sequence-parallel shards), then data parallel."""
    for router, tokens in counts.items():
        torch.distributed.all_reduce(tokens, group=router.tp_cp_group)
        torch.distributed.all_reduce(tokens, group=parallel_state.get_data_parallel_group())
    return counts


def get_moe_metrics(config, num_microbatches: int, global_statistics: bool) -> dict[str, float]:
    """The router's load-balancing loss of the step (megatron's MoE metrics tracker: mean over
    MoE layers, MTP layers included; the mean over microbatches and data-parallel ranks, or, with
    global statistics, where each microbatch holds its share of the global loss, their sum), as
    ``moe/<name>``; the tracker is reset. Collective over all ranks. {} without MoE."""
    if not moe_enabled(config):
        return {}
    get_moe_metrics_tracker = importlib.import_module(MOE_METRICS_MODULE).get_moe_metrics_tracker

    losses: dict[str, torch.Tensor] = {}
    # The tracker averages over data parallel; a sum of shares is undone from that average.
    shares = parallel_state.get_data_parallel_world_size()
    get_moe_metrics_tracker().report(
        loss_scale=shares if global_statistics else 1.0 / num_microbatches,
        iteration=0,
        total_loss_dict=losses,
        num_layers=config.num_layers,
        moe_layer_freq=config.moe_layer_freq,  # a hybrid model's E layers (hybrid.transformer_config_kwargs)
        mtp_num_layers=config.mtp_num_layers,
    )
    return all_in_scope(MOE, {name: float(value) for name, value in losses.items()})
