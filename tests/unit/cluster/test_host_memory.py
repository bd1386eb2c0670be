"""A policy worker on a CPU keeps freed memory for its next allocations
(``cluster.worker.keep_freed_host_memory``): a rollout step's temporaries, allocated and freed
again and again, stop costing fresh pages from the operating system. Each case runs in its own
process (the setting is process-wide) and counts the process's minor page faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nemo_rl_mtp.megatron_compat.cpu.training_runtime import cuda_available

STEPS = 20
SCRIPT = f"""
import resource, sys, torch
from nemo_rl_mtp.cluster.worker import keep_freed_host_memory
if sys.argv[1] == "keep":
    assert keep_freed_host_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's temporaries: tensors of several sizes (MB) alive together, then freed
    held = [torch.ones(size * 2**20 // 4) for size in (1, 3, 8, 20, 2, 12)]
    del held
step()
before = faults()
for _ in range({STEPS}):
    step()
print((faults() - before) / {STEPS})
"""


def _faults_per_step(mode: str) -> float:
    completed = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return float(completed.stdout.split()[-1])


@pytest.mark.skipif(cuda_available() or not sys.platform.startswith("linux"), reason="glibc's malloc on a CPU-only machine")
def test_kept_memory_ends_the_page_faults_of_repeated_allocations():
    plain, kept = _faults_per_step("plain"), _faults_per_step("keep")
    # Control: by default the C library hands much of each step's 46 MB back and faults it in again.
    assert plain > 256, plain
    assert kept < plain / 10, (plain, kept)
