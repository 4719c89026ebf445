"""KVShareStorage: SGLang HiCache's storage tier (L3) over the kvshare cluster.

Loaded by SGLang, never imported by the rest of kvshare::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
      --hicache-mem-layout layer_first --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvshare",
        "module_path": "kvshare.sglang.backend", "class_name": "KVShareStorage",
        "interface_v1": 1, "namespace": "NAME", "ray_address": "auto"}'

Contract, as SGLang's ``HiCacheStorage`` states it: ``batch_exists(keys)`` is the number of
leading pages held anywhere in the cluster (this node's pool, other nodes' pools through the
index); ``batch_get_v1``/``batch_set_v1`` move pages between the cluster and SGLang's host pool
by ``host_indices`` (one copy per page through the SDK, shm on this node, NIXL or the object
store from others), returning one bool per page. Stores are write-through into this node's
pool; a page is visible to every server once its store returns. A fault (the index down, a
dead pool, a corrupt or late page, a holder gone mid-load) is a miss: the call returns False
for that page, SGLang recomputes it, and the cause is counted (:attr:`KVShareStorage.counters`;
the seconds each kind of call took in :attr:`KVShareStorage.seconds`, a debug line per call).

Configuration errors fail SGLang's start when the host pool is attached
(:meth:`KVShareStorage.register_mem_pool_host`), naming the fix: settings
(:class:`~kvshare.sglang.settings.StorageSettings`), a Ray cluster to join, an unknown
namespace or one deployed with another layout (``--block-tokens`` must be SGLang's
``--page-size``), a host pool layout other than ``layer_first``.

Keys and bytes: :mod:`kvshare.sglang.pages`. TP ranks of a non-MLA model hold different heads
and never share pages (the rank is part of the namespace root); the hybrid (v2) calls are not
implemented (SGLang then keeps hybrid models' pages out of L3).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvshare.client.join import check_deployed, join_ray
from kvshare.client.sdk import KVShareClient
from kvshare.client.types import Plan, StoreResult
from kvshare.hashing import namespace_root
from kvshare.identity import path_identity
from kvshare.sglang.pages import HostPages, host_layout, page_hashes
from kvshare.sglang.settings import StorageSettings
from kvshare.types import BlockHash

log = logging.getLogger(__name__)
ENGINE = "kvshare's SGLang storage backend"
_T = TypeVar("_T")
PLAN_REUSE_S = 2.0
"""How long ``batch_exists``' plan serves the ``batch_get_v1`` that follows it (seconds)."""
PLANS_KEPT = 64
"""Plans kept at most (one per prefetch in flight)."""


class KVShareStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped here
    """One SGLang server's (one TP rank's) view of the kvshare cluster as HiCache storage."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.config = storage_config
        self.settings = StorageSettings.from_extra(storage_config.extra_config)
        self.counters: Counter[str] = Counter()
        self.seconds: dict[str, float] = {}
        self._plans: dict[str, tuple[tuple[str, ...], float, Plan]] = {}
        self._plans_lock = threading.Lock()
        self.client: KVShareClient | None = None
        self.root: BlockHash | None = None
        self.page_size = 0

    # -------------------------------------------------------------------- start-up
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach SGLang's host pool and connect to the cluster (the start-up checks)."""
        super().register_mem_pool_host(mem_pool_host)
        self.page_size = int(mem_pool_host.page_size)
        layout = host_layout(mem_pool_host.kv_buffer, self.page_size, str(mem_pool_host.layout))
        model = str(self.config.model_name or "")
        if not os.path.isdir(model):
            raise ValueError(f"{ENGINE}: the model {model!r} is not a local directory, so its "
                             "identity (config, weights, tokenizer) cannot be digested: serve "
                             "it from a path every node can read (--model-path DIR)")
        identity = path_identity(model, f"kv={layout.dtype}")
        shard = ("mla" if self.config.is_mla_model
                 else f"tp={self.config.tp_rank}/{self.config.tp_size}")
        self.root = namespace_root(identity, layout.fingerprint(), f"sglang;{shard}")
        s = self.settings
        join_ray(s.ray_address, s.ray_namespace, ENGINE, "--hicache-storage-backend-extra-config")
        self.client = KVShareClient.connect(
            s.namespace, layout, self.root, index_timeout_s=s.index_timeout_s,
            ray_namespace=s.ray_namespace, node=s.node or None, remote=s.remote,
            worker_id=f"sglang-{os.getpid()}-{shard.replace('/', 'of')}",
            load_deadline_s=s.load_deadline_s, store_deadline_s=s.store_deadline_s)
        check_deployed(self.client.index, s.namespace, layout, ENGINE)

    def _ready(self) -> tuple[KVShareClient, BlockHash]:
        if self.client is None or self.root is None:
            raise RuntimeError(f"{ENGINE}: used before SGLang attached its host pool")
        return self.client, self.root

    def _plan(self, keys: list[str]) -> tuple[KVShareClient, Plan]:
        client, root = self._ready()
        return client, client.lookup([0] * (len(keys) * self.page_size), page_hashes(root, keys))

    def _remember(self, keys: list[str], plan: Plan | None) -> None:
        """Keep ``batch_exists``' plan for the ``batch_get_v1`` SGLang sends next for the same
        pages (or a leading part of them): one index query per prefetch, not two. The latest
        answer for the pages wins: one that found nothing (or failed) drops the plan kept."""
        with self._plans_lock:
            self._plans.pop(keys[0], None)
            if plan is None or not plan.load_blocks:
                return
            while len(self._plans) >= PLANS_KEPT:
                self._plans.pop(next(iter(self._plans)))
            self._plans[keys[0]] = (tuple(keys), time.monotonic(), plan)

    def _recall(self, keys: list[str]) -> Plan | None:
        """The plan kept for ``keys`` (at most :data:`PLAN_REUSE_S` old), cut to them; None
        when there is none. A plan that has gone stale meanwhile only fails blocks of the load
        (checksums and epochs are verified), which are then misses."""
        with self._plans_lock:
            kept = self._plans.pop(keys[0], None)
        if kept is None:
            return None
        known, at, plan = kept
        n = len(keys)
        if time.monotonic() - at > PLAN_REUSE_S or tuple(keys) != known[:n]:
            return None
        self.counters["plans_reused"] += 1
        return replace(plan, num_tokens=n * self.page_size, hashes=plan.hashes[:n],
                       available_blocks=min(plan.available_blocks, n), blocks=plan.blocks[:n])

    def _load(self, keys: list[str], pages: HostPages) -> int:
        """Leading pages of ``keys`` loaded into ``pages`` (raises on a fault)."""
        plan = self._recall(keys)
        if plan is None:
            client, plan = self._plan(keys)
        else:
            client = self._ready()[0]
        return client.load(plan, pages).loaded_blocks if plan.load_blocks else 0

    def _store(self, keys: list[str], pages: HostPages) -> StoreResult:
        """``pages`` stored under ``keys``, waited for (raises on a fault)."""
        client, root = self._ready()
        return client.store([0] * (len(keys) * self.page_size), pages,
                            hashes=page_hashes(root, keys)).result(
            self.settings.store_deadline_s + 5.0)

    @contextmanager
    def _timed(self, op: str, pages: int) -> Iterator[None]:
        """Count the call and its seconds under ``op`` (:attr:`seconds`); one debug line each."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.seconds[op] = self.seconds.get(op, 0.0) + dt
            self.counters[f"{op}_calls"] += 1
            log.debug("%s: %s of %d pages took %.1f ms", ENGINE, op, pages, dt * 1e3)

    def _host(self, host_indices: torch.Tensor) -> HostPages:
        return HostPages.from_indices(self.mem_pool_host.kv_buffer, self.page_size, host_indices)

    # -------------------------------------------------------------------- v1: host pool pages
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Leading pages of ``keys`` some pool in the cluster holds (a fault: 0)."""
        if not keys:
            return 0
        try:
            with self._timed("exists", len(keys)):
                _, plan = self._plan(keys)
        except Exception as exc:  # noqa: BLE001 - any fault is a miss
            self._remember(keys, None)
            return self._fault("exists", exc, 0)
        self._remember(keys, plan)
        self.counters["exists_pages"] += plan.load_blocks
        return int(plan.load_blocks)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Load ``keys`` into the host pool pages at ``host_indices``; True per page loaded
        (a contiguous leading run: a page after a miss is not used)."""
        try:
            with self._timed("get", len(keys)):
                loaded = self._load(keys, self._host(host_indices))
        except Exception as exc:  # noqa: BLE001
            return self._fault("get", exc, [False] * len(keys))
        self.counters["pages_loaded"] += loaded
        self.counters["pages_missed"] += len(keys) - loaded
        return [i < loaded for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store the host pool pages at ``host_indices`` under ``keys`` (write-through to this
        node's pool); True per page stored or already held."""
        try:
            with self._timed("set", len(keys)):
                result = self._store(keys, self._host(host_indices))
        except Exception as exc:  # noqa: BLE001
            return self._fault("set", exc, [False] * len(keys))
        missed = set(result.missed)
        self.counters["pages_stored"] += result.stored
        self.counters["pages_not_stored"] += len(missed)
        return [i not in missed for i in range(len(keys))]

    # -------------------------------------------------------------------- legacy: flat pages
    def _flat(self, flat: torch.Tensor) -> HostPages:
        """One page in SGLang's flat ``get_data_page`` order as a one-page host buffer."""
        pool = self.mem_pool_host
        shape = (2, pool.layer_num, self.page_size, pool.head_num, pool.head_dim)
        return HostPages(flat.view(shape), self.page_size, [0])

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Page ``key`` into the flat page ``target_location``; None on a miss."""
        try:
            ok = self._load([key], self._flat(target_location))
        except Exception as exc:  # noqa: BLE001
            return self._fault("get", exc, None)
        return target_location if ok else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        return [self.get(k, t) for k, t in zip(keys, target_locations or [None] * len(keys),
                                              strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store the flat page ``value`` under ``key``."""
        try:
            result = self._store([key], self._flat(value.contiguous()))
        except Exception as exc:  # noqa: BLE001
            return self._fault("set", exc, False)
        return not result.missed

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all([self.set(k, v) for k, v in zip(keys, values, strict=True)])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> None:
        """Nothing: the cluster's pages are shared; ``kvshare clear NAMESPACE`` drops them."""

    def _fault(self, op: str, exc: Exception, answer: _T) -> _T:
        self.counters[f"{op}_fault_{type(exc).__name__}"] += 1
        log.warning("%s: %s failed, a miss (%s)", ENGINE, op, exc)
        return answer
