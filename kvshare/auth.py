"""Who may use a worker, and salts nobody can guess: both from one cluster secret.

- **Cluster secret**: ``KVSHARE_CLUSTER_SECRET`` (hex or text) or the file named by
  ``KVSHARE_CLUSTER_SECRET_FILE``; otherwise the one ``kvshare up`` stores in the Ray cluster
  (:func:`cluster_secret`, created once at random, readable only by processes in the cluster).
- **Tenant salts**: an API key entry without an explicit ``salt`` gets
  ``HMAC-SHA256(secret, "kvshare-salt/v1/" + tenant)`` (:func:`tenant_salt`), so knowing a
  tenant's name tells nothing about its block hashes.
- **Worker tokens**: workers serve routed requests only with ``Authorization: Bearer <token>``
  (the same header vLLM's ``--api-key`` checks). ``KVSHARE_WORKER_TOKENS="new,old"`` lists the
  accepted tokens, the first is the one a gateway sends; without it the token is derived from
  the cluster secret (:meth:`WorkerAuth.from_secret`). Rotation: give workers ``"new,old"``,
  then gateways ``"new"``, then workers ``"new"``; no request is refused on the way.

A worker with no token at all (standalone, no cluster: it has no cache either) serves anyone.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

SECRET_ENV = "KVSHARE_CLUSTER_SECRET"
SECRET_FILE_ENV = "KVSHARE_CLUSTER_SECRET_FILE"
TOKENS_ENV = "KVSHARE_WORKER_TOKENS"
_MIN_SECRET = 16
_KV_KEY = b"kvshare/cluster_secret"
_KV_NAMESPACE = "kvshare"


def secret_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret an operator set (``KVSHARE_CLUSTER_SECRET[_FILE]``), or None."""
    env = os.environ if env is None else env
    raw = env.get(SECRET_ENV, "")
    if not raw and env.get(SECRET_FILE_ENV):
        with open(env[SECRET_FILE_ENV], encoding="utf-8") as f:
            raw = f.read().strip()
    if not raw:
        return None
    if len(raw) < _MIN_SECRET:
        raise ValueError(f"{SECRET_ENV} must have at least {_MIN_SECRET} characters "
                         "(e.g. `openssl rand -hex 32`)")
    return raw.encode()


def cluster_secret(create: bool = False) -> bytes | None:
    """The operator's secret (:func:`secret_from_env`), else the one kept in the connected Ray
    cluster's internal KV (``create``: make a random one there if there is none, as
    ``kvshare up`` does); None when neither exists or Ray is not connected."""
    mine = secret_from_env()
    if mine is not None:
        return mine
    import ray

    if not ray.is_initialized():
        return None
    from ray.experimental import internal_kv

    found = internal_kv._internal_kv_get(_KV_KEY, namespace=_KV_NAMESPACE)
    if found is None and create:
        internal_kv._internal_kv_put(_KV_KEY, secrets.token_hex(32).encode(), overwrite=False,
                                     namespace=_KV_NAMESPACE)
        found = internal_kv._internal_kv_get(_KV_KEY, namespace=_KV_NAMESPACE)
    return bytes(found) if found is not None else None


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The default cache salt of ``tenant`` under ``secret`` (hex; not guessable)."""
    return hmac.new(secret, b"kvshare-salt/v1/" + tenant.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class WorkerAuth:
    """The tokens a worker accepts; ``tokens[0]`` is the one gateways send. Empty = open."""

    tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if any(len(t) < _MIN_SECRET for t in self.tokens):
            raise ValueError(f"worker tokens must have at least {_MIN_SECRET} characters")

    @classmethod
    def from_secret(cls, secret: bytes | None, env: Mapping[str, str] | None = None) -> WorkerAuth:
        """``KVSHARE_WORKER_TOKENS`` if set, else the token derived from ``secret`` (if any)."""
        env = os.environ if env is None else env
        listed = tuple(t.strip() for t in env.get(TOKENS_ENV, "").split(",") if t.strip())
        if listed:
            return cls(listed)
        if secret is None:
            return cls()
        return cls((hmac.new(secret, b"kvshare-worker-token/v1", hashlib.sha256).hexdigest(),))

    @property
    def required(self) -> bool:
        return bool(self.tokens)

    def header(self) -> dict[str, str]:
        """What a gateway adds to each request it sends a worker."""
        return {"authorization": f"Bearer {self.tokens[0]}"} if self.tokens else {}

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries an accepted token (constant time
        per token); always True for an open worker."""
        if not self.tokens:
            return True
        value = authorization or ""
        given = value[7:].strip() if value.lower().startswith("bearer ") else ""
        return any(hmac.compare_digest(given.encode(), t.encode()) for t in self.tokens)

