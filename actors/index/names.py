"""Finding index shards by their names: what an :class:`~kvshare.actors.index.client.IndexClient`
needs to look up a shard that was recreated (:mod:`~kvshare.actors.index.keeper` starts them)."""

from __future__ import annotations

from typing import Any

import ray

from kvshare.actors.config import index_name

REFRESH_S = 0.2
"""An :class:`IndexClient` with a dead shard handle looks the names up at most this often."""


def find_shard(ray_namespace: str, shard: int) -> Any | None:
    """The live named handle of ``shard``, or None when no actor holds the name."""
    try:
        return ray.get_actor(index_name(shard), namespace=ray_namespace)
    except ValueError:
        return None


def resolve_shards(ray_namespace: str, num_shards: int) -> list[Any] | None:
    """Handles of all ``num_shards`` shards by name; None while any of them is missing."""
    out = []
    for i in range(num_shards):
        handle = find_shard(ray_namespace, i)
        if handle is None:
            return None
        out.append(handle)
    return out
