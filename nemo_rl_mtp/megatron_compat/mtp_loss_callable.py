"""The MTP loss megatron computes inside the model forward, reachable for one forward at a time.

``process_mtp_loss`` (``GPTModel._postprocess``; on 0.16 the rl_labels shim's back-port) computes
each MTP depth's logits and hands them straight to ``compute_language_model_loss(labels, logits)``,
megatron's cross entropy, which overwrites the logits in place; the policy's own logits do not exist
yet. The acceptance forecast and the losses on the policy's distribution (``mtp_loss_type``) need
each depth's logits next to the policy's, so during our training forward that call goes to a
callable of ours (``substituted_mtp_loss``): it may record the logits, then returns megatron's cross
entropy unchanged or a loss of its own. In RL mode (``labels=None``) the MTP losses are the only
callers of ``compute_language_model_loss`` within a forward.

Shim: ``compute_language_model_loss`` of GPTModel and of HybridModel (where the release has it;
both inherit it from ``LanguageModule``) is wrapped; outside ``substituted_mtp_loss`` (and inside,
for a call that finds no substitute) it is the original call. Every release the project
supports passes the bound method as ``process_mtp_loss``'s ``compute_language_model_loss`` (the
back-port too), which the probe checks by signature.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from typing import Callable

from megatron.core.models.gpt import gpt_model
from megatron.core.transformer import multi_token_prediction as mtp_module

from nemo_rl_mtp.megatron_compat._marks import is_shim, mark_shim

# fn(labels, logits, megatron_loss) -> loss, for the forward in progress; None outside one.
_SUBSTITUTE: contextvars.ContextVar = contextvars.ContextVar("mtp_loss_substitute", default=None)


def _loss_callable_reaches_process_mtp_loss() -> tuple[bool, str]:
    native = getattr(mtp_module, "process_mtp_loss", None)
    if native is None:
        return True, "0.16 layout: the rl_labels shim's back-port takes compute_language_model_loss"
    if "compute_language_model_loss" in inspect.signature(native).parameters:
        return True, "process_mtp_loss takes compute_language_model_loss"
    return False, "process_mtp_loss takes no compute_language_model_loss (the MTP loss is not reachable)"


def probe() -> tuple[bool, str]:
    if is_applied():
        return True, "installed earlier in this process"
    reachable, reason = _loss_callable_reaches_process_mtp_loss()
    if not reachable:
        return False, f"cannot install: {reason}"
    return True, f"{reason}; the MTP logits are needed next to the policy's (forecast, mtp_loss_type)"


def unsupported_reason() -> str | None:
    """Why this release cannot reach the MTP loss (None: it can)."""
    reachable, reason = _loss_callable_reaches_process_mtp_loss()
    return None if reachable else reason


def model_classes() -> list[type]:
    """The model classes whose forward hands ``process_mtp_loss`` their ``compute_language_model_loss``:
    GPTModel, and HybridModel where the release has it (``model_class: hybrid``)."""
    classes = [gpt_model.GPTModel]
    try:
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:  # releases before megatron.core.models.hybrid
        return classes
    return classes + [HybridModel]


def _is_wrapped(model_class: type) -> bool:
    return is_shim(vars(model_class).get("compute_language_model_loss"))


def is_applied() -> bool:
    return all(_is_wrapped(model_class) for model_class in model_classes())


def apply() -> str:
    if is_applied():
        return "already installed (idempotent)"
    wrapped = []
    for model_class in model_classes():
        if not _is_wrapped(model_class):
            original = model_class.compute_language_model_loss
            model_class.compute_language_model_loss = mark_shim(substitutable(original), original)
            wrapped.append(model_class.__name__)
    return f"{' and '.join(wrapped)}.compute_language_model_loss: substitutable for one forward (MTP logits next to the policy's)"


def substitutable(original):
    def compute_language_model_loss(self, labels, logits):
        substitute = _SUBSTITUTE.get()
        if substitute is None:
            return original(self, labels, logits)
        return substitute(labels, logits, lambda labels, logits: original(self, labels, logits))

    return compute_language_model_loss


@contextlib.contextmanager
def substituted_mtp_loss(substitute: Callable | None):
    """Within the block, megatron's MTP losses call ``substitute(labels, logits, megatron_loss)``
    (``megatron_loss(labels, logits)`` is the original); ``None`` changes nothing."""
    token = _SUBSTITUTE.set(substitute)
    try:
        yield
    finally:
        _SUBSTITUTE.reset(token)
