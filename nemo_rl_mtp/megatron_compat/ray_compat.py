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
* ``ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER``: read by ``ray.init`` when it
  builds the driver's core worker, whose C++ failure handler would otherwise take SIGTERM (a
  crash dump, exit status 134) while ``ray.init`` runs, out of reach of the driver's own.
* Ray's C++ settings (``RayConfig``), each read by every Ray process from its environment as
  ``RAY_<name>`` when the process starts: the start-up timeouts and the work a local run does
  not need (:func:`local_start_settings`). Probed by name in Ray's core library; a setting this
  Ray does not know is logged and left out.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
from collections import defaultdict
from functools import lru_cache
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
    with _ray_constant_in_block(UV_HOOK_SWITCH, False, "assuming it has no uv run hook") as found:
        yield found


FAILURE_HANDLER_SWITCH = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


@contextlib.contextmanager
def driver_failure_signal_handler_off() -> Iterator[bool]:
    """The C++ failure-signal handler of the driver's core worker not installed by a ``ray.init``
    inside the block (the constant put back afterwards; Ray's own workers keep theirs): with it,
    a SIGTERM during the start is a crash dump and status 134 that leaves Ray's agents running,
    and the driver's handler never hears of it. Yields False, with a warning, where this Ray has
    no such switch."""
    consequence = "a SIGTERM while Ray starts may end the driver with a crash dump"
    with _ray_constant_in_block(FAILURE_HANDLER_SWITCH, True, consequence) as found:
        yield found


@contextlib.contextmanager
def _ray_constant_in_block(name: str, value: bool, consequence: str) -> Iterator[bool]:
    """``ray._private.ray_constants.<name>`` set to ``value`` while the block runs, put back after
    it; yields False, warning with ``consequence``, where this Ray has no such constant."""
    from ray._private import ray_constants

    if not hasattr(ray_constants, name):
        logger.warning("Ray %s has no %s switch: %s", _ray_version(), name, consequence)
        yield False
        return
    previous = getattr(ray_constants, name)
    setattr(ray_constants, name, value)
    try:
        yield True
    finally:
        setattr(ray_constants, name, previous)


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


def local_start_settings(start_timeout_s: float) -> dict[str, str]:
    """Ray's environment variables for a local instance that must start on a busy machine, with
    our values: Ray's own start-up waits (30 s for the raylet to register, 60 s for a worker,
    measured too short under a load of 5 on 2 cores) raised to ``start_timeout_s``, and work a
    one-machine run has no use for switched off: idle workers prestarted for the first driver
    (each a Python start of 1.5-2 s of CPU), metrics export from every process, and usage-stats
    collection. C++ settings this Ray does not know are logged and left out."""
    seconds = str(math.ceil(start_timeout_s))
    wanted = {
        "RAY_raylet_start_wait_time_s": seconds,
        "RAY_worker_register_timeout_seconds": seconds,
        "RAY_prestart_worker_first_driver": "0",
        "RAY_enable_metrics_collection": "0",
    }
    settings = {name: value for name, value in wanted.items() if _ray_core_knows(name.removeprefix("RAY_"))}
    for name in wanted.keys() - settings.keys():
        logger.warning("Ray %s has no %s setting: left at Ray's default", _ray_version(), name)
    settings["RAY_USAGE_STATS_ENABLED"] = "0"  # Ray's documented switch, read in Python
    return settings


@lru_cache(maxsize=None)
def _ray_core_knows(setting: str) -> bool:
    """Whether Ray's core library names ``setting`` (RayConfig's names are strings in it)."""
    from ray import _raylet

    try:
        with open(_raylet.__file__, "rb") as library, mmap.mmap(library.fileno(), 0, access=mmap.ACCESS_READ) as image:
            return image.find(b"\0" + setting.encode() + b"\0") >= 0
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def environment_set(settings: dict[str, str]) -> Iterator[dict[str, str]]:
    """Each variable of ``settings`` that this process's environment lacks, set while the block
    runs (the Ray processes started in it inherit them) and removed afterwards; a variable the
    user set keeps the user's value. Yields {name: value} of the user's own, for the log."""
    ours = {name: value for name, value in settings.items() if name not in os.environ}
    users = {name: os.environ[name] for name in settings if name in os.environ}
    os.environ.update(ours)
    try:
        yield users
    finally:
        for name in ours:
            os.environ.pop(name, None)
