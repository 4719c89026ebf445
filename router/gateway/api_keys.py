"""API keys: which tenant a gateway request belongs to, and the salt that roots its hashes.

A tenant's salt roots its block hashes, so one tenant can never be routed by, or hit,
another's blocks; only admin keys may pin, unpin or prefetch (:mod:`kvshare.router.gateway.admin_routes`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

from kvshare.auth import cluster_secret, tenant_salt
from kvshare.router.core.embed import Tenant


def load_api_keys(path: str | None, secret: bytes | None = None) -> dict[str, Tenant]:
    """``{key: {"tenant": name, "salt": s, "admin": false}}`` from a JSON file; the salt
    defaults to one derived from the cluster secret and the tenant's name
    (:func:`kvshare.auth.tenant_salt`), so tenants are isolated unless two share a salt on
    purpose and no salt can be guessed from a name; only keys with ``"admin": true`` may pin,
    unpin or prefetch."""
    if path is None:
        return {}
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return parse_api_keys(raw, secret)


_PROCESS_SECRET = secrets.token_hex(32).encode()  # when no cluster secret is set


def parse_api_keys(raw: Any, secret: bytes | None = None) -> dict[str, Tenant]:
    """See :func:`load_api_keys`; without ``secret`` the cluster's (:func:`kvshare.auth.cluster_secret`)
    or, failing that, this process's random one (salts then change when it restarts)."""
    secret = secret or cluster_secret() or _PROCESS_SECRET
    if not isinstance(raw, Mapping):
        raise ValueError("API keys must be a JSON object {key: {tenant, salt}}")
    out = {}
    for key, spec in raw.items():
        if isinstance(spec, str):
            spec = {"tenant": spec}
        if not isinstance(spec, Mapping) or not isinstance(spec.get("tenant"), str):
            raise ValueError(f"API key entry for {key[:4]}... needs a 'tenant' name")
        admin = spec.get("admin", False)
        if not isinstance(admin, bool):
            raise ValueError(f"API key entry for {key[:4]}...: 'admin' must be true or false")
        salt = spec.get("salt")
        cap = spec.get("max_inflight")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"API key entry for {key[:4]}...: 'max_inflight' must be an int >= 1")
        out[str(key)] = Tenant(spec["tenant"], str(salt) if salt is not None
                               else tenant_salt(secret, spec["tenant"]), admin, cap)
    return out
