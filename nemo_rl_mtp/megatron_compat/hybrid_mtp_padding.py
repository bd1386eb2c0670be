"""The padding mask for a HybridModel's MTP block (megatron-core 0.19.2).

GPTModel hands its MTP block the forward's ``padding_mask``; HybridModel.forward does not, so the
routers of MoE layers in the MTP pattern (``"/*E"``) count padding tokens in their load statistics
and load-balancing loss, which the decoder's routers exclude. On a model whose MTP pattern has MoE
layers, two forward pre-hooks (public torch hooks, on this model's modules only) pass the model's
``padding_mask`` on to its MTP block when megatron's call leaves it out. Where a release passes it
itself, the hook finds it set and does nothing (logged once). Idempotent: a model is hooked once.
An MTP block whose forward takes no ``padding_mask`` (probed by signature) stops the build in one
line.
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger(__name__)

_HOOKED = "_nemo_rl_mtp_mtp_padding_hooked"


def needed(model, mtp_layer_pattern: str | None) -> bool:
    """Only MoE layers read the padding mask, so only MTP patterns with them need it."""
    return getattr(model, "mtp", None) is not None and bool(mtp_layer_pattern) and "E" in mtp_layer_pattern


def pass_padding_mask_to_mtp(model) -> bool:
    """Hook ``model`` (a HybridModel with an MTP block); returns whether hooks were added now."""
    if getattr(model, _HOOKED, False):
        return False
    if "padding_mask" not in inspect.signature(model.mtp.forward).parameters:
        raise RuntimeError(
            f"megatron-core's {type(model.mtp).__name__}.forward takes no padding_mask, which nemo_rl_mtp's hybrid_mtp_padding "
            "hook hands it (the MoE routers of the MTP pattern would count padding); model_class=hybrid with E layers in the "
            "MTP pattern needs adapting to this release"
        )
    forward = {"padding_mask": None, "reported": False}

    def remember(module, args, kwargs):
        forward["padding_mask"] = kwargs.get("padding_mask")

    def supply(module, args, kwargs):
        padding_mask = forward["padding_mask"]
        if padding_mask is None:
            return None
        if kwargs.get("padding_mask") is not None:  # upstream passes it: nothing to do
            if not forward["reported"]:
                forward["reported"] = True
                logger.info("hybrid_mtp_padding: HybridModel hands its MTP block the padding mask itself; the hook stays idle")
            return None
        return args, {**kwargs, "padding_mask": padding_mask}

    def forget(module, args, output):
        forward["padding_mask"] = None

    model.register_forward_pre_hook(remember, with_kwargs=True)
    model.register_forward_hook(forget)
    model.mtp.register_forward_pre_hook(supply, with_kwargs=True)
    setattr(model, _HOOKED, True)
    logger.info(
        "hybrid_mtp_padding applied: the MTP block gets the forward's padding_mask where HybridModel leaves it out "
        "(the MoE routers of its MTP layers would count padding)"
    )
    return True
