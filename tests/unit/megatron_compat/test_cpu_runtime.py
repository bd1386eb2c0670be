"""The CPU adaptation of megatron-core: idempotent, logged, scoped, and off where CUDA exists."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from megatron.core.tensor_parallel import random as megatron_random

from nemo_rl_mtp.megatron_compat.cpu import training_runtime as cpu_runtime

# The CPU adaptation itself can only be exercised where CUDA is absent; the tests that simulate
# CUDA run everywhere.
REAL_CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(REAL_CUDA, reason="checks the CPU-only adaptation")


@cpu_only
@pytest.mark.usefixtures("megatron_world")
def test_install_is_idempotent():
    patched = (torch.cuda.current_device, megatron_random._set_cuda_rng_state, megatron_random.CudaRNGStatesTracker.add)
    assert cpu_runtime.install() is True
    assert cpu_runtime.install() is True
    assert patched == (torch.cuda.current_device, megatron_random._set_cuda_rng_state, megatron_random.CudaRNGStatesTracker.add)
    assert torch.cuda.current_device() == torch.device("cpu")


@cpu_only
def test_install_logs_what_it_adapted(caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # as before install(); restored after
    with caplog.at_level(logging.INFO, logger=cpu_runtime.__name__):
        cpu_runtime.install()
    assert "megatron-core adapted to CPU" in caplog.text
    assert "CudaRNGStatesTracker.add" in caplog.text


# Every attribute install() replaces on a machine without CUDA (read from cpu_runtime.install).
CPU_ADAPTED = (
    (torch.cuda, "current_device"),
    (torch.cuda, "current_stream"),
    (torch.cuda, "synchronize"),
    (megatron_random, "_get_cuda_rng_state"),
    (megatron_random, "_set_cuda_rng_state"),
    (megatron_random.CudaRNGStatesTracker, "add"),
)


def test_nothing_is_patched_when_cuda_is_available(caplog, monkeypatch):
    """CUDA reported available (its only probe, torch.cuda.is_available): install() replaces none of
    the functions it adapts on a CPU and says so. Each target first holds a fresh stand-in, so the
    identity check means something even when an earlier test installed the CPU adaptation."""
    stand_ins = {}
    for owner, attribute in CPU_ADAPTED:

        def upstream(*args, **kwargs):  # a distinct object per target
            raise AssertionError("not to be called")

        stand_ins[(owner, attribute)] = upstream
        monkeypatch.setattr(owner, attribute, upstream)  # monkeypatch restores the real ones
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger=cpu_runtime.__name__):
        assert cpu_runtime.install() is False
        assert cpu_runtime.install() is False
    for (owner, attribute), upstream in stand_ins.items():
        assert getattr(owner, attribute) is upstream, f"{attribute} was replaced although CUDA is available"
    assert not cpu_runtime.is_installed()
    assert torch.get_num_threads() == threads
    assert caplog.text.count("CUDA is available, megatron-core runs unmodified") == 2
    assert "adapted to CPU" not in caplog.text
    assert cpu_runtime.distributed_backend() == "nccl"
    scope = cpu_runtime.device_scope()
    assert isinstance(scope, contextlib.nullcontext)
    if not REAL_CUDA:
        with scope:  # no redirection: a CUDA tensor on this CUDA-less machine still fails
            with pytest.raises((RuntimeError, AssertionError)):
                torch.zeros(1, device="cuda")


@cpu_only
def test_device_scope_redirects_cuda_literals_only_inside():
    with cpu_runtime.device_scope():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.empty(2, pin_memory=True).device.type == "cpu"
        assert torch.ones(2).pin_memory().device.type == "cpu"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")


@cpu_only
@pytest.mark.usefixtures("megatron_world")
def test_rng_tracker_forks_the_cpu_generator():
    tracker = megatron_random.get_cuda_rng_tracker()
    outside_before = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before)  # the default stream is untouched
    with tracker.fork():
        second = torch.rand(3)
    assert not torch.equal(first, second)  # the tracked stream advanced
