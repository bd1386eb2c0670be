"""Ray: start or join a cluster, reserve one placement-group bundle per policy worker, and find
the rendezvous address for torch.distributed on the node of the first worker."""

from __future__ import annotations

import logging
import socket

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


def init_ray(cluster_cfg) -> None:
    """Join ``cluster.address`` when given, else start a local Ray instance (once per process)."""
    if ray.is_initialized():
        return
    if cluster_cfg.address is not None:
        ray.init(address=cluster_cfg.address, log_to_driver=True)
        logger.info("joined Ray cluster at %s", cluster_cfg.address)
    else:
        ray.init(include_dashboard=False, log_to_driver=True)
        logger.info("started a local Ray instance: %s", ray.cluster_resources())


def world_size(cluster_cfg) -> int:
    return cluster_cfg.num_nodes * cluster_cfg.workers_per_node


def reserve_workers(cluster_cfg) -> PlacementGroup:
    """One bundle per worker; PACK keeps a node's workers together."""
    bundle = {"CPU": cluster_cfg.cpus_per_worker}
    if cluster_cfg.gpus_per_worker:
        bundle["GPU"] = cluster_cfg.gpus_per_worker
    group = placement_group([dict(bundle) for _ in range(world_size(cluster_cfg))], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=600)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not place {world_size(cluster_cfg)} workers of {bundle} "
            f"(cluster resources: {ray.cluster_resources()}); check cluster.* in the config"
        )
    return group


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
