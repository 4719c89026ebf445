"""The worker SDK: find, load and store KV blocks anywhere in the cluster.

- :mod:`~kvshare.client.sdk`: :class:`KVShareClient` (lookup, load, store; async and sync);
- :mod:`~kvshare.client.types`: what it hands back (plans, per-block outcomes);
- :mod:`~kvshare.client.fetch`: reading a plan's blocks from the pools that hold them;
- :mod:`~kvshare.client.remote`: which transport brings other nodes' blocks;
- :mod:`~kvshare.client.local`: an in-process client over a plain pool (tests, one process).

Names are imported lazily: ``from kvshare.client import KVShareClient`` loads the SDK only then.
"""

from __future__ import annotations

from kvshare.lazy import lazy_exports

_EXPORTS = {
    "KVShareClient": "kvshare.client.sdk",
    "LocalClient": "kvshare.client.local",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
