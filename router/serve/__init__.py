"""kvshare on Ray Serve: the request router (``kvshare.router.serve:KVShareRequestRouter``), its
settings and prompt reading, and Serve deployments of reference and vLLM workers.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "KVShareRequestRouter": "kvshare.router.serve.request_router",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvshare.router.serve' has no attribute {name!r}")
    return getattr(import_module(module), name)
