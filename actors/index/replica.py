"""IndexReplica: a router's own copy of the index, fed by the shards' change streams.

As Dynamo's KV router and Ray Serve's KVAwareRouter do, a router can keep the block
directory in its own process, so a routing decision costs no actor call. A background thread
asks every shard for the deltas after its cursor (:meth:`GlobalIndex.feed_since
<kvshare.actors.index.global_index.GlobalIndex.feed_since>`, one call per shard and round, every
``poll_s``) and applies them to local :class:`~kvshare.actors.index.table.BlockTable` s; a shard that
restarted (new epoch) or a reader that fell behind the shard's feed starts over from
snapshots of every shard. The replica therefore lags the actor index by about one round
(``poll_s`` plus a round trip), the event batching delay, and is otherwise equal to it.

It implements :class:`~kvshare.workers.IndexQuery` (``match``, ``match_async``) and the
routing core's :class:`~kvshare.router.core.index.RouterIndex` (``match_runs``,
``match_runs_async``), answering inline. Until the first sync, and while no round succeeded
for ``stale_after_s``, answers are empty with ``unavailable`` = :data:`NOT_SYNCED` (and
counted in :attr:`unavailable`): the router then routes on load only, as with an unreachable
index. The actor index stays the source of truth
for resyncs and for workers' lookups; worker registrations are not replicated.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray

from kvshare.actors.index.feed import FeedReply
from kvshare.actors.index.holders import HolderStates
from kvshare.actors.index.runs import HolderRuns, from_runs
from kvshare.actors.index.table import BlockTable, Delta
from kvshare.match import MatchResult
from kvshare.types import BlockHash, UnknownNamespace

log = logging.getLogger(__name__)

_Tables = tuple[HolderStates, dict[str, BlockTable]]
NOT_SYNCED = "replica_not_synced"
"""The ``unavailable`` of an answer given before the first sync or after ``stale_after_s``."""


class IndexReplica:
    """A local, read-only copy of the sharded index (see the module docstring)."""

    inline = True

    def __init__(self, shards: Sequence[Any], *, poll_s: float = 0.01, timeout_s: float = 5.0,
                 stale_after_s: float = 5.0, start: bool = True) -> None:
        if not shards:
            raise ValueError("IndexReplica needs at least one index shard handle")
        if poll_s <= 0 or timeout_s <= 0 or stale_after_s <= 0:
            raise ValueError("poll_s, timeout_s and stale_after_s must be positive seconds")
        self.shards = list(shards)
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s
        self.unavailable = 0
        self.rounds = 0
        self.resyncs = 0
        self.deltas = 0
        self.last_sync = 0.0  # time.monotonic() of the last successful round (0: never)
        self._tables: _Tables = (HolderStates(), {})
        self._cursors: list[int] = [-1] * len(self.shards)
        self._epochs: list[str] = [""] * len(self.shards)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @classmethod
    def follow(cls, client: Any, **options: Any) -> IndexReplica:
        """A replica of the shards behind an :class:`~kvshare.actors.index.client.IndexClient`."""
        return cls(client.shards, **options)

    # ------------------------------------------------------------------ following
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvshare-index-replica",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 1)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            if not ray.is_initialized():
                # the process disconnected from Ray (its shard handles are gone with it): a call
                # now would connect it to a new Ray, or to a cluster being shut down
                log.info("index replica stops: this process left Ray")
                return
            try:
                self.poll_once()
            except Exception as exc:  # a shard restarting or gone: try again next round
                log.info("index replica round failed: %s", exc)
            self._stop.wait(self.poll_s)

    def poll_once(self) -> int:
        """One round: every shard's deltas since its cursor; returns how many were applied."""
        replies: list[FeedReply] = ray.get(
            [s.feed_since.remote(c) for s, c in zip(self.shards, self._cursors, strict=True)],
            timeout=self.timeout_s)
        if any(r.deltas is None or (e and r.epoch != e)
               for r, e in zip(replies, self._epochs, strict=True)):
            n = self._resync()
        else:
            states, tables = self._tables
            n = 0
            for i, r in enumerate(replies):
                assert r.deltas is not None
                n += _apply(states, tables, r.deltas, r.namespaces)
                self._cursors[i] = r.cursor
        self.deltas += n
        self.rounds += 1
        self.last_sync = time.monotonic()
        return n

    def _resync(self) -> int:
        """Start over from every shard's snapshot (built aside, then swapped in whole)."""
        replies: list[FeedReply] = ray.get([s.feed_snapshot.remote() for s in self.shards],
                                           timeout=self.timeout_s)
        states, tables = HolderStates(), dict[str, BlockTable]()
        n = 0
        for r in replies:
            assert r.deltas is not None
            n += _apply(states, tables, r.deltas, r.namespaces)
        self._tables = (states, tables)
        self._cursors = [r.cursor for r in replies]
        self._epochs = [r.epoch for r in replies]
        self.resyncs += 1
        return n

    # ------------------------------------------------------------------ queries
    @property
    def ready(self) -> bool:
        """Synced, and a round succeeded within ``stale_after_s``."""
        return self.last_sync > 0 and time.monotonic() - self.last_sync < self.stale_after_s

    def match_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> HolderRuns:
        """The match in run form, from the local copy. KeyError for an unknown namespace;
        empty (and counted in ``unavailable``) while not :attr:`ready`."""
        last = self.last_sync
        if not (last > 0 and time.monotonic() - last < self.stale_after_s):  # (ready)
            self.unavailable += 1
            return HolderRuns(len(hashes), [], NOT_SYNCED)
        if type(hashes) is not list and isinstance(hashes, bytes | str):
            raise ValueError("hashes must be a list of block hashes (bytes), not one value")
        table = self._tables[1].get(namespace)
        if table is None:
            raise UnknownNamespace(namespace, self._tables[1], "nothing published to it yet")
        return HolderRuns(*table.match_runs(hashes))

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        runs = self.match_runs(namespace, hashes)
        if runs.unavailable:
            return MatchResult(runs.num_blocks, 0, {}, runs.unavailable)
        return from_runs(runs.num_blocks, runs.runs)

    async def match_async(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        return self.match(namespace, hashes)

    async def match_runs_async(self, namespace: str, hashes: Sequence[BlockHash]) -> HolderRuns:
        return self.match_runs(namespace, hashes)

    def stats(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "resyncs": self.resyncs, "deltas": self.deltas,
                "unavailable": self.unavailable, "ready": self.ready,
                "blocks": {n: len(t) for n, t in self._tables[1].items()}}


def _apply(states: HolderStates, tables: dict[str, BlockTable], deltas: list[Delta],
           namespaces: dict[str, int]) -> int:
    for ns_name, size in namespaces.items():
        if ns_name not in tables:
            tables[ns_name] = BlockTable(ns_name, size, "", states)
    for op, ns_name, loc, tier, blob in deltas:
        table = tables.get(ns_name)
        if table is None:
            table = tables[ns_name] = BlockTable(ns_name, namespaces.get(ns_name, 32), "", states)
        lid = states.loc_id(loc)
        if op == "S":
            table.store_many(lid, tier, blob)
        elif op == "R":
            table.remove(lid, tier, blob)
        else:
            table.drop_keys(lid, blob)
    return len(deltas)
