"""Admin operations over a running deployment: ``lookup``, ``pin_prefix``/``unpin_prefix``,
``prefetch``, ``clear`` (DESIGN.md, "Tiers and pools").

Plain functions; Ray must be initialised (``kvshare.actors.deploy.connect``) and kvshare deployed.
Pools and the index are found by name, as :mod:`kvshare.actors.deploy` does. A prefix is a list of
block hashes (bytes of the namespace's hash size), first block first.

- ``pin_prefix`` leases, on every node holding a leading run of the prefix, that run under
  the holder ``admin:<name>`` for ``ttl_s`` seconds: leased blocks are never evicted. Pinning
  the same name again replaces the earlier pin (no lease leaks); ``unpin_prefix`` ends it.
- ``prefetch`` makes one node hold the prefix: a Ray task pinned to that node (so the pool
  actor's request path is never busy with it) pulls the blocks it lacks from the other
  holders with :class:`~kvshare.transfer.reader.fetch.PeerFetcher` (fastest transport by the node's
  probed bandwidths, checksums verified) and stores them with ``keep_local``. Blocks no node
  can serve are misses with a reason; nothing wrong is ever stored.

Bad input (unknown namespace or node, malformed hashes, ttl <= 0) raises ValueError naming the
fix before anything changes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvshare.actors.config import POOL_PREFIX, RAY_NAMESPACE
from kvshare.actors.deploy import _named, get_index_client
from kvshare.actors.deploy import status as deploy_status
from kvshare.types import BlockHash, parse_location

HOLDER_PREFIX = "admin:"
CALL_TIMEOUT_S = 30.0
_prefetch_task: Any = None  # the Ray task over prefetch_here, made on first use


def _pools(ray_namespace: str, nodes: Sequence[str] | None = None) -> dict[str, Any]:
    """``{node_id: pool actor}`` of the deployment, or of ``nodes`` (ValueError if unknown)."""
    found = {name[len(POOL_PREFIX):]: name for name in _named(ray_namespace, POOL_PREFIX)}
    if not found:
        raise ValueError(f"no kvshare pools in Ray namespace {ray_namespace!r}: run `kvshare up` first")
    if nodes is not None:
        if isinstance(nodes, str) or not all(isinstance(n, str) for n in nodes):
            raise ValueError("nodes must be a list of node ids (strings)")
        unknown = sorted(set(nodes) - set(found))
        if unknown:
            raise ValueError(f"no kvshare pool on node(s) {unknown}: known nodes are {sorted(found)}")
        found = {n: found[n] for n in nodes}
    return {node: ray.get_actor(name, namespace=ray_namespace) for node, name in found.items()}


def check_prefix(namespace: str, hashes: Sequence[BlockHash], ray_namespace: str) -> list[BlockHash]:
    """The hashes as a list; ValueError if the namespace is unknown or a hash is malformed."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("namespace must be a non-empty string")
    known = get_index_client(ray_namespace).namespaces()
    info = known.get(namespace)
    if info is None:
        raise ValueError(f"unknown namespace {namespace!r}: deployed are {sorted(known)}")
    if isinstance(hashes, bytes | str) or not isinstance(hashes, Sequence):
        raise ValueError("hashes must be a list of block hashes (bytes), first block first")
    size = int(info["hash_size"])
    for i, h in enumerate(hashes):
        if not isinstance(h, bytes) or len(h) != size:
            raise ValueError(
                f"hash {i} must be {size} bytes (namespace {namespace!r}), got "
                f"{type(h).__name__} of length {len(h) if hasattr(h, '__len__') else '?'}"
            )
    return list(hashes)


def _holder(name: str) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise ValueError("pin name must be a non-empty string (at most 200 characters)")
    return HOLDER_PREFIX + name


def lookup(namespace: str, hashes: Sequence[BlockHash], *,
           ray_namespace: str = RAY_NAMESPACE) -> dict[str, dict[str, Any]]:
    """Who holds the prefix, from the index: ``{node: {"prefix_blocks": n, "tiers":
    {tier: blocks}}}`` (node locations by node id; worker caches as ``worker:<id>``).
    Only locations holding at least the first block appear."""
    hashes = check_prefix(namespace, hashes, ray_namespace)
    match = get_index_client(ray_namespace).match(namespace, hashes)
    out: dict[str, dict[str, Any]] = {}
    for loc, m in match.locations.items():
        if m.prefix_blocks <= 0:
            continue
        kind, ident = parse_location(loc)
        out[ident if kind == "node" else str(loc)] = {
            "prefix_blocks": m.prefix_blocks,
            "tiers": {t.value: n for t, n in m.tier_counts.items() if n},
        }
    return out


