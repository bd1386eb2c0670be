"""The CPU adaptation of megatron-core's inference engine: in place without CUDA, idempotent and
logged; with CUDA (simulated in a fresh process) nothing is touched."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from megatron.core.inference.text_generation_controllers import text_generation_controller
from megatron.core.transformer import attention

from nemo_rl_mtp.megatron_compat.cpu import inference_runtime as cpu_inference_runtime
from nemo_rl_mtp.megatron_compat.cpu import paged_attention
from nemo_rl_mtp.megatron_compat import speculative_kernels
from tests.support.release_gates import import_or_skip

# The speculative kernels' CPU stand-ins these tests name (megatron-core >= 0.18).
mtp_utils_pytorch = import_or_skip("megatron.core.inference.text_generation_controllers.mtp_utils_pytorch", "speculative decoding's PyTorch kernels")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only adaptation")


def test_install_swaps_the_cuda_kernels_once_and_logs(caplog, monkeypatch):
    monkeypatch.setattr(cpu_inference_runtime, "_INSTALLED", False)
    with caplog.at_level(logging.INFO, logger=cpu_inference_runtime.__name__):
        assert cpu_inference_runtime.install() is True
    assert "inference engine adapted to CPU" in caplog.text
    patched = (torch.cuda.Event, attention.flash_attn_with_kvcache, text_generation_controller.verify_speculative_tokens)
    assert cpu_inference_runtime.install() is True
    assert patched == (torch.cuda.Event, attention.flash_attn_with_kvcache, text_generation_controller.verify_speculative_tokens)
    assert attention.flash_attn_varlen_func is paged_attention.flash_attn_varlen_func
    assert text_generation_controller.verify_speculative_tokens is mtp_utils_pytorch.verify_speculative_tokens
    assert text_generation_controller.prepare_next_forward_pass is speculative_kernels.prepare_next_forward_pass
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(), end.record()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)


def test_nothing_is_touched_when_cuda_is_available():
    script = textwrap.dedent(
        """
        import torch
        torch.cuda.is_available = lambda: True
        from megatron.core.inference.contexts import dynamic_context
        from megatron.core.inference.text_generation_controllers import mtp_utils_triton, text_generation_controller
        from megatron.core.transformer import attention
        from nemo_rl_mtp.megatron_compat.cpu import inference_runtime as cpu_inference_runtime

        def state():
            return (torch.cuda.Event, torch.cuda.Stream, attention.flash_attn_varlen_func, attention.is_fa_min_version,
                    dynamic_context.triton_append_key_value_cache, text_generation_controller.verify_speculative_tokens)

        before = state()
        assert cpu_inference_runtime.install() is False
        assert all(a is b for a, b in zip(before, state()))
        assert text_generation_controller.verify_speculative_tokens is mtp_utils_triton.verify_speculative_tokens
        print("untouched")
        """
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "untouched" in completed.stdout


def test_on_a_gpu_without_flash_attn_only_the_attention_is_replaced():
    """A lent GPU cannot fetch flash-attn: there the engine's paged attention runs in torch, and
    nothing else of the CPU adaptation is applied (CUDA events, triton kernels stay); a second
    call changes nothing; where flash-attn is there (a stand-in for it here), it is left alone."""
    script = textwrap.dedent(
        """
        import torch
        torch.cuda.is_available = lambda: True
        from megatron.core.inference.contexts import dynamic_context
        from megatron.core.inference.text_generation_controllers import mtp_utils_triton, text_generation_controller
        from megatron.core.transformer import attention
        from nemo_rl_mtp.megatron_compat.cpu import inference_runtime, paged_attention

        assert attention.flash_attn_with_kvcache is None  # no flash-attn in this environment
        untouched = (torch.cuda.Event, dynamic_context.triton_append_key_value_cache, text_generation_controller.verify_speculative_tokens)
        assert inference_runtime.install_paged_attention_without_flash_attn() is True
        assert attention.flash_attn_with_kvcache is paged_attention.flash_attn_with_kvcache
        assert attention.flash_attn_varlen_func is paged_attention.flash_attn_varlen_func
        assert attention.is_fa_min_version("2.7.3") is True
        assert all(a is b for a, b in zip(untouched, (torch.cuda.Event, dynamic_context.triton_append_key_value_cache,
                                                      text_generation_controller.verify_speculative_tokens)))
        assert text_generation_controller.verify_speculative_tokens is mtp_utils_triton.verify_speculative_tokens
        assert inference_runtime.install_paged_attention_without_flash_attn() is True

        def installed_flash_attn(*args, **kwargs):
            raise AssertionError("not called here")

        attention.flash_attn_with_kvcache = installed_flash_attn
        assert inference_runtime.install_paged_attention_without_flash_attn() is False
        assert attention.flash_attn_with_kvcache is installed_flash_attn
        print("attention alone")
        """
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "attention alone" in completed.stdout
