"""Run megatron-core's dynamic inference engine on a machine without CUDA.

On top of :mod:`cpu_runtime` (which adapts training), the engine reaches CUDA in these places:

1. ``torch.cuda.Event`` / ``torch.cuda.Stream`` / ``torch.cuda.stream``: step timing and the
   copy stream of asynchronous scheduling. On the CPU work is synchronous: host stand-ins.
2. flash-attn's paged kernels (``flash_attn_varlen_func``, ``flash_attn_with_kvcache``) and the
   ``is_fa_min_version`` gate in front of them: replaced by a batched torch paged attention
   (:mod:`paged_attention`).
3. triton kernels: the KV-cache append (megatron falls back to indexing when it is None) and the
   controller's speculative-decoding kernels (verify drafts, Mamba state copy), rebound to
   megatron's own PyTorch versions in ``mtp_utils_pytorch``; preparing the next pass, whose
   PyTorch version loops over requests, to the vectorised one in :mod:`speculative_kernels`.
4. pipeline parallelism: the engine's stage-to-stage helpers assert their tensors are CUDA
   tensors (``communication_utils._is_cuda``); on the CPU they only need to exist.
5. ``pin_memory``: dropped by :func:`cpu_runtime.device_scope`, which must be active while the
   engine is built and while it generates.

``install()`` applies 1-4 once per process and logs what it did; with CUDA present it changes
nothing, and the engine runs unmodified with flash-attn (the ``gpu`` extra).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Optional

import torch

from nemo_rl_mtp.models.megatron import cpu_runtime, paged_attention, speculative_kernels

logger = logging.getLogger(__name__)

_INSTALLED = False
ADAPTATIONS = (
    "torch.cuda.Event/Stream -> host stand-ins, flash-attn paged kernels -> torch paged attention, "
    "triton KV append and MTP kernels -> megatron's PyTorch versions (preparing the next pass: vectorised), "
    "pipeline tensors may be host tensors"
)


def adaptations_in_place() -> Optional[str]:
    """What this process adapted for the CPU (``ADAPTATIONS``), or None when nothing was."""
    return ADAPTATIONS if _INSTALLED else None


def install() -> bool:
    """Adapt the inference engine to the CPU when CUDA is unavailable. Idempotent.

    Returns True when the adaptations are in place (installed now or earlier).
    """
    global _INSTALLED
    if cpu_runtime.cuda_available():
        logger.info("cpu_inference_runtime: CUDA is available, the inference engine runs unmodified")
        return False
    if _INSTALLED:
        return True
    cpu_runtime.install()
    from megatron.core.inference import communication_utils
    from megatron.core.inference.contexts import dynamic_context
    from megatron.core.inference.text_generation_controllers import mtp_utils_pytorch, text_generation_controller
    from megatron.core.transformer import attention

    torch.cuda.Event = HostEvent
    torch.cuda.Stream = cpu_runtime.HostStream
    torch.cuda.stream = _host_stream_context
    attention.flash_attn_varlen_func = paged_attention.flash_attn_varlen_func
    attention.flash_attn_with_kvcache = paged_attention.flash_attn_with_kvcache
    attention.is_fa_min_version = _paged_attention_stands_in
    dynamic_context.triton_append_key_value_cache = None
    communication_utils._is_cuda = _is_tensor
    for kernel in ("verify_speculative_tokens", "mamba_state_selective_copy"):
        setattr(text_generation_controller, kernel, getattr(mtp_utils_pytorch, kernel))
    text_generation_controller.prepare_next_forward_pass = speculative_kernels.prepare_next_forward_pass
    _INSTALLED = True
    logger.info("cpu_inference_runtime: inference engine adapted to CPU: %s", ADAPTATIONS)
    return True


class HostEvent:
    """A CUDA event on the host: recording notes the time; waiting has nothing to wait for."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.recorded_at = None

    def record(self, stream=None) -> None:
        self.recorded_at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: "HostEvent") -> float:
        """Milliseconds from this event to ``end_event``, as CUDA events report."""
        return (end_event.recorded_at - self.recorded_at) * 1000.0


@contextlib.contextmanager
def _host_stream_context(stream=None):
    yield stream


def _paged_attention_stands_in(version: str) -> bool:
    """The flash-attn version gate of dynamic batching: the torch paged attention covers it."""
    return True


def _is_tensor(tensor) -> None:
    """The engine's pipeline-stage check, less its demand for CUDA."""
    assert tensor is not None