MAX_PIN_TTL_S = 30 * 86_400.0
"""The longest pin; a longer (or infinite) ``ttl_s`` is refused before anything is pinned."""


def pin_prefix(namespace: str, hashes: Sequence[BlockHash], ttl_s: float, name: str,
               nodes: Sequence[str] | None = None, *,
               ray_namespace: str = RAY_NAMESPACE) -> dict[str, int]:
    """Pin the leading run of the prefix each node (or each of ``nodes``) holds, for
    ``ttl_s`` s under holder ``admin:<name>``; returns ``{node: pinned_blocks}`` (0: the
    node holds no leading block; an earlier pin of ``name`` there ended)."""
    if (isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float)
            or not 0 < ttl_s <= MAX_PIN_TTL_S):
        raise ValueError(f"ttl_s must be positive seconds up to {MAX_PIN_TTL_S:g} (30 days), "
                         f"got {ttl_s!r}")
    holder = _holder(name)
    hashes = check_prefix(namespace, hashes, ray_namespace)
    pools = _pools(ray_namespace, nodes)
    refs = {n: p.pin_prefix.remote(namespace, hashes, holder, float(ttl_s)) for n, p in pools.items()}
    return {n: int(ray.get(r, timeout=CALL_TIMEOUT_S)) for n, r in refs.items()}


def unpin_prefix(namespace: str, name: str, nodes: Sequence[str] | None = None, *,
                 ray_namespace: str = RAY_NAMESPACE) -> int:
    """End the pin ``name`` of ``namespace`` on every node (or ``nodes``); returns how many
    block leases were still live."""
    holder = _holder(name)
    check_prefix(namespace, [], ray_namespace)
    pools = _pools(ray_namespace, nodes)
    refs = [p.unpin_prefix.remote(namespace, holder) for p in pools.values()]
    return sum(int(n) for n in ray.get(refs, timeout=CALL_TIMEOUT_S))


def clear(namespace: str, nodes: Sequence[str] | None = None, *,
          ray_namespace: str = RAY_NAMESPACE) -> int:
    """Drop every unleased block of ``namespace`` on every node (or ``nodes``); returns how
    many were removed (pinned and in-use blocks stay)."""
    check_prefix(namespace, [], ray_namespace)
    pools = _pools(ray_namespace, nodes)
    return sum(int(n) for n in ray.get([p.clear.remote(namespace) for p in pools.values()],
                                       timeout=CALL_TIMEOUT_S))


