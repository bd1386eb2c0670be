"""The MoE routers of a HybridModel's MTP layers, marked as MTP routers (megatron-core 0.19.2).

GPTModel builds an MTP layer's MoE with ``is_mtp_layer=True`` and the MTP layer's number, so its
router divides the load-balancing loss of a repeated MTP layer (``mtp_use_repeated_layer``) by
``mtp_num_layers`` and records it in the MTP slots of megatron's MoE metrics tracker.
``HybridStack`` builds the E layers of an MTP pattern (``"/*E"``) without ``is_mtp_layer`` and
numbers them within the pattern (1, 2, ...): a repeated MTP layer's load-balancing loss then
counts ``mtp_num_layers`` times in the loss and the metrics (measured: 0.751 against GPTModel's
0.626 on the same weights), and the metrics land in decoder layers' slots.

Probe (behaviour, after the model is built): a ``TopKRouter`` under an MTP layer whose
``is_mtp_layer`` is False. Then each such router gets ``is_mtp_layer=True`` and, through its public
``set_layer_number``, its MTP layer's number, as GPTModel's MTP routers have; logged. Where a
release marks them itself nothing changes. Idempotent (a marked router is left alone); a router
without these attributes stops the build in one line.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def unmarked_mtp_routers(model) -> list[tuple[object, int]]:
    """(router, its MTP layer's number) for every MoE router of ``model``'s MTP layers that is not
    marked as an MTP router."""
    from megatron.core.transformer.moe.router import TopKRouter

    mtp_block = getattr(model, "mtp", None)
    if mtp_block is None:
        return []
    found = []
    for mtp_layer in mtp_block.layers:
        for router in (module for module in mtp_layer.modules() if isinstance(module, TopKRouter)):
            if not hasattr(router, "is_mtp_layer") or not hasattr(router, "set_layer_number"):
                raise RuntimeError(
                    "megatron-core's TopKRouter has no is_mtp_layer / set_layer_number, which nemo_rl_mtp's hybrid_mtp_router "
                    "patch sets on a HybridModel's MTP routers; model_class=hybrid with E layers in the MTP pattern needs adapting"
                )
            if not router.is_mtp_layer:
                found.append((router, mtp_layer.layer_number))
    return found


def mark_mtp_routers(model) -> int:
    """Mark ``model``'s unmarked MTP routers (a HybridModel, after construction); returns how many
    were marked now."""
    routers = unmarked_mtp_routers(model)
    for router, layer_number in routers:
        router.is_mtp_layer = True
        router.set_layer_number(layer_number)
    if routers:
        logger.info(
            "hybrid_mtp_router applied: %d MoE router(s) of the MTP layers marked as MTP routers (HybridStack builds them as "
            "decoder routers: a repeated MTP layer's load-balancing loss would count once per depth)",
            len(routers),
        )
    elif getattr(model, "mtp", None) is not None:
        logger.info("hybrid_mtp_router skipped: no unmarked MoE router in the MTP layers")
    return len(routers)
