"""IndexClient: one object in front of N index shards (hash-range sharding).

Shard of a block = ``hash[0] * N // 256``. Queries fan out to the shards that own the hashes
and are merged; event batches are split by shard, each part carrying the batch's seq range
so every shard judges gaps on the whole batch. Generations and the worker registry live on
shard 0. Implements :class:`kvshare.workers.IndexQuery` (sync ``match`` and async
``match_async``, which awaits object refs and never blocks the event loop) and the routing
core's :class:`~kvshare.router.core.index.RouterIndex` (``match_runs``/``match_runs_async``,
not ``inline``: a router awaits it under its deadline).

An unreachable index (restarting, dead, timed out) is a miss, not an error: ``match`` returns
an empty result whose ``unavailable`` says why (:func:`unavailable_reason`); the client also
counts it in ``unavailable`` (a metric: callers read the answer, not the counter). A client
that knows its Ray namespace (:meth:`connect`, or ``ray_namespace=``) looks dead shards up by
name again, so it follows a shard the watcher recreated (:mod:`kvshare.actors.index.keeper`). Caller
mistakes (unknown namespace, malformed hashes) raise ``KeyError``/``ValueError`` from the
shard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from kvshare.actors.config import RAY_NAMESPACE, index_name
from kvshare.actors.index.arrow_io import check_event_batch, column_np, single_group
from kvshare.actors.index.global_index import PublishAck
from kvshare.actors.index.holders import TIER_CODES
from kvshare.actors.index.names import REFRESH_S, resolve_shards
from kvshare.actors.index.runs import HolderRuns, Runs, from_runs
from kvshare.actors.index.wire import decode_answers, decode_runs, encode_queries, encode_query
from kvshare.events import events_from_arrow, events_to_arrow
from kvshare.match import MatchResult, build_match
from kvshare.types import BlockHash, Location, NodeId, Tier, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)

UNAVAILABLE = (RayActorError, GetTimeoutError, asyncio.TimeoutError)


def unavailable_reason(exc: BaseException) -> str:
    """``index_timeout`` (no answer within the deadline) or ``index_down`` (shard dead or
    restarting): the ``unavailable`` of an answer the index could not give."""
    return "index_down" if isinstance(exc, RayActorError) else "index_timeout"


class IndexClient:
    """Sharded access to the global index. Picklable: pass it to actors."""

    inline = False  # every match is a round trip to the shards (RouterIndex.inline)

    def __init__(self, shards: Sequence[Any], timeout_s: float = 5.0,
                 ray_namespace: str | None = None) -> None:
        if not shards:
            raise ValueError("IndexClient needs at least one index shard handle")
        self.shards = list(shards)
        self.timeout_s = timeout_s
        self.unavailable = 0
        self.ray_namespace = ray_namespace  # set: dead shards are looked up again by name
        self.reconnects = 0
        self._looked_up = 0.0

    def _failed(self, exc: BaseException) -> None:
        """After a dead shard (``RayActorError``): look the shards up by name again, at most
        every :data:`~kvshare.actors.index.names.REFRESH_S`, when this client knows its namespace."""
        if self.ray_namespace is None or not isinstance(exc, RayActorError):
            return
        now = time.monotonic()
        if now - self._looked_up < REFRESH_S:
            return
        self._looked_up = now
        found = resolve_shards(self.ray_namespace, len(self.shards))
        if found is not None:
            self.shards = found
            self.reconnects += 1

    @classmethod
    def connect(cls, ray_namespace: str = RAY_NAMESPACE, timeout_s: float = 5.0) -> IndexClient:
        """Find the named shards of a deployment (``kvshare-index-0`` knows how many)."""
        first = ray.get_actor(index_name(0), namespace=ray_namespace)
        info: dict[str, Any] = ray.get(first.ready.remote(), timeout=60)  # type: ignore[assignment]
        shards = [first] + [
            ray.get_actor(index_name(i), namespace=ray_namespace)
            for i in range(1, int(info["num_shards"]))
        ]
        return cls(shards, timeout_s, ray_namespace)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def shard_of(self, block_hash: bytes) -> int:
        return block_hash[0] * len(self.shards) // 256

    def _get(self, ref: Any, timeout: float | None = None) -> Any:
        try:
            return ray.get(ref, timeout=timeout or self.timeout_s)
        except RayActorError as exc:
            self._failed(exc)
            raise

    async def _wait(self, ref: Any) -> Any:
        try:
            return await asyncio.wait_for(ref, self.timeout_s)
        except RayActorError as exc:
            self._failed(exc)
            raise

    def _all(self, method: str, *args: Any) -> list[Any]:
        return list(self._get([getattr(s, method).remote(*args) for s in self.shards]))

    # ------------------------------------------------------------------ namespaces, generations
    def declare_namespace(self, namespace: str, hash_size: int = 32, layout_fingerprint: str = "") -> None:
        self._all("declare_namespace", namespace, hash_size, layout_fingerprint)

    def namespaces(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for part in self._all("namespaces"):
            for name, info in part.items():
                cur = out.setdefault(name, dict(info, blocks=0))
                cur["blocks"] += info["blocks"]
        return out

    def epoch(self) -> str:
        """Joined shard epochs: changes whenever any shard restarted."""
        return ",".join(self._all("get_epoch"))

    def new_generation(self, location: str) -> int:
        """A fresh generation for ``location`` (issued by shard 0, fenced on every shard)."""
        gen = int(self._get(self.shards[0].new_generation.remote(location)))
        if len(self.shards) > 1:
            self._get([s.fence.remote(location, gen) for s in self.shards[1:]])
        return gen

    # ------------------------------------------------------------------ publishing
    def _split(self, batch: pa.RecordBatch) -> list[pa.RecordBatch]:
        if len(self.shards) == 1:
            return [batch]
        col = batch.column(batch.schema.get_field_index("hash"))
        size = col.type.byte_width
        raw = np.frombuffer(col.buffers()[1], dtype=np.uint8)
        first = raw[col.offset * size : (col.offset + len(col)) * size : size].astype(np.int64)
        shard = first * len(self.shards) // 256
        kinds = column_np(batch, "kind")
        out = []
        for i in range(len(self.shards)):
            mask = (shard == i) | (kinds == 2)  # AllCleared rows go to every shard
            out.append(batch.filter(pa.array(mask)))
        return out

    def publish(self, batch: pa.RecordBatch) -> PublishAck:
        """Send one event batch; the ack says whether the publisher must resync."""
        batch = check_event_batch(batch)
        if len(self.shards) > 1 and batch.num_rows and single_group(batch) is None:
            acks = [self.publish(part) for part in _groups(batch)]
            return _merge(acks)._replace(epoch=acks[-1].epoch)
        seqs = column_np(batch, "seq")
        seq_range = (int(seqs[0]), int(seqs[-1])) if len(seqs) and len(self.shards) > 1 else None
        parts = self._split(batch)
        refs = [s.publish.remote(p, seq_range) for s, p in zip(self.shards, parts, strict=True)]
        return _merge(self._get(refs))

    def replace_inventory(self, location: str, generation: int, batch: pa.RecordBatch,
                          seq: int, namespace: str | None = None) -> bool:
        """Replace ``location``'s blocks of one namespace on every shard (see GlobalIndex)."""
        parts = self._split(check_event_batch(batch))
        refs = [s.replace_inventory.remote(location, generation, p, seq, namespace)
                for s, p in zip(self.shards, parts, strict=True)]
        return all(self._get(refs))

    def drop_location(self, location: str, up_to_generation: int | None = None) -> int:
        return sum(self._all("drop_location", location, up_to_generation))

    def drop_node(self, node: NodeId | str) -> int:
        return sum(self._all("drop_node", node))

    # ------------------------------------------------------------------ queries
    def _lookup_refs(self, namespace: str, hashes: Sequence[BlockHash]) -> tuple[list[Any], list[list[int]]]:
        _check_list(hashes)
        idx: list[list[int]] = [[] for _ in self.shards]
        for i, h in enumerate(hashes):
            if not isinstance(h, bytes) or not h:
                raise ValueError(f"block hash {i} is {type(h).__name__}, expected bytes")
            idx[self.shard_of(h)].append(i)
        refs = [s.lookup.remote(namespace, [hashes[i] for i in ix])
                for s, ix in zip(self.shards, idx, strict=True)]
        return refs, idx

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """Per-location prefix holdings of ``hashes``; empty if the index is unreachable."""
        return self.match_many(namespace, [hashes])[0]

    def match_many(self, namespace: str, requests: Sequence[Sequence[BlockHash]],
                   batch: int = 1) -> list[MatchResult]:
        """Several matches with the calls pipelined (one round trip for all of them).

        ``batch``: queries per actor call (one index shard only; more shards answer by
        per-block lookups). Batching spreads Ray's fixed cost per call over the queries.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1 queries per call, got {batch}")
        try:
            if len(self.shards) == 1:
                queries = [encode_query(namespace, *_pack(h)) for h in requests]
                if batch == 1:
                    one = self.shards[0].match_query.remote
                    return [from_runs(*decode_runs(r)) for r in self._get([one(q) for q in queries])]
                many = self.shards[0].match_queries.remote
                refs = [many(encode_queries(queries[i:i + batch]))
                        for i in range(0, len(queries), batch)]
                return [from_runs(*a) for r in self._get(refs) for a in decode_answers(r)]
            pending = [self._lookup_refs(namespace, h) for h in requests]
            return [build_match(self._per_block(len(h), self._get(refs), idx))
                    for h, (refs, idx) in zip(requests, pending, strict=True)]
        except UNAVAILABLE as exc:
            why = self._unavailable(exc)
            return [MatchResult(len(h), 0, {}, why) for h in requests]

    async def match_async(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """Same as :meth:`match`, awaiting object refs (never blocks the event loop)."""
        return from_runs(*await self.match_runs_async(namespace, hashes))

    def match_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> HolderRuns:
        """:meth:`match` in run form (see :meth:`match_runs_async`); blocks until the shards
        answer. Empty if unreachable."""
        try:
            if len(self.shards) == 1:
                ref = self.shards[0].match_query.remote(encode_query(namespace, *_pack(hashes)))
                return HolderRuns(*decode_runs(self._get(ref)))
            refs, idx = self._lookup_refs(namespace, hashes)
            return HolderRuns(len(hashes), _runs_of_blocks(self._per_block(len(hashes), self._get(refs), idx)))
        except UNAVAILABLE as exc:
            return HolderRuns(len(hashes), [], self._unavailable(exc))

    async def match_runs_async(self, namespace: str, hashes: Sequence[BlockHash]) -> HolderRuns:
        """:meth:`match_async` in run form ``(num_blocks, runs)`` (see :mod:`kvshare.actors.index.runs`): what
        a shard sends anyway, so a router skips expanding it per block. Empty if unreachable."""
        try:
            if len(self.shards) == 1:
                ref = self.shards[0].match_query.remote(encode_query(namespace, *_pack(hashes)))
                return HolderRuns(*decode_runs(await asyncio.wait_for(ref, self.timeout_s)))
            refs, idx = self._lookup_refs(namespace, hashes)
            parts = await asyncio.wait_for(asyncio.gather(*refs), self.timeout_s)
            return HolderRuns(len(hashes), _runs_of_blocks(self._per_block(len(hashes), list(parts), idx)))
        except UNAVAILABLE as exc:
            return HolderRuns(len(hashes), [], self._unavailable(exc))

    def _unavailable(self, exc: BaseException) -> str:
        self._failed(exc)
        self.unavailable += 1
        log.warning("index unavailable, treating match as a miss: %s", exc)
        return unavailable_reason(exc)

    @staticmethod
    def _per_block(n: int, parts: list[list[dict[Location, Tier]]],
                   idx: list[list[int]]) -> list[dict[Location, Tier]]:
        per_block: list[dict[Location, Tier]] = [{}] * n
        for part, ix in zip(parts, idx, strict=True):
            for i, holders in zip(ix, part, strict=True):
                per_block[i] = holders
        return per_block

    def lookup(self, namespace: str, hashes: Sequence[BlockHash]) -> list[dict[Location, Tier]]:
        refs, idx = self._lookup_refs(namespace, hashes)
        return self._per_block(len(hashes), self._get(refs), idx)

    # ------------------------------------------------------------------ workers (shard 0)
    def register_worker(self, info: WorkerInfo) -> int:
        """Register a worker; returns the generation its gpu-tier events must carry."""
        gen = int(self._get(self.shards[0].register_worker.remote(info)))
        if len(self.shards) > 1:
            loc = f"worker:{info.worker_id}"
            self._get([s.fence.remote(loc, gen) for s in self.shards[1:]])
        return gen

    def report_load(self, load: WorkerLoad) -> bool:
        """Renew the worker's lease; False: unknown to the index, register again."""
        return bool(self._get(self.shards[0].report_load.remote(load)))

    async def report_load_async(self, load: WorkerLoad) -> bool:
        return bool(await self._wait(self.shards[0].report_load.remote(load)))

    def unregister_worker(self, worker_id: WorkerId | str) -> int:
        n = int(self._get(self.shards[0].unregister_worker.remote(worker_id)))
        for s in self.shards[1:]:
            n += int(self._get(s.drop_location.remote(f"worker:{worker_id}")))
        return n

    def workers(self) -> list[WorkerInfo]:
        return list(self._get(self.shards[0].workers.remote()))

    def loads(self) -> dict[WorkerId, WorkerLoad]:
        return dict(self._get(self.shards[0].loads.remote()))

    async def workers_async(self) -> list[WorkerInfo]:
        return list(await self._wait(self.shards[0].workers.remote()))

    async def loads_async(self) -> dict[WorkerId, WorkerLoad]:
        return dict(await self._wait(self.shards[0].loads.remote()))

    def stats(self) -> list[dict[str, Any]]:
        """Per-shard statistics."""
        return self._all("stats")


