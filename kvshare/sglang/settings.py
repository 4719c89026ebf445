"""The kvshare storage backend's settings: SGLang's ``--hicache-storage-backend-extra-config``.

SGLang loads a third-party backend with ``--hicache-storage-backend dynamic`` and a JSON
object naming it (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``); the
other keys of that object are kvshare's (:class:`StorageSettings`). An unknown key is an
error naming the known ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "interface_v2"})
"""Keys SGLang itself reads from the extra config (how it finds and drives the backend)."""
REMOTES = ("auto", "nixl", "objstore")


@dataclass(frozen=True)
class StorageSettings:
    """kvshare's keys of SGLang's ``--hicache-storage-backend-extra-config``, validated."""

    namespace: str
    """the kvshare namespace of this model's pages, deployed with `kvshare up --namespace NAME
    --layout MODEL/config.json --block-tokens PAGE_SIZE` (required)"""
    ray_address: str = ""
    """the Ray cluster to join (`auto`, `HOST:PORT`); empty: the process must already be connected
    to Ray (an SGLang server launched by `kvshare sglang start`)"""
    ray_namespace: str = "kvshare"
    """the Ray namespace kvshare was deployed in"""
    node: str = ""
    """the Ray node id whose pool this server uses as its own (default: the node its Ray connection
    lands on)"""
    remote: str = "auto"
    """transport for other nodes' pages: `auto` (the faster measured), `nixl`, `objstore`"""
    load_deadline_s: float = 5.0
    """a page load not done by then is a miss (SGLang recomputes it)"""
    store_deadline_s: float = 10.0
    """a page store not done by then is reported not stored"""
    index_timeout_s: float = 2.0
    """an index that does not answer within this is treated as down (pages are misses)"""

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError("kvshare's SGLang backend needs 'namespace' in "
                             "--hicache-storage-backend-extra-config (the kvshare namespace "
                             "deployed for this model)")
        if self.remote not in REMOTES:
            raise ValueError(f"remote must be one of {REMOTES}, got {self.remote!r}")
        for name in ("load_deadline_s", "store_deadline_s", "index_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> StorageSettings:
        """The settings in SGLang's extra config (its own keys ignored); ValueError naming the
        unknown keys or the missing namespace."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known - SGLANG_KEYS)
        if unknown:
            raise ValueError(f"unknown kvshare keys {unknown} in --hicache-storage-backend-extra-"
                             f"config: kvshare reads {sorted(known)}")
        if "namespace" not in extra:
            raise ValueError("kvshare's SGLang backend needs 'namespace' in "
                             "--hicache-storage-backend-extra-config (the kvshare namespace "
                             "deployed for this model, `kvshare up --namespace NAME`)")
        return cls(**{k: v for k, v in extra.items() if k in known})
