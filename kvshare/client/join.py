"""An engine process joining a kvshare deployment: Ray, then the namespace it serves.

Both checks run when an engine starts and fail with a ValueError that names the fix, so a
misconfigured engine never starts and silently misses (the vLLM connector and the SGLang
storage backend call them with their own name as ``engine``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvshare.layout import KVLayout
from kvshare.ray_env import stop_error_listener

STARTUP_S = 30.0
"""How long an engine's start-up asks an index that does not answer yet."""


def join_ray(address: str, ray_namespace: str, engine: str, where: str) -> None:
    """Join the Ray cluster at ``address`` (or ``$RAY_ADDRESS``) unless this process is
    already inside Ray; ``where`` names the setting that gives the address."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS", "")
    if not address:
        raise ValueError(
            f'{engine}: this process is not inside Ray: set "ray_address" in {where} (e.g. '
            '"auto" on a Ray node, or "HOST:6379")')
    try:
        ray.init(address=address, namespace=ray_namespace, log_to_driver=False)
    except ConnectionError as exc:
        raise ValueError(f"{engine}: no Ray cluster at {address!r} ({exc}): start one "
                         "(`ray start --head`) and kvshare on it (`kvshare up`)") from exc
    stop_error_listener()


def check_deployed(index: Any, namespace: str, layout: KVLayout, engine: str,
                   startup_s: float = STARTUP_S) -> None:
    """ValueError naming the fix unless the deployment serves ``namespace`` with ``layout``.

    The index is asked again until ``startup_s`` has passed: a process that has just joined Ray
    on a busy node (engines loading) can take longer for its first actor call than a request's
    lookup deadline allows, and an engine must not fail to start over that."""
    deadline = time.monotonic() + startup_s
    while True:
        try:
            known: dict[str, dict[str, Any]] = index.namespaces()
            break
        except Exception as exc:
            if time.monotonic() >= deadline:
                raise ValueError(f"{engine}: kvshare's index does not answer ({exc}) "
                                 f"within {startup_s:g} s: is kvshare deployed on this Ray "
                                 "cluster (`kvshare up`)?") from exc
            time.sleep(0.5)
    fix = (f"kvshare up --namespace {namespace} --layout MODEL/config.json "
           f"--dtype {layout.dtype} --block-tokens {layout.block_tokens}")
    info = known.get(namespace)
    if info is None:
        raise ValueError(f"{engine}: unknown kvshare namespace {namespace!r} "
                         f"(deployed: {sorted(known)}): start it with `{fix}`")
    have = str(info.get("layout_fingerprint", ""))
    if have and have != layout.fingerprint():
        raise ValueError(
            f"{engine}: namespace {namespace!r} was deployed with another KV layout ({have}) "
            f"than this engine's {layout.to_dict()} ({layout.fingerprint()}): deploy a "
            f"namespace for it (`{fix}` with another name) or match block_tokens and dtype")
