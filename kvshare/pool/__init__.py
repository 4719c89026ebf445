"""TieredBlockPool: the bookkeeping of which block lives in which tier and slot.

- :mod:`~kvshare.pool.tiered`: :class:`TieredBlockPool` (LRU, leases, demotion, counters, events);
- :mod:`~kvshare.pool.books`: which block sits in which tier and slot;
- :mod:`~kvshare.pool.leases`: who holds which block until when;
- :mod:`~kvshare.pool.types`: configs and result objects (``Reserved | AlreadyPresent | ...``).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "TieredBlockPool": "kvshare.pool.tiered",
    "PoolConfig": "kvshare.pool.types",
    "TierSpec": "kvshare.pool.types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvshare.pool' has no attribute {name!r}")
    return getattr(import_module(module), name)
