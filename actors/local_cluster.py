"""A multi-node Ray cluster emulated on this machine, for the demo, examples and benchmarks.

``ray.cluster_utils.Cluster`` starts one raylet per emulated node, so kvshare places one node
pool per node and transfers between them take the cross-node paths (NIXL, object store), as
on a real cluster. :func:`local_cluster` starts it, connects this process as the driver and,
on exit (also on an exception), stops a kvshare deployment if one was made, the driver and
every raylet, and removes the cluster's temporary directory (its session logs).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import ray
from ray._common.utils import get_default_ray_temp_dir
from ray.cluster_utils import Cluster

from kvshare.actors.deploy import shutdown
from kvshare.discovery import RAY_NAMESPACE
from kvshare.ray_env import use_local_ray_defaults

log = logging.getLogger(__name__)
MiB = 2**20


def node_labels(nodes: int) -> list[dict[str, float]]:
    """The default custom resources: ``{"node_<i>": 1}`` on node ``i``, to pin actors there."""
    return [{f"node_{i}": 1} for i in range(nodes)]


@contextmanager
def local_cluster(
    nodes: int = 2,
    *,
    head_cpus: int = 1,
    node_cpus: int = 2,
    head_store_mib: int = 256,
    node_store_mib: int = 256,
    resources: Sequence[dict[str, float]] | None = None,
    ray_namespace: str | None = None,
    temp_prefix: str = "kvshare-ray-",
) -> Iterator[Cluster]:
    """A head plus ``nodes`` worker nodes, with this process connected to it.

    ``resources[i]`` are node ``i``'s custom resources (default :func:`node_labels`);
    ``ray_namespace`` is the driver's Ray namespace (kvshare's actors live in their own,
    :data:`kvshare.discovery.RAY_NAMESPACE`, whatever it is). Environment defaults for a local
    Ray (:func:`kvshare.ray_env.use_local_ray_defaults`) are applied first.
    """
    labels = list(resources) if resources is not None else node_labels(nodes)
    if len(labels) != nodes:
        raise ValueError(f"resources has {len(labels)} entries for {nodes} nodes: give one per node")
    use_local_ray_defaults()
    # Ray's Cluster records the head's address in the default Ray temp dir (/tmp/ray, or under
    # RAY_TMPDIR) whatever temp_dir it is given, and fails if that folder does not exist yet:
    # a fresh machine that never ran Ray (`make demo` first) has none.
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)  # type: ignore[no-untyped-call]
    temp_dir = tempfile.mkdtemp(prefix=temp_prefix)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "object_store_memory": head_store_mib * MiB,
        "include_dashboard": False, "temp_dir": temp_dir})
    try:
        for label in labels:
            cluster.add_node(num_cpus=node_cpus, object_store_memory=node_store_mib * MiB,
                             resources=label)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=ray_namespace, log_to_driver=False)
        yield cluster
    finally:
        _stop_deployment()
        _shutdown(cluster)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _shutdown(cluster: Cluster, attempts: int = 3) -> None:
    """Disconnect the driver and stop the cluster's nodes. A thread of the caller's that still
    calls Ray (a router's background refresh, a replica's feed) connects the driver again
    between the two, and ``Cluster.shutdown`` then refuses to remove the head: disconnect again
    and retry, so the nodes never outlive the run (the last refusal is raised)."""
    for attempt in range(attempts):
        ray.shutdown()
        try:
            cluster.shutdown()  # type: ignore[no-untyped-call]
            return
        except ValueError:
            if attempt == attempts - 1:
                raise


def _stop_deployment() -> None:
    if not ray.is_initialized():
        return
    try:
        shutdown(RAY_NAMESPACE)
    except Exception as exc:  # teardown must reach the cluster shutdown whatever happened
        log.warning("kvshare deployment did not stop cleanly: %s", exc)
