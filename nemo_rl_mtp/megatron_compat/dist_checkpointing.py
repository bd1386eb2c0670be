"""Compat patch: a synchronous checkpoint save's writer threads report through a plain queue
instead of a Manager process megatron-core spawns for them.

What it fixes: dist_checkpointing's filesystem writer threads report to a queue that megatron
creates on first use as a ``multiprocessing.Manager`` queue, by spawning a manager process: 12 s
on a 2-core VM (a new interpreter importing torch), once per run. A synchronous save's writers are
threads of this process, so a plain ``queue.Queue`` carries the same results.

How it knows it is needed: megatron's cached queue (``filesystem_async._results_queue``) is still
unset (None). Set already (an asynchronous save made megatron's own), it is left alone; gone
(upstream renamed or dropped it), the save spawns its manager as megatron does, with a warning.

What lets it go: megatron creating the queue lazily per writer kind, or without a process.
"""

from __future__ import annotations

import contextlib
import logging
import queue

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def write_results_collected_in_process():
    """For one synchronous save: megatron's cached results queue is a plain queue, set for the
    save and put back (None) after it, so an asynchronous save (another process's writers) still
    gets megatron's own queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        if not hasattr(filesystem_async, "_results_queue"):
            logger.warning("dist_checkpointing has no _results_queue to set: this save spawns its manager process")
        yield
        return
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None
