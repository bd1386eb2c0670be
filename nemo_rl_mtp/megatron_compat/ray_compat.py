"""The private names of Ray this project reaches, each behind a probe: present and shaped as
expected, or a logged fallback (never a silent one).

* ``ray._private.ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV``: the switch of Ray's ``uv run``
  runtime-env hook, read by ``ray.init``. Its environment variable is only read when Ray is
  imported, so the constant is set as well.
* ``ray._private.ray_logging.global_worker_stdstream_dispatcher``: where the log lines Ray forwards
  to the driver (workers', raylets') pass, with the node they come from; the node probe reads a
  failing node's own explanation from it.
* ``ray._private.worker._global_node.dead_processes()``: whether a Ray process this driver started
  has died (a signal to the whole process group).
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from typing import Iterator

logger = logging.getLogger(__name__)

UV_HOOK_SWITCH = "RAY_ENABLE_UV_RUN_RUNTIME_ENV"


@contextlib.contextmanager
def uv_hook_disabled() -> Iterator[bool]:
    """Ray's ``uv run`` hook off while the block runs, then put back as it was: ``ray.init`` is
    the one place Ray reads the switch, so wrap it alone. A process that starts Ray twice (tests,
    a notebook) then gets what each start asks for; the switch set for good would leak into later
    starts and into the environment of their subprocesses. Yields False where this Ray has no such
    switch (then it has no hook to switch off either, and workers start from the node's Python)."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, UV_HOOK_SWITCH):
        logger.warning("Ray %s has no %s switch: assuming it has no uv run hook", _ray_version(), UV_HOOK_SWITCH)
        yield False
        return
    previous = getattr(ray_constants, UV_HOOK_SWITCH)
    setattr(ray_constants, UV_HOOK_SWITCH, False)
    try:
        yield True
    finally:
        setattr(ray_constants, UV_HOOK_SWITCH, previous)


@contextlib.contextmanager
def forwarded_log_lines() -> Iterator[dict[str, list[str]]]:
    """Yields {node ip: [line, ...]} filling with the log lines Ray forwards to this driver from
    raylets and workers while the block runs (they are printed as usual too). Empty, with a
    warning, where this Ray has no dispatcher to listen to."""
    lines: dict[str, list[str]] = defaultdict(list)
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        dispatcher = None
    if dispatcher is None or not all(hasattr(dispatcher, name) for name in ("add_handler", "remove_handler")):
        logger.warning("Ray %s forwards no log lines this driver can read: node failures will be reported without their cause", _ray_version())
        yield lines
        return
    name = "nemo_rl_mtp_node_probe"

    def collect(data: dict) -> None:
        lines[str(data.get("ip"))].extend(str(line) for line in data.get("lines", ()))

    dispatcher.add_handler(name, collect)
    try:
        yield lines
    finally:
        dispatcher.remove_handler(name)


def local_processes_dead() -> bool:
    """True once a Ray process this driver started has died; False for a joined cluster, and
    (with a warning, once) where this Ray cannot tell."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return False
    if not hasattr(node, "dead_processes"):
        logger.warning("Ray %s cannot say whether its local processes are alive; assuming they are", _ray_version())
        return False
    return bool(node.dead_processes())


def _ray_version() -> str:
    import ray

    return ray.__version__
