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
import ctypes, resource, sys, torch
from nemo_rl_mtp.cluster import worker
if sys.argv[1] == "keep":
    assert worker.keep_freed_host_memory()
else:  # glibc's default thresholds (128 KB), held fixed: each block is mapped afresh and unmapped when freed
    mallopt = ctypes.CDLL(None).mallopt
    assert mallopt(worker.M_MMAP_THRESHOLD, 128 * 1024) == 1 and mallopt(worker.M_TRIM_THRESHOLD, 128 * 1024) == 1
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's temporaries: tensors of several sizes (MB) alive together, then freed
    held = [torch.ones(size * 2**20 // 4) for size in (1, 3, 8, 20, 2, 12)]
    del held
for _ in range(5):
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
    """glibc's dynamic threshold sometimes settles on such a pattern by itself and sometimes not
    (0 or about 10,700 faults a step here, from run to run); the control holds its default
    thresholds fixed, where every step faults its 46 MB in again. Kept, a step faults 0 pages on
    a quiet machine and up to a few hundred beside other processes (154 in one CI run, the
    release matrix's runs beside it): at most 5% of the control's."""
    default, kept = _faults_per_step("default"), _faults_per_step("keep")
    assert default > 0.5 * 46 * 2**20 / 4096, default  # control: at least half the step's pages
    assert kept < 0.05 * default, (default, kept)
