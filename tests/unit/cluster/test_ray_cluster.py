"""Placing the policy workers on a real local Ray instance that has too little: refused at once
when the cluster is too small, within the placement timeout when its resources are busy, with
the numbers either way; a worker's error reaches the console as one line."""

from __future__ import annotations

import socket
import time

import pytest
import ray

from nemo_rl_mtp.cluster import ray_cluster
from nemo_rl_mtp.cluster.ray_cluster import PlacementError, reserve_workers
from nemo_rl_mtp.config.load import load_config
from nemo_rl_mtp.reporting.console import one_line

CLUSTER_CPUS = 2


@pytest.fixture(scope="module")
def two_cpu_ray():
    with ray_cluster.workers_use_driver_environment():
        ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False)
    yield
    ray.shutdown()


def _cluster(workers: int):
    return load_config(overrides=[f"cluster.workers_per_node={workers}"]).cluster


def test_a_cluster_too_small_is_refused_at_once_with_the_numbers(two_cpu_ray):
    cluster = _cluster(4)  # loading the config imports megatron-core for its checks: not timed
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"4 workers .* need 4 CPU, the Ray cluster has 2 CPU"):
        reserve_workers(cluster)
    assert time.monotonic() - start < 5


@ray.remote(num_cpus=CLUSTER_CPUS)
class _HoldsEveryCPU:
    def ready(self) -> bool:
        return True


def test_busy_resources_fail_after_the_placement_timeout_naming_what_is_free(two_cpu_ray, monkeypatch):
    monkeypatch.setattr(ray_cluster, "PLACEMENT_TIMEOUT_S", 2)
    holder = _HoldsEveryCPU.remote()
    ray.get(holder.ready.remote())
    cluster = _cluster(2)
    start = time.monotonic()
    try:
        with pytest.raises(PlacementError, match=r"2 workers need 2 CPU; within 2 s the Ray cluster had 0 CPU free \(of 2 CPU\)"):
            reserve_workers(cluster)
    finally:
        ray.kill(holder)
    assert time.monotonic() - start < 10
    group = reserve_workers(_cluster(2))  # placeable again once the CPUs are free
    ray.util.remove_placement_group(group)


@ray.remote(num_cpus=0)
def _fails_in_a_worker():
    raise ValueError("policy.megatron_cfg.num_layers=3: first line\nsecond line")


def test_a_worker_error_is_one_line_naming_the_original_error(two_cpu_ray):
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(_fails_in_a_worker.remote())
    assert str(raised.value).count("\n") > 2  # the worker's traceback, which one_line leaves out
    assert one_line(raised.value) == "ValueError: policy.megatron_cfg.num_layers=3: first line"


def test_the_rendezvous_port_is_free_and_outside_the_ports_others_take_meanwhile():
    """Between Ray's worker ports and the kernel's ephemeral range (from which Ray's outgoing
    connections take theirs while rank 0's worker starts); a free port where that window is empty."""
    from nemo_rl_mtp.cluster import ray_cluster

    low = ray_cluster.ephemeral_ports_start()
    for _ in range(20):
        port = ray_cluster.rendezvous_port()
        assert ray_cluster.RAY_WORKER_PORTS_END <= port < low or low <= ray_cluster.RAY_WORKER_PORTS_END
        with socket.socket() as sock:
            sock.bind(("", port))  # free


def test_without_a_window_the_rendezvous_port_is_any_free_port(monkeypatch):
    from nemo_rl_mtp.cluster import ray_cluster

    monkeypatch.setattr(ray_cluster, "ephemeral_ports_start", lambda: 1024)
    port = ray_cluster.rendezvous_port()
    with socket.socket() as sock:
        sock.bind(("", port))
