"""TieredBlockPool: the bookkeeping of which block lives in which tier and slot.

- :mod:`~kvshare.pool.tiered`: :class:`TieredBlockPool` (LRU, leases, demotion, counters, events);
- :mod:`~kvshare.pool.books`: which block sits in which tier and slot;
- :mod:`~kvshare.pool.leases`: who holds which block until when;
- :mod:`~kvshare.pool.types`: configs and result objects (``Reserved | AlreadyPresent | ...``);
- :mod:`~kvshare.pool.sizing`: the hit rate each tier would have at other sizes;
- :mod:`~kvshare.pool.value`: what each tier is worth (prefill saved less time spent moving).
"""

from __future__ import annotations

from kvshare.lazy import lazy_exports

_EXPORTS = {
    "TieredBlockPool": "kvshare.pool.tiered",
    "PoolConfig": "kvshare.pool.types",
    "TierSpec": "kvshare.pool.types",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
