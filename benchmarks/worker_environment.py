"""Benchmarks whose engines stand for a policy worker's run in a worker's environment.

A local run's workers start with ``cluster.worker_settings.WORKER_SETTINGS`` (PyTorch's huge
pages for CPU tensors), which PyTorch reads at a process's first allocation: a benchmark that
builds engines in its own process must start with them too, or it measures another engine than a
run's (at 32 x 2048 an engine rebuilt after rollouts at k = 1 ran 0.99-1.00 of a fixed one
with them, 0.96-0.99 without, docs/results.md).
"""

from __future__ import annotations

import os
import sys

from nemo_rl_mtp.cluster.worker_settings import WORKER_SETTINGS


def as_the_workers_run() -> str:
    """Run this command again, in place, with the workers' settings this process lacks; a value
    the user set is kept (``THP_MEM_ALLOC_ENABLE=0`` measures without huge pages). Call it first
    in ``main``. Returns the settings as run, for the output's header."""
    missing = {name: value for name, value in WORKER_SETTINGS.items() if name not in os.environ}
    if missing:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **missing})
    return "the workers' settings: " + " ".join(f"{name}={os.environ[name]}" for name in WORKER_SETTINGS)
