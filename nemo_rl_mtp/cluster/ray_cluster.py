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
run within ``cluster.node_probe_timeout_s``, naming the node and the cause its raylet gave."""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import socket
import sys
import threading
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_rl_mtp.config.schema import ClusterConfig

logger = logging.getLogger(__name__)


# How long a placement group may wait for resources the cluster has in total but not free.
PLACEMENT_TIMEOUT_S = 60


class PlacementError(RuntimeError):
    """The cluster cannot host the configured workers."""


def init_ray(cluster_cfg: ClusterConfig) -> None:
    """Join ``cluster.address`` when given (then probe its nodes), else start a new local Ray
    instance (once per process)."""
    if ray.is_initialized():
        return
    with driver_sigterm_handler_kept():
        if cluster_cfg.address is None:
            logger.info("starting a local Ray instance")
            # "local": a new instance, even where a previous Ray left its address behind.
            with workers_use_driver_environment():
                ray.init(address="local", include_dashboard=False, log_to_driver=True)
            logger.info("started a local Ray instance: %s", ray.cluster_resources())
            return
        if cluster_cfg.worker_python == "driver":
            with workers_use_driver_environment():
                ray.init(address=cluster_cfg.address, log_to_driver=True, runtime_env={"py_executable": sys.executable})
        else:
            ray.init(address=cluster_cfg.address, log_to_driver=True)
    logger.info("joined Ray cluster at %s (workers' Python: %s)", cluster_cfg.address, _worker_python(cluster_cfg))
    check_nodes_start_workers(cluster_cfg)


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
