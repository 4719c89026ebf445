"""Shared fixtures. Cluster tests start real Ray clusters (``ray.cluster_utils.Cluster``)."""

from __future__ import annotations

import os

# Before ray is imported anywhere: keep loopback addresses, no usage stats, no auth token file.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

# Fast failure detection so a removed node is noticed within seconds (ENVIRONMENT.md).
FAST_HEALTH = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 500,
}


def start_cluster(num_workers: int = 2, object_store_mb: int = 300) -> Any:
    """A head (no CPUs for work) plus ``num_workers`` nodes, with ``ray.init`` connected.

    Each worker node gets a custom resource ``node_<i>`` to pin actors with. The caller
    shuts it down with :func:`stop_cluster`.
    """
    import ray
    from ray.cluster_utils import Cluster

    os.makedirs("/tmp/ray", exist_ok=True)  # Ray records the head's address there
    tmp = tempfile.mkdtemp(prefix="kvs-ray-", dir="/tmp")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": object_store_mb * 2**20,
            "_system_config": FAST_HEALTH,
            "temp_dir": tmp,
        },
    )
    for i in range(num_workers):
        cluster.add_node(
            num_cpus=2, object_store_memory=object_store_mb * 2**20, resources={f"node_{i}": 1}
        )
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="kvshare-test", log_to_driver=False)
    return cluster


def wait_dead(actor: Any, timeout_s: float = 30.0) -> None:
    """Block until calls to a killed actor fail: ``ray.kill`` is asynchronous, and a call
    sent right after it can still reach the running actor (a race CI has hit)."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.05)
    raise AssertionError(f"actor {actor} still answers {timeout_s}s after ray.kill")


def stop_cluster(cluster: Any) -> None:
    """Shut Ray down and unlink the shared-memory slabs this cluster's pools left behind
    (pool processes killed with their nodes cannot unlink their own segments)."""
    import glob

    import ray

    node_ids: list[str] = []
    try:
        node_ids = [n["NodeID"] for n in ray.nodes()]
    except Exception:  # Ray already gone: nothing to match against
        pass
    ray.shutdown()
    cluster.shutdown()
    for node_id in node_ids:
        for path in glob.glob(f"/dev/shm/kvshare-*-{node_id}-*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A head + 2-node Ray cluster shared by one test module."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


@pytest.fixture
def fresh_cluster() -> Iterator[Any]:
    """A head + 2-node cluster of its own, for tests that kill or remove nodes."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        stop_cluster(cluster)