def _check_list(hashes: object) -> None:
    if isinstance(hashes, bytes | str) or not isinstance(hashes, Sequence):
        raise ValueError("hashes must be a list of block hashes (bytes), not one value")


def _pack(hashes: Sequence[BlockHash]) -> tuple[bytes, int]:
    """Hashes as one bytes object plus their length (ValueError if malformed; the shard checks
    the length against the namespace). Compensating lengths can only cause misses."""
    _check_list(hashes)
    if not hashes:
        return b"", 32
    try:
        blob = b"".join(hashes)
    except TypeError:
        blob = b""
    size = len(hashes[0]) if isinstance(hashes[0], bytes) else 0
    if not size or len(blob) != size * len(hashes) or type(hashes[0]) is not bytes:
        bad = next((h for h in hashes if type(h) is not bytes or len(h) != size), hashes[0])
        raise ValueError(
            f"block hashes must be bytes of one length (32 or 16), got a {type(bad).__name__}"
            f"{f' of length {len(bad)}' if isinstance(bad, bytes) else ''}"
        )
    return blob, size


def _runs_of_blocks(per_block: Sequence[dict[Location, Tier]]) -> Runs:
    """Per-block holders as runs of equal consecutive holders, up to the first unheld block."""
    runs: Runs = []
    prev: dict[Location, Tier] | None = None
    for holders in per_block:
        if not holders:
            break
        if holders == prev:
            items, n = runs[-1]
            runs[-1] = (items, n + 1)
            continue
        prev = holders
        runs.append((tuple((str(loc), TIER_CODES[t]) for loc, t in holders.items()), 1))
    return runs


def _merge(acks: Sequence[PublishAck]) -> PublishAck:
    resync = sorted({r for a in acks for r in a.resync})
    return PublishAck(",".join(a.epoch for a in acks), sum(a.applied for a in acks),
                      sum(a.stale for a in acks), tuple(resync))


def _groups(batch: pa.RecordBatch) -> list[pa.RecordBatch]:
    """Split a mixed batch into single (namespace, location, generation) batches, in order."""
    groups: dict[tuple[str, str, int], list[Any]] = {}
    for ev in events_from_arrow(batch):
        groups.setdefault((ev.namespace, ev.location, ev.generation), []).append(ev)
    size = batch.schema.field("hash").type.byte_width
    return [events_to_arrow(evs, size) for evs in groups.values()]
