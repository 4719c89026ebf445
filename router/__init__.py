"""Deciding where a request goes: the cost model, routing policies, the embeddable
:class:`CacheAwareRouter`, the OpenAI-compatible gateway and the trace simulator.

Names are imported lazily (``router.CacheAwareRouter`` loads :mod:`kvshare.router.core.embed` on first use).
"""

from __future__ import annotations

from kvshare.lazy import lazy_exports

_EXPORTS = {
    "CacheAwareRouter": "kvshare.router.core.embed",
    "RouterConfig": "kvshare.router.core.embed",
    "Tenant": "kvshare.router.core.embed",
    "InProcessIndex": "kvshare.router.core.embed",
    "CostModel": "kvshare.cost",
    "PrefillModel": "kvshare.cost",
    "Bandwidths": "kvshare.cost",
    "Decision": "kvshare.router.core.policy",
    "RouteRequest": "kvshare.router.core.policy",
    "Candidate": "kvshare.router.core.policy",
    "make_policy": "kvshare.router.core.registry",
    "POLICIES": "kvshare.router.core.registry",
    "Sharing": "kvshare.router.core.sources",
    "StaticWorkers": "kvshare.router.core.workers_view",
    "IndexWorkers": "kvshare.router.core.workers_view",
    "create_app": "kvshare.router.gateway.app",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
