"""Ray: start or join a cluster, check that every node can start a worker, reserve one
placement-group bundle per policy worker, and find the rendezvous address for torch.distributed
on the node of the first worker.

Without ``cluster.address`` a run starts a local Ray instance of its own (never one that a
previous run left behind), and its workers run the driver's own interpreter and virtual
environment. Ray's uv integration (on by default when the driver runs under ``uv run``) would
instead build a fresh virtual environment from a copy of the working directory for every run:
tens of seconds per start, and with a ``PYENV_VERSION`` or ``UV_PYTHON`` that names another Python
it tries to download an interpreter.

On a cluster, ``cluster.worker_python`` says how workers get their Python: ``driver`` (this
interpreter, at the same path on every node: one container image or a shared filesystem) or
``uv`` (Ray's uv integration: every node runs ``uv run`` on a copy of the working directory). Either
way every node is probed before the policy starts: a node that cannot start a worker fails the
run within ``cluster.node_probe_timeout_s``, naming the node and the cause its raylet gave.

Starting or joining Ray is bounded by ``cluster.start_timeout_s``: on a busy machine Ray's own
start-up waits are too short (a local start failed after about 50 s under a load of 5 on 2
cores), and Ray can hang in its C++ core for minutes, where no Python signal handler runs. A
local start therefore raises Ray's waits to that limit and switches off what a one-machine run
does not use (``ray_compat.local_start_settings``; a variable the user set wins); the workers it
starts get PyTorch's huge pages for CPU tensors (``WORKER_SETTINGS``), and a watchdog
thread ends a start that has not returned by then, or within seconds of a SIGINT / SIGTERM, with
one line, after stopping every process the start had begun. Local starts on one machine take
turns (:func:`one_local_start_at_a_time`): two starting together can each miss one of Ray's
fixed waits."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import psutil

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_rl_mtp.cluster.worker_settings import WORKER_SETTINGS
from nemo_rl_mtp.config.schema import ClusterConfig

logger = logging.getLogger(__name__)


# How long a placement group may wait for resources the cluster has in total but not free.
PLACEMENT_TIMEOUT_S = 60


class PlacementError(RuntimeError):
    """The cluster cannot host the configured workers."""


class RayStartError(RuntimeError):
    """Ray did not start (or the driver did not connect) within ``cluster.start_timeout_s``."""


def init_ray(cluster_cfg: ClusterConfig) -> None:
    """Join ``cluster.address`` when given (then probe its nodes), else start a new local Ray
    instance (once per process); either within ``cluster.start_timeout_s``."""
    if ray.is_initialized():
        return
    from nemo_rl_mtp.megatron_compat.ray_compat import driver_failure_signal_handler_off

    limit_s = cluster_cfg.start_timeout_s
    with driver_sigterm_handler_kept(), driver_failure_signal_handler_off():
        if cluster_cfg.address is None:
            logger.info("starting a local Ray instance (within cluster.start_timeout_s=%g s)", limit_s)
            # "local": a new instance, even where a previous Ray left its address behind.
            with one_local_start_at_a_time(limit_s), local_start_environment(limit_s), workers_use_driver_environment(), bounded_start(limit_s, "start"):
                ray.init(address="local", include_dashboard=False, log_to_driver=True)
            logger.info("started a local Ray instance: %s", ray.cluster_resources())
            return
        with bounded_start(limit_s, f"connect to {cluster_cfg.address}"):
            if cluster_cfg.worker_python == "driver":
                with workers_use_driver_environment():
                    ray.init(address=cluster_cfg.address, log_to_driver=True, runtime_env={"py_executable": sys.executable})
            else:
                ray.init(address=cluster_cfg.address, log_to_driver=True)
    logger.info("joined Ray cluster at %s (workers' Python: %s)", cluster_cfg.address, _worker_python(cluster_cfg))
    check_nodes_start_workers(cluster_cfg)


# Held by the run whose local Ray instance is starting; other runs on this machine wait for it.
START_LOCK = Path(tempfile.gettempdir()) / "nemo_rl_mtp_ray_start.lock"


@contextlib.contextmanager
def one_local_start_at_a_time(limit_s: float, lock_path: Path = START_LOCK) -> Iterator[None]:
    """Local Ray starts on one machine, one after the other: Ray 2.60's raylet aborts when its
    dashboard agent has not written its ports within a fixed 15 s, which two agents starting
    together on a loaded 2-core machine missed; and a failed start stops every process begun
    since it started, which must not include another run's. Waits (logged) for the run holding
    ``lock_path`` (an advisory lock, released when its holder's start ends or its process dies),
    for at most ``limit_s``; then :class:`RayStartError` in one line."""
    with open(lock_path, "a+") as lock_file:
        waited, started = False, time.monotonic()
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    logger.info("another run on this machine is starting its Ray instance; waiting for it (at most %g s)", limit_s)
                    waited = True
                if time.monotonic() - started > limit_s:
                    raise RayStartError(
                        f"cluster: another run on this machine held {lock_path} (its Ray start) for more than "
                        f"cluster.start_timeout_s={limit_s:g} s; raise it, or start when that run is up"
                    ) from None
                time.sleep(0.2)
        if waited:
            logger.info("the other run's Ray start ended after %.1f s; starting ours", time.monotonic() - started)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@contextlib.contextmanager
def local_start_environment(start_timeout_s: float) -> Iterator[None]:
    """Ray's environment for a local start on a busy machine (``ray_compat.local_start_settings``)
    and the workers' own (``WORKER_SETTINGS``) while the block runs: the Ray processes it starts,
    workers included, inherit them; a variable the user set keeps the user's value
    (``THP_MEM_ALLOC_ENABLE=0`` switches huge pages off). Logged, both ours and the user's."""
    from nemo_rl_mtp.megatron_compat import ray_compat

    ray_settings = ray_compat.local_start_settings(start_timeout_s)
    with ray_compat.environment_set({**ray_settings, **WORKER_SETTINGS}) as users:
        for what, settings in (("Ray start-up settings", ray_settings), ("workers' settings", WORKER_SETTINGS)):
            ours = " ".join(f"{name}={value}" for name, value in settings.items() if name not in users)
            logger.info("%s: %s", what, ours or "none")
        if users:
            logger.info("settings of your own, kept: %s", " ".join(f"{name}={value}" for name, value in users.items()))
        yield


# After a SIGINT / SIGTERM during a start, how long the driver's own handler has to end it before
# the watchdog does (Ray's C++ core may hold the main thread for minutes).
SIGNAL_GRACE_S = 5.0


@contextlib.contextmanager
def bounded_start(limit_s: float, what: str) -> Iterator[None]:
    """Around ``ray.init``: every process it began is stopped when it raises (Ray leaves its GCS,
    raylet and agents behind otherwise), and its own error becomes :class:`RayStartError`. A
    watchdog thread ends the process, after stopping them, with one line (status 1) when the
    block has not returned within ``limit_s``, or (status 128 + the signal) ``SIGNAL_GRACE_S``
    after a SIGINT / SIGTERM that the main thread could not act on."""
    started = time.time()
    done = threading.Event()
    with _signal_wakeup() as wakeup:
        watchdog = threading.Thread(target=_watch_start, args=(done, started, limit_s, what, wakeup), name="ray-start-watchdog", daemon=True)
        watchdog.start()
        try:
            yield
        except Exception as error:
            stop_processes_started_since(started)
            raise RayStartError(_start_failed(what, limit_s, time.time() - started, error)) from error
        except BaseException:
            stop_processes_started_since(started)
            raise
        finally:
            done.set()
            watchdog.join()


@contextlib.contextmanager
def _signal_wakeup() -> Iterator[Optional[socket.socket]]:
    """A socket that receives the number of each signal this process gets, from Python's C-level
    handler, even while the main thread is held in C++ (``signal.set_wakeup_fd``); None off the
    main thread. The previous wakeup fd is put back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    try:
        yield reader
    finally:
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()


def _watch_start(done: threading.Event, started: float, limit_s: float, what: str, wakeup: Optional[socket.socket]) -> None:
    """The watchdog of :func:`bounded_start`."""
    from nemo_rl_mtp.reporting.console import EXIT_ERROR

    deadline = time.monotonic() + limit_s
    signum = None
    raylets = RayletWatch(started)
    while not done.is_set():
        left = deadline - time.monotonic()
        died = raylets.death()
        if died is not None and not done.is_set():
            reason = _raylet_died(what, time.time() - started, died)
            if died:  # its agents outlive it, no longer our descendants: found by its session directory
                stop_processes_naming(str(Path(died).parent.parent))
            if AGENT_MISSED_ITS_WAIT in reason:
                _start_again_in_a_new_process(started, reason)
            _abandon_start(started, EXIT_ERROR, f"error: RayStartError: {reason}")
        if left <= 0:
            if signum is not None:
                _abandon_start(started, 128 + signum, "interrupted: the run had not started (Ray's start ignored the signal; its processes were stopped)")
            _abandon_start(started, EXIT_ERROR, f"error: RayStartError: {_start_failed(what, limit_s)}")
        if wakeup is None:
            done.wait(min(left, 0.5))
            continue
        readable, _, _ = select.select([wakeup], [], [], min(left, 0.5))
        if readable and signum is None:
            received = [number for number in wakeup.recv(64) if number in (signal.SIGINT, signal.SIGTERM)]
            if received:
                signum = received[0]
                deadline = min(deadline, time.monotonic() + SIGNAL_GRACE_S)


class RayletWatch:
    """The raylets a start began, seen as they start, and the first to die before the start
    returned: Ray 2.60's raylet aborts when its dashboard agent has not written its ports within
    15 s (fixed; on a loaded machine the agent's imports take longer), and the driver then waits
    for it as long as Ray's start-up waits allow (``cluster.start_timeout_s``) for nothing.

    On a loaded machine this thread may first see a raylet as it exits, when its command line
    (which names its stderr file) can no longer be read: the file is then found from the start's
    session directory, which its GCS server's command line names. A raylet's own children, which
    bear its name between their fork and their program, are not raylets."""

    def __init__(self, started: float):
        self.started = started
        self.seen: dict[int, tuple[psutil.Process, Optional[str]]] = {}  # pid -> (process, its stderr file)
        self.session_dir: Optional[str] = None

    def death(self) -> Optional[str]:
        """The stderr file (or "" where neither it nor the session is known) of a raylet of this
        start that has exited; None while all live."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if child.pid in self.seen or child.create_time() < self.started - 1:
                        continue
                    if child.name() == "raylet" and not _forked_by_a_raylet(child):
                        self.seen[child.pid] = (child, _readable_flag(child, "--stderr_filepath"))
                    elif self.session_dir is None:
                        self.session_dir = _readable_flag(child, "--session-dir", "--session_dir")  # GCS's spelling, raylet's
        for process, stderr_file in self.seen.values():
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                pass
            if stderr_file is None and self.session_dir is not None:
                stderr_file = str(Path(self.session_dir) / "logs" / "raylet.err")
            return stderr_file or ""
        return None


def _forked_by_a_raylet(process: psutil.Process) -> bool:
    """Whether ``process`` is a raylet's own child: forked, it bears the raylet's name until it
    runs its program, and one that exits first (a zombie, its command line unreadable) must not
    be taken for the raylet dying: a CI run's watchdog did, and stopped a live start."""
    parent = process.parent()
    return parent is not None and parent.name() == "raylet"


def _readable_flag(process: psutil.Process, *names: str) -> Optional[str]:
    """The value of the first of ``names`` on ``process``'s command line; None where it has none
    or the command line cannot be read (empty, or an error, once the process is exiting)."""
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return None
    return next((value for value in (_flag(cmdline, name) for name in names) if value is not None), None)


def _flag(cmdline: list[str], name: str) -> Optional[str]:
    return next((argument.split("=", 1)[1] for argument in cmdline if argument.startswith(name + "=")), None)


def _raylet_died(what: str, after_s: float, stderr_file: str) -> str:
    """The one line of a start whose raylet died: its own reason, from its stderr file."""
    reason = "no reason in its log"
    with contextlib.suppress(OSError):
        for line in Path(stderr_file).read_text(errors="replace").splitlines():
            if "Check failed" in line or " C " in line[:40] or "error" in line.lower():
                reason = line.split("has_value() ", 1)[-1].split("] ", 1)[-1].strip()
                break
    if "Timed out waiting for file" in reason:
        port_file = reason.rsplit("/", 1)[-1]
        reason = f"its dashboard agent did not write {port_file.split('_port_')[0]}_port {AGENT_MISSED_ITS_WAIT}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"cluster: Ray failed to {what} after {after_s:.0f} s: its raylet exited ({reason}; {stderr_file}); load average "
        f"{load:.1f} on {os.cpu_count()} CPUs: the machine is too busy for Ray's own start-up waits, which no setting "
        "raises; start when it is quieter"
    )


# A local start whose raylet died because its dashboard agent missed Ray's fixed 15 s is made
# again in a new process (the driver's main thread stays held in Ray's C++, so not in this one),
# up to this many attempts in all, each after a pause of a few seconds times the attempt: the
# agent's imports, slowed by a passing load, usually make it the next time.
START_ATTEMPTS = 3
AGENT_MISSED_ITS_WAIT = "within the raylet's fixed 15 s"


def _start_again_in_a_new_process(started: float, reason: str) -> None:
    """Replace this process by the run's own command once more (``console.hard_restart``) after
    stopping what the start began, where the entry point allows it and attempts are left;
    otherwise return (the start is then abandoned in one line)."""
    from nemo_rl_mtp.reporting import console

    attempt = console.start_attempt()
    if not console.can_restart() or attempt >= START_ATTEMPTS or not threading.main_thread().is_alive():
        return
    stop_processes_started_since(started)
    pause_s = random.uniform(2.0, 5.0) * attempt
    time.sleep(pause_s)
    console.hard_restart(f"warning: {reason.split(': the machine is too busy', 1)[0]}; starting the run again in a new process after {pause_s:.0f} s (attempt {attempt + 1} of {START_ATTEMPTS})")


def _abandon_start(started: float, status: int, line: str) -> None:
    from nemo_rl_mtp.reporting.console import hard_exit

    if not threading.main_thread().is_alive():
        return
    stop_processes_started_since(started)
    print(line, file=sys.stderr, flush=True)
    hard_exit(status)


def _start_failed(what: str, limit_s: float, after_s: Optional[float] = None, error: Optional[BaseException] = None) -> str:
    """The one line of a start that failed (``error``, after ``after_s``) or did not end in time."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    how = f"did not {what} within {limit_s:g} s" if error is None else f"failed to {what} after {after_s:.0f} s ({_first_line(error)})"
    return (
        f"cluster: Ray {how}; load average {load:.1f} on {os.cpu_count()} CPUs: if the machine is that busy, "
        f"raise cluster.start_timeout_s (now {limit_s:g}) or start when it is quieter"
    )


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def stop_processes_started_since(started: float) -> None:
    """Kill this process's descendants started at or after ``started`` (time.time()): the Ray
    processes of a start that failed, and theirs (agents, workers)."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    killed = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.create_time() >= started - 1:
                child.kill()
                killed.append(child)
    psutil.wait_procs(killed, timeout=5)


def stop_processes_naming(session_dir: str) -> None:
    """Kill the processes whose command line names ``session_dir`` (a Ray session's own)."""
    killed = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and any(session_dir in argument for argument in process.cmdline()):
                process.kill()
                killed.append(process)
    psutil.wait_procs(killed, timeout=5)


def _worker_python(cluster_cfg: ClusterConfig) -> str:
    if cluster_cfg.worker_python == "driver":
        return f"{sys.executable} on every node (cluster.worker_python=driver)"
    return "Ray's uv integration, uv run on every node (cluster.worker_python=uv)"


@ray.remote(num_cpus=0)
def _node_environment() -> dict:
    import importlib.util

    return {"python": sys.executable, "version": sys.version.split()[0], "has_project": importlib.util.find_spec("nemo_rl_mtp") is not None}


def check_nodes_start_workers(cluster_cfg: ClusterConfig) -> None:
    """Start one tiny task on every node and check it runs this project; raise PlacementError
    naming the first node that cannot, with the cause its raylet reported, within
    ``cluster.node_probe_timeout_s`` (Ray itself retries a failing start for minutes)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from nemo_rl_mtp.megatron_compat.ray_compat import forwarded_log_lines

    nodes = [node for node in ray.nodes() if node["Alive"]]
    with forwarded_log_lines() as messages:
        probes = {
            _node_environment.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(): node
            for node in nodes
        }
        ready, pending = ray.wait(list(probes), num_returns=len(probes), timeout=cluster_cfg.node_probe_timeout_s)
    how = _worker_python(cluster_cfg)
    for probe in pending:
        ip = probes[probe]["NodeManagerAddress"]
        ray.cancel(probe, force=True)
        raise PlacementError(f"cluster: node {ip} started no worker within {cluster_cfg.node_probe_timeout_s:g} s with {how}: {_cause(messages.get(ip, []))}")
    for probe in ready:
        ip = probes[probe]["NodeManagerAddress"]
        try:
            found = ray.get(probe)
        except Exception as error:  # the worker started but the probe failed there
            raise PlacementError(f"cluster: node {ip} cannot run a worker ({type(error).__name__}: {str(error).splitlines()[0]})") from None
        if not found["has_project"]:
            raise PlacementError(
                f"cluster: node {ip}'s Python ({found['python']}, {found['version']}) cannot import nemo_rl_mtp; install this "
                "project's locked environment there, or use cluster.worker_python=uv"
            )
    logger.info("cluster: %d node(s) start workers (%s)", len(nodes), how)


def _cause(lines: list[str]) -> str:
    """The node's own explanation, from what its raylet forwarded: its last error line, then the
    first and the innermost of the causes that follow it."""
    reported = [line.strip() for line in lines if line.strip()]
    errors = [index for index, line in enumerate(reported) if line.lower().startswith("error") or "not found" in line.lower()]
    if not errors:
        return "its raylet reported no error; see its logs (/tmp/ray/session_latest/logs on that node)"
    last = errors[-1]
    causes = [line for line in reported[last + 1 :] if line.startswith("cause:")]
    return "; ".join(dict.fromkeys([reported[last], *causes[:1], *causes[-1:]]))


@contextlib.contextmanager
def driver_sigterm_handler_kept():
    """Put back the driver's SIGTERM handler, which ``ray.init`` replaces (with ``sys.exit``, and
    its core worker with a crash dump, exit status 134), so a driver that cleans up on SIGTERM
    still does. A SIGTERM that arrives while ``ray.init`` runs meets Ray's handler, which exits
    with the signal's number: it is raised as the driver's own ``Terminated`` instead, so the run
    ends the way any interrupted run ends."""
    from nemo_rl_mtp.reporting.console import Terminated

    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    try:
        yield
    except SystemExit as exit:
        if exit.code == signal.SIGTERM:
            raise Terminated() from None
        raise
    finally:
        if on_main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def workers_use_driver_environment():
    """Around ``ray.init``: Ray's ``uv run`` runtime-env hook switched off, so workers start from
    the driver's interpreter (Ray's documented switch), and put back afterwards."""
    from nemo_rl_mtp.megatron_compat import ray_compat

    with ray_compat.uv_hook_disabled() as switched:
        if switched:
            logger.info("Ray workers start from this interpreter (%s); Ray's uv run hook is off", sys.executable)
        yield


def local_ray_processes_alive() -> bool:
    """False once a Ray process this driver started has died, e.g. when a SIGTERM or Ctrl-C
    reached the whole process group; calls into the cluster would then wait for its GCS for a
    minute. (Always True for a joined cluster, whose processes this driver does not own.)"""
    from nemo_rl_mtp.megatron_compat.ray_compat import local_processes_dead

    return not local_processes_dead()


def shutdown_ray() -> None:
    """Stop the Ray processes this driver started (or leave the cluster it joined) now, instead
    of leaving them to notice the driver is gone."""
    if ray.is_initialized():
        ray.shutdown()


def world_size(cluster_cfg: ClusterConfig) -> int:
    return cluster_cfg.num_nodes * cluster_cfg.workers_per_node


def reserve_workers(cluster_cfg: ClusterConfig) -> PlacementGroup:
    """One bundle per worker; PACK keeps a node's workers together. Raises PlacementError at once
    when the cluster has too few resources in total, and after ``PLACEMENT_TIMEOUT_S`` when they
    exist but are not free."""
    bundle = {"CPU": cluster_cfg.cpus_per_worker}
    if cluster_cfg.gpus_per_worker:
        bundle["GPU"] = cluster_cfg.gpus_per_worker
    workers = world_size(cluster_cfg)
    needed = {name: amount * workers for name, amount in bundle.items()}
    _check_cluster_has(needed, ray.cluster_resources(), workers)
    group = placement_group([dict(bundle) for _ in range(workers)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(
            f"cluster: {workers} workers need {_resources(needed)}; within {PLACEMENT_TIMEOUT_S} s the Ray cluster "
            f"had {_resources(ray.available_resources(), needed)} free (of {_resources(ray.cluster_resources(), needed)})"
        )
    return group


def _check_cluster_has(needed: dict[str, float], total: dict[str, float], workers: int) -> None:
    if any(total.get(name, 0) < amount for name, amount in needed.items()):
        raise PlacementError(
            f"cluster: {workers} workers (num_nodes x workers_per_node) need {_resources(needed)}, "
            f"the Ray cluster has {_resources(total, needed)}"
        )


def _resources(amounts: dict[str, float], names=None) -> str:
    return ", ".join(f"{amounts.get(name, 0):g} {name}" for name in (names or amounts))


def in_bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


# Ray's worker processes listen on 10002-19999 (its default min/max_worker_port).
RAY_WORKER_PORTS_END = 20000


def rendezvous_port() -> int:
    """A free port for rank 0 to listen on seconds later, once its worker has started: chosen
    between Ray's worker ports and the kernel's ephemeral range, where no outgoing connection
    (Ray opens many) can take it in the meantime, as one from the ephemeral range was seen to be
    (EADDRINUSE at rendezvous). Any free port where that window is empty."""
    window = range(RAY_WORKER_PORTS_END, ephemeral_ports_start())
    for port in random.sample(window, min(200, len(window))):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def ephemeral_ports_start() -> int:
    """Where the kernel's range for outgoing connections' local ports starts (Linux's default
    where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@ray.remote(num_cpus=0)
def _address_on_this_node() -> str:
    return f"tcp://{ray.util.get_node_ip_address()}:{rendezvous_port()}"


def rendezvous_address(group: PlacementGroup) -> str:
    """tcp://<ip>:<free port> on the node of bundle 0, where rank 0 will listen."""
    return ray.get(_address_on_this_node.options(scheduling_strategy=in_bundle(group, 0)).remote())
