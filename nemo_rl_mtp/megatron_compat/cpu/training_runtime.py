"""Run megatron-core on a machine without CUDA (tests, CI, laptops).

megatron-core assumes CUDA in a few places that an MTP training step reaches:

1. ``torch.cuda.current_device()`` is the device of internal buffers (global memory buffer,
   MTP metrics tracker, ``roll_tensor`` under context parallelism, DDP grad buffers).
2. ``CudaRNGStatesTracker.add`` seeds and reads the CUDA generator.
3. ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` save and restore the CUDA generator around
   ``fork()`` and activation recompute.
4. ``torch.cuda.current_stream()`` and ``torch.cuda.synchronize()``: DDP's gradient sync waits on
   the current stream's events; pipeline send/recv synchronizes the device.
5. ``device="cuda"`` literals (the default causal mask, the schedule's token counter, optimizer
   and grad-clip scalars), ``Tensor.cuda()``, grad clipping's
   ``assert grad.type() == 'torch.cuda.FloatTensor'``, and pinned host buffers (``pin_memory``).

``install()`` handles 1-4 once per process; 5 is handled by :func:`device_scope`, a context that
redirects ``device="cuda"`` to the CPU for the megatron calls made inside it (a torch function mode
is thread-local, so a global install would miss Ray's actor threads). On a machine with CUDA both
are no-ops: nothing here ever runs on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device model inputs go to."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def distributed_backend() -> str:
    return "nccl" if cuda_available() else "gloo"


def is_installed() -> bool:
    """Whether this process runs with the CPU adaptations (read from what they replace, so no
    flag of ours can disagree with torch)."""
    return torch.cuda.current_device is _cpu_current_device


def install() -> bool:
    """Adapt megatron-core to the CPU when CUDA is unavailable. Idempotent.

    Returns True when the CPU adaptations are in place (installed now or earlier).
    """
    if cuda_available():
        logger.info("cpu_runtime: CUDA is available, megatron-core runs unmodified")
        return False
    if is_installed():
        return True
    from megatron.core.tensor_parallel import random as megatron_random

    if "OMP_NUM_THREADS" not in os.environ:
        # Measured on a 2-core VM: with 2 intra-op threads, the small matmuls of a CPU-sized model
        # ran ~30x slower than with 1 (thread hand-off dominates). Set OMP_NUM_THREADS to override.
        torch.set_num_threads(1)
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.current_stream = host_stream
    torch.cuda.synchronize = _host_synchronize
    megatron_random._get_cuda_rng_state = _get_cpu_rng_state
    megatron_random._set_cuda_rng_state = _set_cpu_rng_state
    megatron_random.CudaRNGStatesTracker.add = _tracker_add_on_cpu_generator
    logger.info(
        "cpu_runtime: CUDA unavailable; megatron-core adapted to CPU (%d torch threads): "
        "torch.cuda.current_device -> cpu, torch.cuda.current_stream/synchronize -> no-ops, "
        "CudaRNGStatesTracker.add and recompute RNG "
        "save/restore -> CPU generator, device='cuda' literals -> cpu inside device_scope()"
    )
    return True


def device_scope() -> contextlib.AbstractContextManager:
    """Context for megatron calls: redirects ``device='cuda'`` literals to the CPU when CUDA is
    unavailable; a no-op context on GPU."""
    if cuda_available():
        return contextlib.nullcontext()
    return _CudaLiteralsToCpu()


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


class HostStream:
    """Stands in for a CUDA stream on the CPU, where work is synchronous: waiting is a no-op. A
    class, as ``torch.cuda.Stream`` is: code that names it in annotations (``Stream | None``) still
    imports once it stands in for it."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def host_stream(device=None) -> HostStream:
    return HostStream()


def _host_synchronize(device=None) -> None:
    """CPU work is synchronous: nothing to wait for."""


def _get_cpu_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _tracker_add_on_cpu_generator(self, name: str, seed: int) -> None:
    """``CudaRNGStatesTracker.add`` with the CPU generator standing in for the CUDA one."""
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    original_state = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(original_state)


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # A bare int device is a CUDA ordinal in torch.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaLiteralsToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        # Pinned host memory only speeds up copies to a GPU; without CUDA it cannot be allocated.
        kwargs.pop("pin_memory", None)
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The type *name* of a CPU tensor, spelled as its CUDA counterpart.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)

