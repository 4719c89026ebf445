"""Keeping the index shards alive: start them, find them again, recreate one that is gone.

A shard actor is detached and restartable, so a crash restarts it in place. ``ray.kill``
without restart (or a restart budget spent) ends it for good: its name is released and every
handle to it fails with ``ActorDiedError``. Then:

- :class:`IndexKeeper` (run by the watcher every round) sees the name missing and starts a
  fresh shard under it; the new shard asks every pool to republish its inventory
  (:meth:`kvshare.actors.index.actor.IndexService.ask_pools_to_republish`), so its entries come back
  without the old process;
- :func:`~kvshare.actors.index.names.resolve_shards` lets an
  :class:`~kvshare.actors.index.client.IndexClient` holding dead handles look the shards up by
  name again (it does so itself, at most every ``REFRESH_S``).

Until then the index is unavailable, which callers already treat as a cache miss.

Shards (and the watcher that keeps them) live on the head node, pinned hard
(:func:`control_plane_placement`): the head outlives every worker node, while a soft pin lets
a busy head spill a shard onto a worker node whose removal then takes the index with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvshare.actors.config import IndexConfig, index_name
from kvshare.actors.index.names import find_shard

log = logging.getLogger(__name__)
HEAD_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource



def control_plane_placement() -> NodeAffinitySchedulingStrategy:
    """Where the index shards and the watcher run: the head node, hard; the caller's node,
    soft, where the cluster names no head (the ``node:__internal_head__`` resource)."""
    head = [n["NodeID"] for n in ray.nodes()  # type: ignore[no-untyped-call]
            if n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {})]
    if len(head) == 1:
        return NodeAffinitySchedulingStrategy(head[0], soft=False)
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)


def start_shard(config: IndexConfig, scheduling_strategy: Any = None) -> Any:
    """The named, detached shard ``config.shard`` (an existing one is returned as it is)."""
    from kvshare.actors.index.actor import GlobalIndexActor

    options: dict[str, Any] = {
        "name": index_name(config.shard), "namespace": config.ray_namespace,
        "lifetime": "detached", "get_if_exists": True,
    }
    if scheduling_strategy is not None:
        options["scheduling_strategy"] = scheduling_strategy
    return GlobalIndexActor.options(**options).remote(config)


class IndexKeeper:
    """Recreates index shards whose actors are gone for good (see the module docstring)."""

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        self.recreated = 0
        self.last_recreated_at: float | None = None  # time.time() of the last recreation

    def declare(self, name: str, hash_size: int, fingerprint: str) -> None:
        """Remember a namespace so a recreated shard knows it from its first call."""
        known = tuple(n for n in self.config.namespaces if n[0] != name)
        self.config = replace(self.config, namespaces=(*known, (name, hash_size, fingerprint)))

    def check(self) -> list[int]:
        """Start every shard whose name is free again; returns the shards started."""
        started = []
        for i in range(self.config.num_shards):
            if find_shard(self.config.ray_namespace, i) is not None:
                continue
            start_shard(replace(self.config, shard=i), control_plane_placement())
            started.append(i)
            self.recreated += 1
            self.last_recreated_at = time.time()
            log.warning("index shard %d was gone for good: started a new one", i)
        return started
