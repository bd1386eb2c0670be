"""Forward passes that need eval mode (log-probabilities, the MoE routing pass) inside code that
may itself run in either mode: the mode is switched for the pass and restored afterwards, module
by module, to what it was, never forced to ``train()``."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """``model.eval()`` within the block; afterwards each submodule's ``training`` flag is what it
    was before (so a submodule kept in eval mode by its owner stays there), raised or not."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
