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
nothing, and the engine runs unmodified with flash-attn (the ``gpu`` extra). On a GPU without
flash-attn, ``install_paged_attention_without_flash_attn()`` applies 2 alone.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from typing import Optional

import torch

from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime
from nemo_rl_mtp.megatron_compat.cpu import paged_attention
from nemo_rl_mtp.megatron_compat import speculative_kernels

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
    torch.cuda.Event = HostEvent
    torch.cuda.Stream = cpu_runtime.HostStream
    torch.cuda.stream = _host_stream_context
    absent = []
    for module_name, name, replacement in _module_targets():
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            absent.append(f"{module_name.rsplit('.', 1)[-1]}.{name}")
            continue
        setattr(module, name, replacement)
    _INSTALLED = True
    logger.info("cpu_inference_runtime: inference engine adapted to CPU: %s", ADAPTATIONS)
    if absent:
        logger.info("cpu_inference_runtime: not in this megatron-core release, so not reached: %s", ", ".join(absent))
    return True


def install_paged_attention_without_flash_attn() -> bool:
    """On a GPU without flash-attn (the ``gpu`` extra not installed, as on a lent machine that
    cannot fetch it): the engine's paged attention in torch (:mod:`paged_attention`, item 2 of the
    module docstring), the rest of the engine unmodified. Slower than flash-attn's kernels (keys
    are gathered, the longest key length read on the host each call), so what it times is not
    what a served engine would; ``benchmarks.gpu_speculation_check`` says so. Idempotent; False
    where flash-attn is there (nothing changed)."""
    attention = importlib.import_module("megatron.core.transformer.attention")
    if not hasattr(attention, "flash_attn_with_kvcache"):
        from nemo_rl_mtp.megatron_compat.installed import megatron_core_version

        raise RuntimeError(f"megatron-core {megatron_core_version()}: its attention module has no flash_attn_with_kvcache to stand in for")
    if attention.flash_attn_with_kvcache is paged_attention.flash_attn_with_kvcache:
        return True
    if attention.flash_attn_with_kvcache is not None:
        logger.info("cpu_inference_runtime: flash-attn is installed: the engine's attention is its own")
        return False
    for module_name, name, replacement in _attention_targets():
        setattr(importlib.import_module(module_name), name, replacement)
    logger.info("cpu_inference_runtime: no flash-attn: the engine's paged attention runs in torch (slower than flash-attn's)")
    return True


def _module_targets() -> list[tuple[str, str, object]]:
    """(module, name, stand-in) of every CUDA-only piece the engine of some release reaches by a
    module-level name. A release without the name does not reach it (the triton kernels of
    speculative decoding: 0.18 on); a release that renamed one would run the CUDA kernel and
    fail at once, and this module's log names what it did not find."""
    controller = "megatron.core.inference.text_generation_controllers.text_generation_controller"
    targets = [
        *_attention_targets(),
        ("megatron.core.inference.contexts.dynamic_context", "triton_append_key_value_cache", None),
        ("megatron.core.inference.communication_utils", "_is_cuda", _is_tensor),
        (controller, "prepare_next_forward_pass", speculative_kernels.prepare_next_forward_pass),
    ]
    if hasattr(importlib.import_module(controller), "verify_speculative_tokens"):
        # The controller's triton kernels have PyTorch versions next to them.
        from megatron.core.inference.text_generation_controllers import mtp_utils_pytorch

        targets += [(controller, kernel, getattr(mtp_utils_pytorch, kernel)) for kernel in ("verify_speculative_tokens", "mamba_state_selective_copy")]
    return targets


def _attention_targets() -> list[tuple[str, str, object]]:
    """flash-attn's two paged kernels and the version gate in front of them, with their stand-ins."""
    return [
        ("megatron.core.transformer.attention", "flash_attn_varlen_func", paged_attention.flash_attn_varlen_func),
        ("megatron.core.transformer.attention", "flash_attn_with_kvcache", paged_attention.flash_attn_with_kvcache),
        ("megatron.core.transformer.attention", "is_fa_min_version", _paged_attention_stands_in),
    ]


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
