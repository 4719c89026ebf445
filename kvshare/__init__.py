"""kvshare: cluster-wide KV-cache sharing for LLM inference on Ray.

The library (hashing, layout, tiers, pool, transports, SDK) lives here; Ray actors live in
``actors`` and routing in ``router``. ``kvshare.deploy``/``kvshare.shutdown`` are forwarded
lazily to ``actors.deploy`` so that importing kvshare never imports Ray actors.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def deploy(*args: Any, **kwargs: Any) -> Any:
    """Start kvshare on a Ray cluster; see :func:`actors.deploy.deploy`."""
    from importlib import import_module

    return import_module("actors.deploy").deploy(*args, **kwargs)


def shutdown(*args: Any, **kwargs: Any) -> Any:
    """Stop kvshare on a Ray cluster; see :func:`actors.deploy.shutdown`."""
    from importlib import import_module

    return import_module("actors.deploy").shutdown(*args, **kwargs)
