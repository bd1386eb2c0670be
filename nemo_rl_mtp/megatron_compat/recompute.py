"""Full activation recompute of MTP layers (``recompute_granularity: full``).

* megatron-core 0.18.x: ``MultiTokenPredictionLayer.forward`` passes ``padding_mask=`` to
  ``_checkpointed_forward``, which does not declare it (Megatron-LM #4933): every step raises
  ``TypeError``. Shim: accept ``padding_mask``; ``None`` is dropped; a real mask raises
  ``NotImplementedError``, since dropping it would silently treat padding as real tokens.
* megatron-core 0.14-0.17: ``_checkpointed_forward(forward_func, *args, **kwargs)`` hands every
  keyword value to the checkpoint function positionally, so ``packed_seq_params`` reaches
  ``save_for_backward`` and raises ``TypeError``. Shim: non-tensor keywords are captured in a
  closure; tensor (and None) keywords are passed positionally, which both checkpoint backends track.
* megatron-core 0.19+ declares ``padding_mask`` and keeps non-tensors in a closure: skipped.
"""

from __future__ import annotations

import inspect

import torch
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

from nemo_rl_mtp.megatron_compat._marks import is_shim, mark_shim


def _parameters(function) -> set[str]:
    return set(inspect.signature(function).parameters)


def probe() -> tuple[bool, str]:
    method = MultiTokenPredictionLayer._checkpointed_forward
    if is_shim(method):
        return True, "installed earlier in this process"
    parameters = _parameters(method)
    if "forward_func" in parameters:
        return True, "_checkpointed_forward(forward_func, *args, **kwargs) passes packed_seq_params to save_for_backward"
    if "padding_mask" not in parameters and "padding_mask" in _parameters(MultiTokenPredictionLayer.forward):
        return True, "forward passes padding_mask= but _checkpointed_forward does not declare it"
    return False, "_checkpointed_forward declares padding_mask and closes over non-tensor arguments (fixed upstream)"


def is_applied() -> bool:
    return is_shim(MultiTokenPredictionLayer._checkpointed_forward)


def apply() -> str:
    original = MultiTokenPredictionLayer._checkpointed_forward
    if is_shim(original):
        return "already installed (idempotent)"
    if "forward_func" in _parameters(original):
        MultiTokenPredictionLayer._checkpointed_forward = mark_shim(positional_tensor_arguments(original), original)
        return "MultiTokenPredictionLayer._checkpointed_forward: non-tensor kwargs closed over, tensors positional"
    MultiTokenPredictionLayer._checkpointed_forward = mark_shim(accept_padding_mask(original), original)
    return "MultiTokenPredictionLayer._checkpointed_forward: accepts padding_mask (None dropped, a mask raises)"


def accept_padding_mask(original):
    """``original`` plus a ``padding_mask`` keyword, which must be None."""

    def _checkpointed_forward(self, *args, padding_mask=None, **kwargs):
        if padding_mask is not None:
            raise NotImplementedError(
                "MTP full recompute with a padding_mask: this megatron-core release's "
                "MultiTokenPredictionLayer._checkpointed_forward cannot take it, and dropping it would treat "
                "padding as real tokens. Use megatron-core >= 0.19 or recompute_granularity != full."
            )
        return original(self, *args, **kwargs)

    return _checkpointed_forward


def positional_tensor_arguments(original):
    """``original(self, forward_func, *args, **kwargs)`` with only tensors reaching the checkpoint."""

    def _checkpointed_forward(self, forward_func, *args, **kwargs):
        closed_over = {key: value for key, value in kwargs.items() if value is not None and not torch.is_tensor(value)}
        positional_keys = [key for key in kwargs if key not in closed_over]
        num_args = len(args)

        def forward_with_keywords(*values):
            keywords = dict(zip(positional_keys, values[num_args:]))
            return forward_func(*values[:num_args], **keywords, **closed_over)

        return original(self, forward_with_keywords, *args, *(kwargs[key] for key in positional_keys))

    return _checkpointed_forward
