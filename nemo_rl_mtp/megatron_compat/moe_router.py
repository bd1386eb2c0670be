"""Compat patch: megatron-core's router computes its global load-balancing loss from counts we
give it (``moe_router_load_balancing_type: global_batch_aux_loss``, :mod:`training.moe`).

What it fixes: megatron's ``global_aux_loss`` keeps a running average of each expert's token
share over the microbatches routed so far, so the loss depends on how the global batch is split
into microbatches. For the duration of a training pass, :func:`global_load_statistics` replaces
each router's ``TopKRouter._apply_global_aux_loss`` (an instance attribute, set and deleted in
try/finally) with the same loss computed from the global batch's token counts, which the caller
counted in a routing pass beforehand.

How it knows it is needed, and that it can: the configuration asks for it, and the router names
it reaches (``_apply_global_aux_loss`` and the parameters of what it calls) are checked before
any worker starts (``router_names_changed``); a router without the method here raises, naming it,
rather than leaving megatron's split-dependent loss in place silently.

What lets it go: megatron's router accepting global token counts for its global aux loss (a
public parameter would make this patch a call).
"""

from __future__ import annotations

import contextlib
import functools

import torch

# megatron's name for load balancing at global-batch level: what the TransformerConfig says.
MEGATRON_GLOBAL_AUX_LOSS = "global_aux_loss"
PATCHED_METHOD = "_apply_global_aux_loss"


@contextlib.contextmanager
def global_load_statistics(counts: dict, global_router_tokens: torch.Tensor):
    """During the training pass, each router's load-balancing loss uses the global batch's counts
    ``counts[router]`` ([experts], summed over ranks) and ``global_router_tokens``. Its gradient
    comes out as the global loss's share of this microbatch once megatron multiplies by the valid
    tokens and ``moe_grad_scale`` divides by N (:mod:`training.moe`)."""
    for router in counts:
        if not callable(getattr(type(router), PATCHED_METHOD, None)):
            raise RuntimeError(
                f"megatron-core's {type(router).__name__} has no {PATCHED_METHOD}: the global batch's load statistics "
                "cannot replace its global aux loss; use moe_router_load_balancing_type=aux_loss"
            )
    for router in counts:
        setattr(router, PATCHED_METHOD, functools.partial(_global_aux_loss, counts, global_router_tokens, router))
    try:
        yield
    finally:
        for router in counts:
            delattr(router, PATCHED_METHOD)


def _global_aux_loss(counts: dict, global_router_tokens: torch.Tensor, router, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
    """``TopKRouter._apply_global_aux_loss`` with the global batch's counts: megatron's switch
    load-balancing loss, attached to ``probs`` with the global valid-token count."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    coefficient = router.get_aux_loss_coeff(MEGATRON_GLOBAL_AUX_LOSS)
    if coefficient == 0:
        return probs
    tokens_per_expert = counts[router]
    aux_loss = switch_load_balancing_loss_func(
        probs=scores_for_aux_loss,
        tokens_per_expert=tokens_per_expert,
        total_num_tokens=tokens_per_expert.sum() / router.topk,
        topk=router.topk,
        num_experts=router.config.num_moe_experts,
        moe_aux_loss_coeff=coefficient,
        fused=router.config.moe_router_fusion,
    )
    valid = global_router_tokens / router.tp_cp_group.size()
    return router.attach_and_log_load_balancing_loss(probs, coefficient, aux_loss, "load_balancing_loss", router.tp_cp_group, valid_token_count=valid)
