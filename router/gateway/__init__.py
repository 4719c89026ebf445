"""The OpenAI-compatible gateway (FastAPI): request models and limits, admission, tenants,
forwarding and streaming to workers, admin routes, and ``kvshare gateway``.
"""

from __future__ import annotations

from kvshare.lazy import lazy_exports

_EXPORTS = {
    "create_app": "kvshare.router.gateway.app",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
