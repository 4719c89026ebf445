"""kvshare on Ray Serve: the request router (``kvshare.router.serve:KVShareRequestRouter``), its
settings and prompt reading, and Serve deployments of reference and vLLM workers.
"""

from __future__ import annotations

from kvshare.lazy import lazy_exports

_EXPORTS = {
    "KVShareRequestRouter": "kvshare.router.serve.request_router",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
