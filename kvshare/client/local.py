"""An in-process :class:`~kvshare.client.types.KVClient` over a plain TieredBlockPool.

For single-process use and for proving reuse lossless without Ray: the same plan / load /
store contract as :class:`kvshare.client.sdk.KVShareClient`, with the pool in the caller's process.
Stores run on one background thread, so generation never waits for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvshare import kv_convert
from kvshare.block_io import KVTarget, StorableKV
from kvshare.client.types import TRANSPORT_LOCAL, LoadResult, Plan, PlannedBlock, StoreResult
from kvshare.hasher import Hasher
from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import AlreadyPresent, Reserved
from kvshare.types import BlockHash, Tier


class LocalKVClient:
    """Plan, load and store against one in-process pool."""

    def __init__(self, pool: TieredBlockPool, root: BlockHash | Hasher,
                 holder: str = "local-client") -> None:
        self.pool = pool
        self.layout = pool.config.layout
        self.namespace = pool.config.namespace
        self.block_tokens = self.layout.block_tokens
        self.hasher = root if isinstance(root, Hasher) else Hasher.from_root(root, self.block_tokens)
        self.root = self.hasher.root
        self.holder = holder
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvshare-store")
        self._lock = threading.Lock()
        self.counters = {"stored_blocks": 0, "loaded_blocks": 0, "failed_blocks": 0}

    def hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[BlockHash]:
        """Block hashes under tenant ``salt``'s root (None: the client's); see KVShareClient."""
        return self.hasher.hashes(tokens, salt)

    def lookup(self, tokens: Sequence[int], hashes: Sequence[BlockHash] | None = None, *,
               load_all: bool = False) -> Plan:
        """Plan to load every leading block the pool holds (``load_all`` changes nothing)."""
        hs = tuple(hashes if hashes is not None else self.hashes(tokens))
        n = self.pool.prefix_len(hs)
        loc = str(self.pool.config.location)
        blocks = []
        for h in hs[:n]:
            tier = self.pool.tier_of(h)
            if tier is None:  # evicted since prefix_len
                break
            blocks.append(PlannedBlock(h, loc, tier, TRANSPORT_LOCAL))
        return Plan(self.namespace, len(tokens), self.block_tokens, hs, n, tuple(blocks),
                    reason="local pool")

    def plan_from(self, tokens: Sequence[int], hashes: Sequence[BlockHash], match: Any, *,
                  load_all: bool = False) -> Plan:
        """Plan to load the leading blocks ``match`` (an index answer for ``hashes``) says this
        pool holds, without asking the pool (a load of a block it no longer holds fails)."""
        hs = tuple(hashes)
        loc = str(self.pool.config.location)
        blocks = []
        for i in range(min(match.combined_prefix, len(hs))):
            tier = match.holders(i).get(loc)
            if tier is None or tier == Tier.GPU:
                break
            blocks.append(PlannedBlock(hs[i], loc, tier, TRANSPORT_LOCAL))
        return Plan(self.namespace, len(tokens), self.block_tokens, hs, len(blocks),
                    tuple(blocks), reason="router's answer")

    def load(self, plan: Plan, into: KVTarget) -> LoadResult:
        """Copy the planned blocks (verified by the pool) into ``into``; misses are reported."""
        kv_convert.check_target(into, self.layout, plan.load_tokens)
        start = time.perf_counter()
        leases = self.pool.pin([b.block_hash for b in plan.blocks], self.holder)
        buf = np.empty(self.layout.bytes_per_block, dtype=np.uint8)
        reasons: list[str] = []
        try:
            for i, lease in enumerate(leases):
                if lease is None:
                    reasons.append("evicted")
                    continue
                res = self.pool.read_into(lease, buf)
                if res.ok:
                    kv_convert.block_into_target(buf, into, i, self.layout)
                reasons.append("" if res.ok else res.reason)
        finally:
            self.pool.unpin([lease.lease_id for lease in leases if lease is not None])
        result = LoadResult.from_reasons(reasons, [TRANSPORT_LOCAL] * len(reasons), buf.nbytes,
                                         time.perf_counter() - start)
        with self._lock:
            self.counters["loaded_blocks"] += result.loaded_blocks
            self.counters["failed_blocks"] += len(result.failed)
        return result

    def store(self, tokens: Sequence[int], kv: StorableKV, start_block: int = 0,
              hashes: Sequence[BlockHash] | None = None) -> Future[StoreResult]:
        """Write blocks ``start_block..`` of ``kv`` (full blocks only) in the background.

        The caller must not mutate ``kv``'s memory until the future completes.
        """
        kv_convert.check_source(kv, self.layout)
        n_blocks = min(len(tokens), kv_convert.source_tokens(kv)) // self.block_tokens
        hs = list(hashes if hashes is not None else self.hashes(tokens[: n_blocks * self.block_tokens]))
        return self._executor.submit(self._store, hs[:n_blocks], kv, start_block)

    def _store(self, hs: list[BlockHash], kv: StorableKV, start: int) -> StoreResult:
        todo = hs[start:]
        if not todo:
            return StoreResult()
        results = self.pool.reserve(todo, self.holder)
        buf = np.empty(self.layout.bytes_per_block, dtype=np.uint8)
        leases, present, missed = [], 0, []
        try:
            for i, res in enumerate(results):
                if isinstance(res, Reserved):
                    kv_convert.block_from_source(kv, start + i, buf, self.layout)
                    self.pool.write(res.lease_id, buf)
                    leases.append(res.lease_id)
                elif isinstance(res, AlreadyPresent):
                    present += 1
                else:
                    missed.append(i)
        except BaseException:
            self.pool.abort(leases)
            raise
        self.pool.commit(leases)
        with self._lock:
            self.counters["stored_blocks"] += len(leases)
        return StoreResult(len(leases), present, len(missed),
                           len(leases) * self.layout.bytes_per_block, missed=tuple(missed))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
