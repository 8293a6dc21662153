"""A real Ray cluster of one-CPU nodes on this machine, for the Ray backend tests, and the check that a
client left nothing of itself in it.

Everything stays on loopback: the nodes are given 127.0.0.1, and the tests set
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing Ray so that it resolves this machine's address to
127.0.0.1 too.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Generator

import psutil
import ray
from ray.cluster_utils import Cluster

NODE = dict(num_cpus=1, object_store_memory=100 * 1024 * 1024, node_ip_address="127.0.0.1")
"""One node: one CPU, so ranks of one CPU each land on different nodes, as on different machines."""


@contextlib.contextmanager
def local_cluster(num_nodes: int) -> Generator[Cluster]:
    """Start a head and `num_nodes - 1` worker nodes and connect this process to them."""
    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
    try:
        for _ in range(num_nodes - 1):
            cluster.add_node(**NODE)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        gc.collect()  # Ray objects of the tests go now, not on some thread while ray.shutdown() runs
        ray.shutdown()
        cluster.shutdown()


def assert_ray_released(timeout: float = 10.0) -> None:
    """No placement group, no engine actor process, every CPU free again."""
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
    deadline = time.monotonic() + timeout
    while True:
        actors = [
            p.pid
            for p in psutil.Process().children(recursive=True)
            if "EngineCoreActor" in " ".join(_cmdline(p))
        ]
        free = ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]
        if not actors and free:
            return
        assert time.monotonic() < deadline, f"engine actors {actors} or their CPUs outlived the client"
        time.sleep(0.1)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []
