"""Ray: start or join a cluster, reserve one placement-group bundle per policy worker, and find
the rendezvous address for torch.distributed on the node of the first worker.

On a single machine the workers run the driver's own interpreter and virtual environment. Ray's
uv integration (on by default when the driver runs under ``uv run``) would instead build a fresh
virtual environment from a copy of the working directory for every run: tens of seconds per
start, and with a ``PYENV_VERSION`` or ``UV_PYTHON`` that names another Python it tries to
download an interpreter. Joining a cluster (``cluster.address``) keeps Ray's default, which is
how the locked environment reaches the other nodes."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_rl_mtp.utils.config_schema import ClusterConfig

logger = logging.getLogger(__name__)


# How long a placement group may wait for resources the cluster has in total but not free.
PLACEMENT_TIMEOUT_S = 60


class PlacementError(RuntimeError):
    """The cluster cannot host the configured workers."""


def init_ray(cluster_cfg: ClusterConfig) -> None:
    """Join ``cluster.address`` when given, else start a local Ray instance (once per process)."""
    if ray.is_initialized():
        return
    with driver_sigterm_handler_kept():
        if cluster_cfg.address is not None:
            ray.init(address=cluster_cfg.address, log_to_driver=True)
            logger.info("joined Ray cluster at %s", cluster_cfg.address)
        else:
            workers_use_driver_environment()
            ray.init(include_dashboard=False, log_to_driver=True)
            logger.info("started a local Ray instance: %s", ray.cluster_resources())


@contextlib.contextmanager
def driver_sigterm_handler_kept():
    """Put back the driver's SIGTERM handler, which ``ray.init`` replaces (with ``sys.exit``, and
    its core worker with a crash dump, exit status 134), so a driver that cleans up on SIGTERM
    still does."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    try:
        yield
    finally:
        if on_main_thread and previous is not None:
            signal.signal(signal.SIGTERM, previous)


def workers_use_driver_environment() -> None:
    """Switch off Ray's ``uv run`` runtime-env hook for a local instance, so workers start from
    the driver's interpreter (Ray's documented switch, read by ``ray.init``; idempotent)."""
    from ray._private import ray_constants

    if not ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV:
        return
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    logger.info("Ray workers start from this interpreter (%s); Ray's uv run hook is off for this local instance", sys.executable)


def local_ray_processes_alive() -> bool:
    """False once a Ray process this driver started has died, e.g. when a SIGTERM or Ctrl-C
    reached the whole process group; calls into the cluster would then wait for its GCS for a
    minute. (Always True for a joined cluster, whose processes this driver does not own.)"""
    node = ray._private.worker._global_node
    return node is None or not node.dead_processes()


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


@ray.remote(num_cpus=0)
def _address_on_this_node() -> str:
    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


def rendezvous_address(group: PlacementGroup) -> str:
    """tcp://<ip>:<free port> on the node of bundle 0, where rank 0 will listen."""
    return ray.get(_address_on_this_node.options(scheduling_strategy=in_bundle(group, 0)).remote())