def prefetch(namespace: str, hashes: Sequence[BlockHash], node: str, *,
             deadline_s: float = 10.0, ray_namespace: str = RAY_NAMESPACE) -> dict[str, Any]:
    """Make ``node``'s pool hold the prefix. Returns ``{"present": a, "fetched": b,
    "missing": c, "reasons": {reason: blocks}, "served_by": {source: blocks}, "seconds": s}``
    with ``a + b + c == len(hashes)``; a block is missing when no other node could serve it
    in time (dead source, not cached anywhere, corrupt, deadline) or it could not be stored."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float) or not deadline_s > 0:
        raise ValueError(f"deadline_s must be positive seconds, got {deadline_s!r}")
    hashes = check_prefix(namespace, hashes, ray_namespace)
    if not isinstance(node, str):
        raise ValueError("node must be a node id (string); `kvshare status` lists them")
    _pools(ray_namespace, [node])
    global _prefetch_task
    if _prefetch_task is None:
        _prefetch_task = ray.remote(num_cpus=0, max_retries=0)(prefetch_here)
    task = _prefetch_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    ref = task.remote(namespace, hashes, float(deadline_s), ray_namespace)
    out: dict[str, Any] = ray.get(ref, timeout=deadline_s + CALL_TIMEOUT_S)
    return out


def prefetch_here(namespace: str, hashes: list[BlockHash], deadline_s: float,
                  ray_namespace: str) -> dict[str, Any]:
    """The body of :func:`prefetch`, run on the target node (any process there)."""
    import numpy as np

    from kvshare.actors.deploy import get_pool
    from kvshare.transfer.base import Transport, TransportUnavailable
    from kvshare.transfer.reader.control import ActorControl
    from kvshare.transfer.reader.fetch import PeerFetcher
    from kvshare.transfer.reader.objstore import ObjStoreTransport
    from kvshare.transfer.reader.shm import ShmTransport

    start = time.monotonic()
    node = ray.get_runtime_context().get_node_id()
    pool = get_pool(node, ray_namespace)
    have = ray.get(pool.contains.remote(namespace, hashes), timeout=CALL_TIMEOUT_S)
    todo = [h for h, ok in zip(hashes, have, strict=True) if not ok]
    out: dict[str, Any] = {"node": node, "present": len(hashes) - len(todo), "fetched": 0,
                           "missing": 0, "reasons": {}, "served_by": {}}
    if not todo:
        return {**out, "seconds": time.monotonic() - start}
    slab = ray.get(pool.slab_info.remote(namespace), timeout=CALL_TIMEOUT_S)
    bw = ray.get(pool.transfer_bandwidths.remote(), timeout=CALL_TIMEOUT_S)["transports"]
    me = f"pid:{os.getpid()}"
    transports: dict[str, Transport] = {"shm": ShmTransport(node, holder=me),
                                        "objstore": ObjStoreTransport(me)}
    if os.environ.get("KVSHARE_NIXL", "1") != "0":
        try:
            from kvshare.transfer.reader.nixl import NixlTransport

            transports["nixl"] = NixlTransport(f"{namespace}/prefetch/{node[:12]}/{os.getpid()}-{time.time_ns()}")
        except (TransportUnavailable, ImportError):
            pass  # the object store reaches every node

    def control(loc: Any) -> Any:
        try:
            return ActorControl(get_pool(parse_location(loc)[1], ray_namespace), namespace)
        except Exception:  # its pool is gone: a dead source
            return None

    try:
        fetcher = PeerFetcher(node, namespace, control, transports, bandwidth=bw,
                              index=get_index_client(ray_namespace))
        dest = list(np.empty((len(todo), slab.slot_bytes), dtype=np.uint8))
        remaining = max(deadline_s - (time.monotonic() - start), 0.001)
        res = fetcher.fetch(todo, dest, deadline_s=remaining, keep_local=True)
    finally:
        for t in transports.values():
            t.close()
    arrived = sum(1 for o in res.outcomes if o.ok)
    reasons = res.reasons()
    if arrived > res.kept_local:
        reasons["not stored"] = arrived - res.kept_local
    served: dict[str, int] = {}
    for s in res.served_by:
        if s:
            served[s] = served.get(s, 0) + 1
    return {**out, "fetched": res.kept_local, "missing": len(todo) - res.kept_local,
            "reasons": reasons, "served_by": served, "seconds": time.monotonic() - start}


class ClusterAdmin:
    """The admin functions bound to one deployment's Ray namespace (the gateway holds one)."""

    def __init__(self, ray_namespace: str = RAY_NAMESPACE) -> None:
        self.ray_namespace = ray_namespace

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """The deployment's status snapshot (:func:`kvshare.actors.deploy.status`)."""
        return deploy_status(self.ray_namespace, timeout_s=timeout_s)

    def node_liveness(self) -> dict[str, bool]:
        """``{node_id: alive}`` from Ray's node table (one GCS call, no actor calls)."""
        return {n["NodeID"]: bool(n["Alive"]) for n in ray.nodes()}  # type: ignore[no-untyped-call]

    def lookup(self, namespace: str, hashes: Sequence[BlockHash]) -> dict[str, dict[str, Any]]:
        return lookup(namespace, hashes, ray_namespace=self.ray_namespace)

    def pin_prefix(self, namespace: str, hashes: Sequence[BlockHash], ttl_s: float, name: str,
                   nodes: Sequence[str] | None = None) -> dict[str, int]:
        return pin_prefix(namespace, hashes, ttl_s, name, nodes, ray_namespace=self.ray_namespace)

    def unpin_prefix(self, namespace: str, name: str, nodes: Sequence[str] | None = None) -> int:
        return unpin_prefix(namespace, name, nodes, ray_namespace=self.ray_namespace)

    def prefetch(self, namespace: str, hashes: Sequence[BlockHash], node: str,
                 deadline_s: float = 10.0) -> dict[str, Any]:
        return prefetch(namespace, hashes, node, deadline_s=deadline_s,
                        ray_namespace=self.ray_namespace)

    def clear(self, namespace: str, nodes: Sequence[str] | None = None) -> int:
        return clear(namespace, nodes, ray_namespace=self.ray_namespace)
