"""The OpenAI-compatible gateway (FastAPI): request models and limits, admission, tenants,
forwarding and streaming to workers, admin routes, and ``kvshare gateway``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "create_app": "kvshare.router.gateway.app",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvshare.router.gateway' has no attribute {name!r}")
    return getattr(import_module(module), name)
