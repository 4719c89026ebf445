"""How a process finds a kvshare deployment through Ray: the names the cluster registers under.

This is the SDK's half of a contract; the cluster layer (``actors``) is the other half. A
deployment (``kvshare up`` / :func:`kvshare.actors.deploy.deploy`) starts named, detached Ray actors
in one Ray namespace (:data:`RAY_NAMESPACE` unless it was told another):

- ``kvshare-index-{i}`` (:func:`index_name`): index shard ``i``. Shard 0 answers
  ``client(timeout_s)`` with the deployment's index client, a :class:`ClusterIndex` that
  knows every shard (the SDK never needs to know how the index is sharded);
- ``kvshare-pool-{node_id}`` (:func:`pool_name`): the node pool of a node; its ``transfer_*``
  endpoints are what :class:`~kvshare.transfer.reader.control.ActorControl` calls, and
  ``transfer_bandwidths()`` says what the pool measured;
- ``kvshare-watcher`` (:data:`WATCHER_NAME`): the deployment's watcher.

An engine's connector (the reference worker, vLLM's) uses :func:`find_index` and
:func:`find_pool` from inside its own process; ``actors`` registers its actors under these
names and implements those calls. Nothing here imports the cluster layer.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import ray

from kvshare.workers import IndexQuery, WorkerRegistrar

RAY_NAMESPACE = "kvshare"
"""Ray namespace of every kvshare actor (named, detached)."""

INDEX_NAME = "kvshare-index-{shard}"
POOL_PREFIX = "kvshare-pool-"
WATCHER_NAME = "kvshare-watcher"


def pool_name(node_id: str) -> str:
    """The Ray actor name of the pool on ``node_id``."""
    return f"{POOL_PREFIX}{node_id}"


def index_name(shard: int) -> str:
    """The Ray actor name of index shard ``shard``."""
    return INDEX_NAME.format(shard=shard)


@runtime_checkable
class ClusterIndex(IndexQuery, WorkerRegistrar, Protocol):
    """What an engine process needs from the deployment's index: matches and the worker
    registry. Picklable (it holds actor handles), so it can be handed to actors."""


def find_index(ray_namespace: str = RAY_NAMESPACE, timeout_s: float = 5.0) -> ClusterIndex:
    """The deployment's index client, handed out by index shard 0.

    ``timeout_s`` bounds every call the client makes later (an index that does not answer in
    time is a miss). Raises ValueError when no deployment runs in ``ray_namespace``.
    """
    first = ray.get_actor(index_name(0), namespace=ray_namespace)
    client: ClusterIndex = ray.get(first.client.remote(timeout_s), timeout=60)  # type: ignore[assignment]
    return client


def find_pool(node_id: str, ray_namespace: str = RAY_NAMESPACE) -> Any | None:
    """The pool actor of ``node_id``, or None when that node has none (or it is gone)."""
    try:
        return ray.get_actor(pool_name(node_id), namespace=ray_namespace)
    except ValueError:
        return None


def this_node() -> str:
    """The Ray node id of this process."""
    return str(ray.get_runtime_context().get_node_id())
