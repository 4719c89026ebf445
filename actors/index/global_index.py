"""GlobalIndex: which location holds which block, in which tier (plain class, no Ray).

Per namespace ``hash -> holder state`` (an interned ``{location: tier}``, see
:mod:`kvshare.actors.index.holders`) plus a reverse map ``location -> hashes`` so a dead location goes at
once. Rules (DESIGN.md, "Index and events"):

- **Generations** and **sequence numbers** (:mod:`kvshare.actors.index.fencing`): events of a stale
  generation, and duplicates, are ignored; a newer generation replaces the location's entries;
  a gap in the seqs marks ``(namespace, location)`` for resync (the publisher then sends
  :meth:`replace_inventory`).
- ``BlockRemoved(tier)`` removes a holder only if its recorded tier is that tier (a demotion is
  ``Stored(new)`` then ``Removed(old)``).

Not thread-safe: one actor thread owns it. Reads are :meth:`lookup` and the fast
:meth:`match` (same result as :func:`kvshare.match.build_match` over :meth:`lookup`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from kvshare.actors.index.arrow_io import (
    Row,
    StoredGroup,
    all_stored_one_tier,
    check_event_batch,
    column_np,
    columns_of,
    event_rows,
    hash_width,
    inventory_rows,
    packed_hashes,
    single_group,
    stored_group,
    validate_events,
)
from kvshare.actors.index.feed import FeedReply, IndexFeed
from kvshare.actors.index.fencing import Fencing, check_location
from kvshare.actors.index.holders import TIER_BY_NAME, TIERS, HolderStates
from kvshare.actors.index.registry import WorkerRegistry
from kvshare.actors.index.runs import HolderRuns, Runs, from_runs
from kvshare.actors.index.table import BlockTable
from kvshare.actors.index.wire import decode_queries, decode_query, encode_answers, encode_runs
from kvshare.events import Event, EventKind
from kvshare.match import MatchResult
from kvshare.pool.types import check_namespace
from kvshare.types import (
    BlockHash,
    Location,
    NodeId,
    Tier,
    UnknownNamespace,
    WorkerId,
    node_location,
    parse_location,
)
from kvshare.types import worker_location as worker_loc
from kvshare.workers import WorkerInfo, WorkerLoad


class PublishAck(NamedTuple):
    """Reply to a publish: the index ``epoch`` (changes when the index restarts), how many
    events were applied / ignored as stale, and the ``(namespace, location)`` pairs that must
    resync (send their whole inventory with ``replace_inventory``)."""

    epoch: str
    applied: int
    stale: int
    resync: tuple[tuple[str, str], ...]


class GlobalIndex:
    """The cluster's block directory (one shard of it)."""

    def __init__(self, worker_ttl_s: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.epoch = uuid.uuid4().hex[:12]
        self._s = HolderStates()
        self._ns: dict[str, BlockTable] = {}
        self.registry = WorkerRegistry(worker_ttl_s, clock)
        self.counters = dict.fromkeys(
            ("applied", "stale", "duplicate", "gaps", "replaced", "dropped_locations"), 0
        )
        self.fences = Fencing(self.counters, self._drop_entries)
        self.feed: IndexFeed | None = None  # on once a replica follows (feed_since)

    # ------------------------------------------------------------------ namespaces
    def declare_namespace(self, namespace: str, hash_size: int = 32, layout_fingerprint: str = "") -> None:
        """Make ``namespace`` known; ValueError if it is known with another hash size or layout."""
        check_namespace(namespace)
        if hash_size not in (16, 32):
            raise ValueError(f"hash_size must be 16 or 32 bytes, got {hash_size}")
        ns = self._ns.get(namespace)
        if ns is None:
            ns = self._ns[namespace] = BlockTable(namespace, hash_size, layout_fingerprint, self._s)
            ns.feed = None if self.feed is None else self.feed.pending
            return
        if ns.hash_size != hash_size:
            raise ValueError(
                f"namespace {namespace!r} uses {ns.hash_size}-byte hashes, not {hash_size}"
            )
        if layout_fingerprint and ns.layout_fingerprint and ns.layout_fingerprint != layout_fingerprint:
            raise ValueError(
                f"namespace {namespace!r} has layout {ns.layout_fingerprint}, not "
                f"{layout_fingerprint}: use another namespace for another layout"
            )
        if layout_fingerprint and not ns.layout_fingerprint:
            ns.layout_fingerprint = layout_fingerprint

    def namespaces(self) -> dict[str, dict[str, Any]]:
        return {
            n: {"hash_size": ns.hash_size, "layout_fingerprint": ns.layout_fingerprint,
                "blocks": len(ns)}
            for n, ns in self._ns.items()
        }

    def _get_ns(self, namespace: str) -> BlockTable:
        if namespace not in self._ns:
            raise UnknownNamespace(namespace, self._ns, "deploy kvshare with this namespace "
                                   "or add it to the pools first")
        return self._ns[namespace]

    # ------------------------------------------------------------------ generations
    def new_generation(self, location: str) -> int:
        """A fresh generation for ``location``; its older entries are dropped now."""
        return self.fences.new_generation(location)

    def generation(self, location: str) -> int | None:
        return self.fences.gen.get(location)

    def fence(self, location: str, generation: int) -> bool:
        """Adopt ``generation`` for ``location`` if it is the newest; False if it is stale."""
        return self.fences.fence(location, generation)

    # ------------------------------------------------------------------ events
    def apply_arrow(
        self, batch: pa.RecordBatch, seq_range: tuple[int, int] | None = None
    ) -> PublishAck:
        """Apply one event batch (:func:`kvshare.events.events_to_arrow`).

        ``seq_range``: the (first, last) seq of the publisher's whole batch when this is one
        shard's part of it (single-group batches only), so gaps are judged on the whole.
        """
        batch = check_event_batch(batch)
        fast = stored_group(batch)
        if fast is not None and fast.tier in TIER_BY_NAME:
            ns = self._ns.get(fast.namespace)
            if ns is None or ns.hash_size == hash_width(batch):
                return self._apply_stored(batch, fast, seq_range)
        group = single_group(batch)
        validate_events(batch, group)
        names = [group[0]] if group is not None else batch.column(1).unique().to_pylist()
        for name in names:
            ns = self._ns.get(str(name))
            if ns is not None and ns.hash_size != hash_width(batch):
                raise ValueError(
                    f"namespace {name!r} block hashes are {ns.hash_size} bytes, the batch's "
                    f"are {hash_width(batch)}"
                )
        applied0, stale0 = self.counters["applied"], self.counters["stale"]
        resync: set[tuple[str, str]] = set()
        if group is not None:
            self._apply_group(batch, group, seq_range, resync)
        elif seq_range is not None and batch.num_rows:
            raise ValueError(
                "seq_range is only valid for a batch of one (namespace, location, generation)"
            )
        else:
            self._apply_rows(zip(*columns_of(batch), strict=True), resync)
        return self._ack(applied0, stale0, resync)

    def publish(
        self, batch: pa.RecordBatch, seq_range: tuple[int, int] | None = None
    ) -> PublishAck:
        """Same as :meth:`apply_arrow` (the name publishers call)."""
        return self.apply_arrow(batch, seq_range)

    def apply(self, events: Iterable[Event]) -> PublishAck:
        """Apply event objects (BlockStored / BlockRemoved / AllCleared) in order."""
        applied0, stale0 = self.counters["applied"], self.counters["stale"]
        resync: set[tuple[str, str]] = set()
        self._apply_rows(event_rows(events), resync)
        return self._ack(applied0, stale0, resync)

    def _ack(self, applied0: int, stale0: int, resync: set[tuple[str, str]]) -> PublishAck:
        return PublishAck(self.epoch, self.counters["applied"] - applied0,
                          self.counters["stale"] - stale0, tuple(sorted(resync)))

    def needs_resync(self, namespace: str, location: str) -> bool:
        return (namespace, location) in self.fences.resync

    def _apply_stored(self, batch: pa.RecordBatch, g: StoredGroup,
                      seq_range: tuple[int, int] | None) -> PublishAck:
        """:meth:`_apply_group` of a :class:`StoredGroup` (same rules, fewer steps)."""
        applied0, stale0 = self.counters["applied"], self.counters["stale"]
        resync: set[tuple[str, str]] = set()
        ns_name, loc = g.namespace, g.location
        check_location(loc)
        if ns_name not in self._ns:
            self.declare_namespace(ns_name, hash_width(batch))
        seqs, n = g.seqs, batch.num_rows
        first, last = seq_range if seq_range is not None else (int(seqs[0]), int(seqs[-1]))
        if seq_range is None and not g.consecutive:
            self.fences.gap(ns_name, loc)
        floor = self.fences.admit(ns_name, loc, g.generation, first, last, n, resync)
        if floor >= 0:
            if (first if g.consecutive and seq_range is None else int(seqs.min())) <= floor:
                keep = seqs > floor
                self.counters["duplicate"] += int(n - keep.sum())
                batch = batch.filter(pa.array(keep))
            if batch.num_rows:
                self._ns[ns_name].store_many(self._s.loc_id(loc), TIER_BY_NAME[g.tier],
                                             packed_hashes(batch.column(4)))
                self.counters["applied"] += batch.num_rows
        return self._ack(applied0, stale0, resync)

    def _apply_group(self, batch: pa.RecordBatch, group: tuple[str, str, int],
                     seq_range: tuple[int, int] | None, resync: set[tuple[str, str]]) -> None:
        ns_name, loc, gen = group
        parse_location(loc)
        if ns_name not in self._ns:
            self.declare_namespace(ns_name, hash_width(batch))
        seqs = column_np(batch, "seq")
        n = len(seqs)
        first, last = seq_range if seq_range is not None else (int(seqs[0]), int(seqs[-1]))
        if seq_range is None and n > 1 and not (np.diff(seqs) == 1).all():
            self.fences.gap(ns_name, loc)
        floor = self.fences.admit(ns_name, loc, gen, first, last, n, resync)
        if floor < 0 or n == 0:
            return
        if int(seqs.min()) <= floor:
            keep = seqs > floor
            self.counters["duplicate"] += int(n - keep.sum())
            batch = batch.filter(pa.array(keep))
            if batch.num_rows == 0:
                return
        ns = self._ns[ns_name]
        lid = self._s.loc_id(loc)
        tier = all_stored_one_tier(batch)
        if tier is not None:
            code = TIER_BY_NAME.get(tier)
            if code is None:
                raise ValueError(f"event batch has unknown tier {tier!r}")
            hashes = packed_hashes(batch.column(4))
            ns.store_many(lid, code, hashes)
            self.counters["applied"] += batch.num_rows
            return
        kinds, _, _, tiers, hashes, _, _ = columns_of(batch)
        for kind, t, h in zip(kinds, tiers, hashes, strict=True):
            self._one(ns, lid, kind, t, h)

    def _apply_rows(self, rows: Iterable[Row], resync: set[tuple[str, str]]) -> None:
        for kind, ns_name, loc, tier, h, gen, seq in rows:
            if ns_name not in self._ns:
                self.declare_namespace(ns_name, len(h) if h else 32)
            floor = self.fences.admit(ns_name, loc, gen, seq, seq, 1, resync)
            if floor < 0:
                continue
            if seq <= floor:
                self.counters["duplicate"] += 1
                continue
            self._one(self._ns[ns_name], self._s.loc_id(loc), kind, tier, h)

    def _one(self, ns: BlockTable, lid: int, kind: int, tier: str, h: bytes) -> None:
        self.counters["applied"] += 1
        if kind == EventKind.CLEARED:
            ns.drop(lid)
            return
        code = TIER_BY_NAME.get(tier)
        if code is None:
            raise ValueError(f"event has unknown tier {tier!r}")
        if len(h) != ns.hash_size:
            raise ValueError(f"namespace {ns.name!r} block hashes are {ns.hash_size} bytes")
        if kind == EventKind.STORED:
            ns.store(lid, code, h)
        else:
            ns.remove(lid, code, h)

    # ------------------------------------------------------------------ inventory
    def replace_inventory(self, location: str, generation: int, batch: pa.RecordBatch,
                          seq: int, namespace: str | None = None) -> bool:
        """Replace ``location``'s entries of the batch's namespace with the batch's blocks.

        ``batch`` holds BlockStored rows (hash, tier); ``seq`` is the publisher's last seq at
        the time of the snapshot (later events continue from it). Empty batches need
        ``namespace``. False (nothing changed) if ``generation`` is stale.
        """
        parse_location(location)
        batch = check_event_batch(batch)
        validate_events(batch, None)
        rows = inventory_rows(batch)
        names = {r[0] for r in rows} | ({namespace} if namespace else set())
        if len(names) != 1:
            raise ValueError(f"an inventory covers exactly one namespace, got {sorted(names)}")
        ns_name = names.pop()
        if ns_name not in self._ns:
            self.declare_namespace(ns_name, hash_width(batch))
        ns = self._ns[ns_name]
        if rows and ns.hash_size != hash_width(batch):
            raise ValueError(f"namespace {ns_name!r} block hashes are {ns.hash_size} bytes")
        if not {t for _, t, _ in rows} <= TIER_BY_NAME.keys():
            raise ValueError("inventory rows need a tier: gpu, host or disk")
        if not self.fence(location, generation):
            self.counters["stale"] += len(rows)
            return False
        lid = self._s.loc_id(location)
        ns.drop(lid)
        by_tier: dict[str, list[bytes]] = {}
        for _, tier, h in rows:
            by_tier.setdefault(tier, []).append(h)
        for tier, hashes in by_tier.items():
            ns.store_many(lid, TIER_BY_NAME[tier], hashes)
        self.fences.restart(ns_name, location, generation, seq)
        self.counters["replaced"] += 1
        return True

    # ------------------------------------------------------------------ drops
    def drop_location(self, location: str, up_to_generation: int | None = None) -> int:
        """Forget every entry of ``location`` (its pool or worker died); returns how many.

        With ``up_to_generation`` nothing happens if the location already has a newer
        generation (it restarted meanwhile). Later events of the dropped generation are ignored.
        """
        if self.fences.newer_than(location, up_to_generation):
            return 0
        n = self._drop_entries(location)
        self.fences.forget(location, up_to_generation)
        self.counters["dropped_locations"] += 1
        return n

    def drop_node(self, node: NodeId | str) -> int:
        """Drop a node's pool entries and every worker registered on it."""
        n = self.drop_location(node_location(node))
        for wid in self.registry.on_node(node):
            n += self.unregister_worker(wid)
        return n

    def _drop_entries(self, location: str) -> int:
        lid = self._s.loc_ids.get(location)
        if lid is None:
            return 0
        return sum(ns.drop(lid) for ns in self._ns.values())

    # ------------------------------------------------------------------ queries
    def lookup(self, namespace: str, hashes: Sequence[BlockHash]) -> list[dict[Location, Tier]]:
        """Per block, ``{location: tier}`` of every holder ({} if none)."""
        ns = self._get_ns(namespace)
        ns.check(hashes)
        self._expire_workers()
        return ns.lookup(hashes)

    def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
        """Per location, the prefix of ``hashes`` it holds (see :class:`MatchResult`)."""
        runs = self.match_runs(namespace, hashes)
        return from_runs(runs.num_blocks, runs.runs)

    def match_runs(self, namespace: str, hashes: Sequence[BlockHash]) -> HolderRuns:
        """The match in its compact form ``(num_blocks, runs)`` (see :mod:`kvshare.actors.index.runs`)."""
        ns = self._get_ns(namespace)  # the table checks the hashes as it reads them
        if isinstance(hashes, bytes | str):
            raise ValueError("hashes must be a list of block hashes (bytes), not one value")
        self._expire_workers()
        return HolderRuns(*ns.match_runs(hashes))

    def match_packed(self, namespace: str, blob: bytes, hash_len: int) -> tuple[int, Runs]:
        """:meth:`match_runs` of hashes sent as one bytes object of ``hash_len``-byte hashes."""
        ns = self._get_ns(namespace)
        blob = ns.check_packed(blob, hash_len)
        self._expire_workers()
        return ns.match_runs(blob)

    def match_query(self, query: bytes) -> bytes:
        """:meth:`match_packed` in the wire format of :mod:`kvshare.actors.index.wire`: one bytes
        argument in, the pickled ``(num_blocks, runs)`` out (the cheapest Ray actor call)."""
        namespace, blob, hash_len = decode_query(query)
        return encode_runs(*self.match_packed(namespace, blob, hash_len))

    def match_queries(self, queries: bytes) -> bytes:
        """Several :meth:`match_query` queries in one call (:func:`kvshare.actors.index.wire.encode_queries`);
        the reply pickles the list of ``(num_blocks, runs)``. Any bad query fails the call."""
        return encode_answers([self.match_packed(*decode_query(q)) for q in decode_queries(queries)])

    # ------------------------------------------------------------------ workers
    def register_worker(self, info: WorkerInfo) -> int:
        """Register (or re-register) a worker; returns the generation of ``worker:<id>``."""
        self.registry.check(info)
        for name in info.namespaces:
            ns = self._get_ns(name)
            if info.layout_fingerprint and ns.layout_fingerprint and info.layout_fingerprint != ns.layout_fingerprint:
                raise ValueError(
                    f"worker {info.worker_id} has layout {info.layout_fingerprint} but namespace "
                    f"{name!r} holds layout {ns.layout_fingerprint}: fix the worker's KV layout"
                )
        self.registry.register(info)
        return self.new_generation(worker_loc(info.worker_id))

    def report_load(self, load: WorkerLoad) -> bool:
        """Renew a worker's lease; False if unknown (register again, then republish)."""
        self._expire_workers()
        return self.registry.report(load)

    def unregister_worker(self, worker_id: WorkerId | str) -> int:
        self.registry.remove(WorkerId(worker_id))
        return self.drop_location(worker_loc(worker_id))

    def workers(self) -> list[WorkerInfo]:
        self._expire_workers()
        return self.registry.workers()

    def loads(self) -> dict[WorkerId, WorkerLoad]:
        self._expire_workers()
        return self.registry.loads()

    def _expire_workers(self) -> None:
        for wid in self.registry.expire():
            self.drop_location(worker_loc(wid))

    # ------------------------------------------------------------------ introspection
    def locations(self, namespace: str | None = None) -> dict[str, int]:
        """Block count per location (all namespaces unless one is named)."""
        out: dict[str, int] = {}
        for ns in self._ns.values() if namespace is None else [self._get_ns(namespace)]:
            for lid, n in ns.block_counts().items():
                name = self._s.loc_names[lid]
                out[name] = out.get(name, 0) + n
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "namespaces": self.namespaces(),
            "locations": self.locations(),
            "generations": dict(self.fences.gen),
            "holder_states": len(self._s),
            "workers": len(self.registry.workers()),
            "workers_expired": self.registry.expired,
            "lease_stalls": self.registry.stalls,
            "longest_lease_stall_s": round(self.registry.longest_stall_s, 3),
            "pending_resync": sorted(self.fences.resync),
            "engine_value": self.registry.engine_value.figures(),
            **self.counters,
        }

    # ------------------------------------------------------------------ replicas
    def feed_since(self, cursor: int) -> FeedReply:
        """The changes after ``cursor`` for a replica (see :mod:`kvshare.actors.index.feed`); the
        first call turns the feed on. ``deltas`` is None when the reader must start over
        from :meth:`feed_snapshot`."""
        self._expire_workers()
        if self.feed is None:
            self.feed = IndexFeed()
            for ns in self._ns.values():
                ns.feed = self.feed.pending
            return FeedReply(self.epoch, self.feed.cursor, None, self._hash_sizes())
        nxt, deltas = self.feed.since(cursor)
        return FeedReply(self.epoch, nxt, deltas, self._hash_sizes())

    def feed_snapshot(self) -> FeedReply:
        """The whole map as store deltas, current at the returned cursor."""
        reply = self.feed_since(-1)  # turns the feed on; the cursor is now
        names = self._s.loc_names
        deltas = [d for ns in self._ns.values() for d in ns.store_deltas(names)]
        return reply._replace(deltas=deltas)

    def _hash_sizes(self) -> dict[str, int]:
        return {n: ns.hash_size for n, ns in self._ns.items()}

    def snapshot(self) -> pa.Table:
        """Every entry as rows (namespace, location, tier, hash, generation, seq)."""
        from kvshare.actors.index.arrow_io import snapshot_table

        entries = []
        names = self._s.loc_names
        for ns in self._ns.values():
            for h, lid, code in ns.entries():
                loc = names[lid]
                gen, seq = self.fences.last_seq(ns.name, loc)
                entries.append((ns.name, loc, TIERS[code].value, h, gen, seq))
        return snapshot_table(entries)

    def load_snapshot(self, table: pa.Table) -> int:
        """Warm-start from :meth:`snapshot` output; returns the number of entries loaded."""
        from kvshare.actors.index.arrow_io import inventory_groups

        n = 0
        for (ns_name, loc, gen, seq), batch in inventory_groups(table):
            if ns_name not in self._ns:
                self.declare_namespace(ns_name, hash_width(batch))
            if self.replace_inventory(loc, gen, batch, seq, namespace=ns_name):
                n += batch.num_rows
                self.fences.resync.add((ns_name, loc))  # still ask the owner to confirm
        return n

