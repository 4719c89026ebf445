"""Admin pins on a node pool: leases an operator takes so a prefix cannot be evicted.

:class:`AdminPins` is a member of :class:`kvshare.actors.node_pool.NodePool` (whose actor serves
``pin_prefix``/``unpin_prefix``/``contains``); :mod:`kvshare.actors.admin` drives them across the
cluster. Pins are ordinary read leases of the holder ``admin:<name>``: eviction skips leased
blocks, the lease ends at its ttl (the pool's background round expires it) or on
``unpin_prefix``, and the liveness sweep never judges such a holder dead
(:func:`kvshare.actors.liveness.ray_holder_alive` answers None for it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvshare.pool.tiered import TieredBlockPool
from kvshare.types import BlockHash


class AdminPins:
    """The admin pins of one node's pools.

    ``pool_of(namespace)`` is the namespace's pool (KeyError naming the known ones);
    ``touched()`` tells the node pool that leases changed (its events go out sooner).
    """

    def __init__(self, pool_of: Callable[[str], TieredBlockPool], touched: Callable[[], None]) -> None:
        self._pool_of = pool_of
        self._touched = touched
        self._lock = threading.Lock()
        self._pins: dict[tuple[str, str], list[int]] = {}  # (namespace, holder) -> lease ids

    def contains(self, namespace: str, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each block is committed here (no LRU touch, no hit counted)."""
        pool = self._pool_of(namespace)
        return [h in pool for h in hashes]

    def pin_prefix(self, namespace: str, hashes: Sequence[BlockHash], holder: str,
                   ttl_s: float) -> int:
        """Lease the leading run of ``hashes`` held here under ``holder`` for ``ttl_s`` s.

        Replaces ``holder``'s earlier pins of this namespace on this node: the new leases are
        taken before the old ones end, so blocks both pins cover stay pinned throughout, and
        no lease leaks. Returns how many blocks are pinned (0 ends the old pin too).
        """
        pool = self._pool_of(namespace)
        hashes = list(hashes)
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
            raise ValueError(f"pin ttl_s must be positive seconds, got {ttl_s!r}")
        if not isinstance(holder, str) or not holder:
            raise ValueError("pin holder must be a non-empty string such as 'admin:<name>'")
        with self._lock:
            n = pool.prefix_len(hashes)
            leases = pool.pin(hashes[:n], holder, float(ttl_s)) if n else []
            run = next((i for i, lease in enumerate(leases) if lease is None), len(leases))
            ids = [lease.lease_id for lease in leases if lease is not None]
            keep, drop = ids[:run], ids[run:]  # a block evicted meanwhile ends the run
            pool.unpin(drop + self._pins.pop((namespace, holder), []))
            if keep:
                self._pins[(namespace, holder)] = keep
        self._touched()
        return len(keep)

    def unpin_prefix(self, namespace: str, holder: str) -> int:
        """End every lease of ``holder`` in ``namespace`` here; returns how many were live."""
        pool = self._pool_of(namespace)
        with self._lock:
            self._pins.pop((namespace, holder), None)
            return pool.release_holder(holder)
