"""Deciding where a request goes: the cost model, routing policies, the embeddable
:class:`CacheAwareRouter`, the OpenAI-compatible gateway and the trace simulator.

Names are imported lazily (``router.CacheAwareRouter`` loads :mod:`router.embed` on first use).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CacheAwareRouter": "router.embed",
    "RouterConfig": "router.embed",
    "Tenant": "router.embed",
    "InProcessIndex": "router.embed",
    "CostModel": "kvshare.cost",
    "PrefillModel": "kvshare.cost",
    "Bandwidths": "kvshare.cost",
    "Decision": "router.policy",
    "RouteRequest": "router.policy",
    "Candidate": "router.policy",
    "make_policy": "router.policy",
    "POLICIES": "router.policy",
    "Sharing": "router.sources",
    "StaticWorkers": "router.workers_view",
    "IndexWorkers": "router.workers_view",
    "create_app": "router.gateway",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'router' has no attribute {name!r}")
    return getattr(import_module(module), name)
