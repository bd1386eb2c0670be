"""Compat patch: megatron-core's KV-cache rewind after a speculative step, vectorised.

What it fixes: after verification megatron's controller rewinds each request's KV cache past its
rejected drafts with ``mtp_utils_pytorch.rewind_kv_cache`` (0.18, 0.19), a Python loop over the
batch's requests that runs on the host on every machine, once per decode step.
:func:`speculative_kernels.rewind_kv_cache` computes the same with a few batched tensor
operations; :func:`install_vectorised_rewind` points the controller module's
``rewind_kv_cache`` at it.

How it knows it is needed (:func:`vectorised_rewind_probe`): the controller module still calls
``rewind_kv_cache``, that name is still ``mtp_utils_pytorch``'s loop, its parameters are ours,
and both give the same results on a random batch. The behaviour check runs once per process for
each function it compares with (its verdict is the function's), not at every engine build.

What lets it go: upstream rewinding inside its controller (0.17), another function in the
controller's module, changed parameters or changed results each switch the patch off, with a
warning naming why; megatron's loop replaced by a vectorised one upstream would make the patch
unneeded (drop it then: the probe cannot tell a fast upstream loop from a slow one).
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable

import torch

from nemo_rl_mtp.megatron_compat import speculative_kernels

logger = logging.getLogger(__name__)

# The behaviour check's verdict per upstream rewind function, once per process.
_SAME_RESULTS: dict[Callable, bool] = {}


def vectorised_rewind_probe() -> tuple[bool, str]:
    """Whether the controller still rewinds with megatron's per-request loop, which the vectorised
    rewind reproduces (same parameters; same results on a random batch). Upstream changing the
    function, its signature or its results switches the patch off."""
    from megatron.core.inference.text_generation_controllers import text_generation_controller

    current = getattr(text_generation_controller, "rewind_kv_cache", None)
    if current is speculative_kernels.rewind_kv_cache:
        return True, "installed earlier in this process"
    if current is None:
        return False, "megatron's controller calls no rewind_kv_cache (it rewinds in its own method): nothing to vectorise"
    from megatron.core.inference.text_generation_controllers import mtp_utils_pytorch

    if current is not getattr(mtp_utils_pytorch, "rewind_kv_cache", None):
        return False, "the controller rewinds with something other than mtp_utils_pytorch's loop (upstream changed it)"
    ours, theirs = inspect.signature(speculative_kernels.rewind_kv_cache), inspect.signature(current)
    if list(ours.parameters) != list(theirs.parameters):
        return False, f"rewind_kv_cache's parameters changed upstream: {list(theirs.parameters)}"
    if current not in _SAME_RESULTS:
        _SAME_RESULTS[current] = _same_rewind(current)
    if not _SAME_RESULTS[current]:
        return False, "rewind_kv_cache's results changed upstream (a random batch disagrees with the vectorised one)"
    return True, "the controller rewinds with mtp_utils_pytorch's per-request loop"


def _same_rewind(reference: Callable) -> bool:
    """Both rewinds on one random batch of 8 requests (k = 2, blocks of 4 tokens)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 20, (8,), generator=generator)
    counts = (lengths + 3) // 4
    table = torch.full((8, 6), -1, dtype=torch.int32)
    for row in range(8):
        table[row, : counts[row]] = torch.arange(counts[row], dtype=torch.int32) + 6 * row
    case = {
        "accepted_counts": torch.randint(0, 3, (8,), generator=generator),
        "prefill_status": torch.tensor([0, 0, 1, 0, 0, 0, 1, 0], dtype=torch.int32),
        "last_kv_block_offset": ((lengths - 1) % 4).int(),
        "kv_length_offsets": (lengths - 1).int(),
        "kv_block_counts": counts.int(),
        "last_kv_block_id": table[torch.arange(8), counts - 1].clone(),
        "kv_block_ids": table,
    }
    copies = [{name: value.clone() for name, value in case.items()} for _ in range(2)]
    expected = reference(**copies[0], num_speculative_tokens=2, block_size_tokens=4, num_active_requests=7)
    got = speculative_kernels.rewind_kv_cache(**copies[1], num_speculative_tokens=2, block_size_tokens=4, num_active_requests=7)
    same_buffers = all(torch.equal(copies[0][name], copies[1][name]) for name in case)
    return same_buffers and all(torch.equal(a, b) for a, b in zip(expected, got))


def install_vectorised_rewind() -> bool:
    """Point megatron's controller at the vectorised rewind where the probe says it is the same
    computation; idempotent, logged. Returns whether it is in place."""
    from megatron.core.inference.text_generation_controllers import text_generation_controller

    needed, reason = vectorised_rewind_probe()
    if not needed:
        logger.warning("vectorised KV-cache rewind: not installed: %s", reason)
        return False
    if text_generation_controller.rewind_kv_cache is not speculative_kernels.rewind_kv_cache:
        text_generation_controller.rewind_kv_cache = speculative_kernels.rewind_kv_cache
        logger.info("vectorised KV-cache rewind installed: %s", reason)
    return True
