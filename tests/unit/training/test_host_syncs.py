"""The mask, packing and metrics code reads device values on the host a fixed number of times per
step, never per microbatch. On a GPU each such read (item, tolist, bool, ...) is a host-device
synchronisation; on the CPU we count the reads made from nemo_rl_mtp code."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import nemo_rl_mtp
from nemo_rl_mtp.training.step import forward_backward_global_batch
from tests.support.helpers import make_batch, make_policy
from tests.unit.training.test_mtp_training_step import PG_LOSS, RAGGED_RESPONSES

pytestmark = pytest.mark.usefixtures("megatron_world")

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}
PACKAGE_DIR = str(Path(nemo_rl_mtp.__file__).parent)
TORCH_DIR = str(Path(torch.__file__).parent)


class HostReadCounter(TorchFunctionMode):
    """Counts host reads of tensor values by the code location that asked for them."""

    def __init__(self):
        super().__init__()
        self.by_location = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            frame = sys._getframe(1)
            # Skip torch's dispatch and any other torch function mode (cpu_runtime's) in between.
            while frame is not None and (
                frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_name == "__torch_function__"
            ):
                frame = frame.f_back
            if frame is not None:
                self.by_location[f"{frame.f_code.co_filename}:{frame.f_code.co_name}"] += 1
        return func(*args, **(kwargs or {}))

    def ours(self) -> Counter:
        return Counter({location: n for location, n in self.by_location.items() if location.startswith(PACKAGE_DIR)})


@pytest.mark.parametrize("packed", [False, True])
def test_host_reads_of_our_code_do_not_grow_with_microbatches(packed):
    counts = []
    for micro_batch_size in (8, 2):
        policy, cfg = make_policy(
            megatron_cfg__mtp_num_layers=2,
            train_micro_batch_size=micro_batch_size,
            train_global_batch_size=8,
            sequence_packing__enabled=packed,
        )
        with HostReadCounter() as counter:
            forward_backward_global_batch(policy, make_batch(RAGGED_RESPONSES), PG_LOSS, cfg)
        counts.append(counter.ours())
    one_microbatch, four_microbatches = counts
    assert one_microbatch == four_microbatches, (one_microbatch, four_microbatches)
    assert four_microbatches == EXPECTED_READS_WITH_MTP, four_microbatches


def _reads(module: str, function: str) -> str:
    return f"{PACKAGE_DIR}/training/{module}.py:{function}"


# What one training step with MTP must read on the host, once per step, and why (from the code
# path, one entry per read; a new read, or one that moves into a per-microbatch loop, fails):
EXPECTED_READS_WITH_MTP = Counter(
    {
        # the sequence lengths that lay out the microbatches (a host tensor, so no device sync)
        _reads("batches", "build_microbatches"): 1,
        # how many samples have prompts short enough for megatron's N_0/N_k re-weighting (the warning)
        _reads("step", "warn_if_mtp_depths_are_reweighted"): 1,
        # G and the MTP loss's G, reported as global_valid_tokens and mtp/global_valid_tokens
        _reads("step", "_forward_backward"): 2,
        # every step metric summed over microbatches and ranks, read in one go
        _reads("step", "sum_over_global_batch"): 1,
        # the MTP block's gradient norm (mtp/grad_norm)
        _reads("step", "mtp_gradient_norm"): 1,
        # megatron's MTP tracker: loss, acceptance and targets of every layer, in one go
        _reads("aux_losses", "get_mtp_metrics"): 1,
    }
)
