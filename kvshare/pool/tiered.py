"""TieredBlockPool: which block lives in which tier and slot, LRU, leases, counters, events.

The pool is bookkeeping over :class:`~kvshare.tiers.base.TierStore` s; with ``stores=None`` it
keeps the same books with no bytes at all (the trace simulator drives it that way).

Invariants (checked by property tests):
- a tier never holds more blocks than ``capacity_bytes // bytes_per_block``;
- a block is in exactly one tier; a leased (pinned or reserved) block is never evicted;
- a slot's epoch changes whenever the slot is given to another block, so a reader holding
  ``(slot, epoch)`` can tell that its block is gone;
- every lease ends: on ``unpin``/``commit``/``abort``, at its deadline, or via
  ``release_holder`` when its holder died.

Eviction is LRU per tier. Chains are stamped tail-first (the last block of a batch is touched
first), so a prefix outlives its tail. An evicted block moves to the next tier if it was hit at
least ``demote_min_hits`` times and that tier can make room; otherwise it is dropped.
With ``PoolConfig.sizing_blocks``, every block a reader pins or touches and every block a
writer reserves is one use for :class:`~kvshare.pool.sizing.HitRateCurve` (one call, one chain),
and :meth:`TieredBlockPool.sizing` answers what hit rate each tier would have at other sizes.
:attr:`TieredBlockPool.value` (:class:`~kvshare.pool.value.ValueLedger`) counts per tier the
blocks served, and the bytes and seconds the pool spent writing into and reading out of it
(``stats()["value"]``).
Thread-safe: every public method takes one lock. The books (tiers, slots, LRU, moves,
events, recovery) are :mod:`kvshare.pool.books`; the leases and their deadlines
:mod:`kvshare.pool.leases`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvshare.events import BlockRemoved, Event
from kvshare.pool.books import Entry, PoolBooks
from kvshare.pool.leases import Lease, LeaseTable, check_lease_request
from kvshare.pool.sizing import HitRateCurve, SizingConfig
from kvshare.pool.types import (
    AlreadyPresent,
    InFlightWrite,
    NoSpace,
    PoolConfig,
    ReadLease,
    ReadResult,
    Reserved,
    ReserveResult,
)
from kvshare.pool.value import BYTES_IN, HITS, LOOKUPS, REMOTE, ValueConfig, ValueLedger
from kvshare.tiers.base import (
    ByteArray,
    CorruptBlock,
    TierStore,
    as_u8,
    as_u8_out,
    block_checksum,
)
from kvshare.types import BlockHash, Tier

log = logging.getLogger(__name__)
SIZING_MULTIPLES = (0.5, 1.0, 2.0, 4.0)  # of each tier's capacity, in stats()["sizing"]


class TieredBlockPool:
    """Blocks of one namespace over host/disk (a node pool) or gpu (a worker pool)."""

    def __init__(
        self,
        config: PoolConfig,
        stores: Mapping[Tier, TierStore] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_bytes = config.layout.bytes_per_block
        self._lock = threading.RLock()
        self.value = ValueLedger([t.tier.value for t in config.tiers] + [REMOTE],
                                 ValueConfig(config.value_window_s), clock)
        self.books = PoolBooks(config, stores, self.value)
        self._leases = LeaseTable(clock, config.lease_ttl_s)
        self.leases_expired = 0
        self.recovered = self.books.recover()
        n = config.sizing_blocks
        self._sizing = HitRateCurve(SizingConfig(
            self.block_bytes, max_tracked=n, hot_blocks=min(n, SizingConfig.hot_blocks),
        )) if n else None

    # ------------------------------------------------------------------ queries
    @property
    def null(self) -> bool:
        """True when the pool keeps books only (no byte stores)."""
        return all(t.store is None for t in self.books.tiers.values())

    def store(self, tier: Tier) -> TierStore | None:
        return self.books.tiers[tier].store if tier in self.books.tiers else None

    def tier_of(self, block_hash: BlockHash) -> Tier | None:
        """The tier of a committed block, else None."""
        with self._lock:
            e = self.books.entries.get(block_hash)
            return e.tier if e is not None and e.committed else None

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            e = self.books.entries.get(block_hash)  # type: ignore[call-overload]
            return e is not None and e.committed

    def __len__(self) -> int:
        with self._lock:
            return sum(len(t.lru) for t in self.books.tiers.values())

    def prefix_len(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` are committed here (no LRU touch)."""
        with self._lock:
            n = 0
            for h in hashes:
                e = self.books.entries.get(h)
                if e is None or not e.committed:
                    break
                n += 1
            return n

    def inventory(self) -> list[tuple[BlockHash, Tier]]:
        """Every committed block and its tier (for index resync)."""
        with self._lock:
            return [(h, t.tier) for t in self.books.tiers.values() for h in t.lru]

    def stats(self) -> dict[str, Any]:
        """Per-tier used/capacity (blocks and bytes) and counters, plus lease figures."""
        with self._lock:
            self._expire()
            tiers = {t.tier.value: t.stats(self.block_bytes) for t in self.books.tiers.values()}
            return {
                "namespace": self.config.namespace,
                "location": self.config.location,
                "generation": self.config.generation,
                "block_bytes": self.block_bytes,
                "tiers": tiers,
                "active_leases": len(self._leases),
                "pinned_blocks": sum(1 for e in self.books.entries.values() if e.pins),
                "leases_expired": self.leases_expired,
                "recovered": self.recovered,
                "block_tokens": self.config.layout.block_tokens,
                "value": self.value.figures(),
                **({"sizing": self._sizing_locked(SIZING_MULTIPLES)} if self._sizing else {}),
            }

    def sizing(self, multiples: Sequence[float] = SIZING_MULTIPLES) -> dict[str, Any] | None:
        """What hit rate each tier would have at ``multiples`` of its configured capacity
        (None without ``sizing_blocks``): ``{"tiers": {tier: [(capacity_bytes, hit_rate)]},
        "lookups", "blocks", "rate", "tracked"}`` (uses and blocks seen, the share of blocks
        sampled now, blocks tracked).

        ``hit_rate`` is the share of the block uses (pins, touches, reserves) that tier would
        have served. The first tier is an LRU of its capacity; a lower tier holds what the
        tiers above it evict (``demote_min_hits`` = 0), so at capacity C it serves the uses an
        LRU of (the tiers above + C) serves that the tiers above do not.
        """
        with self._lock:
            return self._sizing_locked(multiples) if self._sizing else None

    def take_events(self) -> list[Event]:
        """Drain the events emitted since the last call, in order."""
        with self._lock:
            return self.books.take_events()

    # ------------------------------------------------------------------ writes
    def reserve(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float | None = None
    ) -> list[ReserveResult]:
        """Hold a write slot in the first tier for each new hash; never blocks."""
        check_lease_request(hashes, self.config.hash_size, ttl_s)
        with self._lock:
            self._expire()
            self._use(hashes)
            out: list[ReserveResult] = []
            tier = self.books.order[0]
            for h in hashes:
                e = self.books.entries.get(h)
                if e is not None:
                    out.append(AlreadyPresent(h) if e.committed else InFlightWrite(h))
                    continue
                slot = self.books.alloc(tier)
                if slot is None:
                    out.append(NoSpace(h))
                    continue
                self.books.entries[h] = Entry(h, tier, slot, -1, committed=False)
                lease = self._leases.new(holder, h, ttl_s, write=True)
                out.append(Reserved(h, lease, tier, slot, int(self.books.tiers[tier].epochs[slot])))
            return out

    def write(self, lease_id: int, data: object) -> None:
        """Copy a block payload into a reserved slot (and record its checksum)."""
        payload = as_u8(data)
        with self._lock:
            lease = self._leases.held(lease_id, write=True)
            e = self.books.entries[lease.block_hash]
            self._check_payload(payload)
            st = self.books.tiers[e.tier]
            t0 = time.perf_counter()
            if st.store is not None:
                e.checksum = st.store.write_checksummed(e.slot, payload, e.block_hash)
            else:
                e.checksum = block_checksum(payload)
            self.value.moved(e.tier, 0, time.perf_counter() - t0, into=True)  # bytes: commit

    def commit(self, lease_ids: Sequence[int], checksums: Sequence[int] | None = None) -> list[BlockHash]:
        """Make reserved blocks visible (one BlockStored event each); returns their hashes.

        A writer that filled the slot itself (shared memory) may pass the checksums it
        computed; otherwise the pool computes them from the slot. Unknown or expired leases
        raise KeyError and nothing is committed.
        """
        with self._lock:
            self._expire()
            leases = [self._leases.held(lid, write=True) for lid in lease_ids]
            if len({lease.lease_id for lease in leases}) != len(leases):
                raise ValueError("commit got the same lease twice: pass each lease id once")
            if checksums is not None and len(checksums) != len(leases):
                raise ValueError("commit got a different number of checksums than leases")
            # every checksum before any change, so that a failing store commits nothing
            sums: list[int] = []
            for i, lease in enumerate(leases):
                e = self.books.entries[lease.block_hash]
                st = self.books.tiers[e.tier]
                if checksums is not None:
                    sums.append(int(checksums[i]))
                elif e.checksum < 0:
                    sums.append(st.store.checksum(e.slot) if st.store is not None else 0)
                else:
                    sums.append(e.checksum)
            done: list[BlockHash] = []
            stored: dict[Tier, int] = {}
            for lease, checksum in zip(leases, sums, strict=True):
                e = self.books.entries[lease.block_hash]
                st = self.books.tiers[e.tier]
                e.checksum = checksum
                e.committed = True
                self._leases.end(lease.lease_id)
                st.counters["stores"] += 1
                st.counters["bytes_in"] += self.block_bytes
                stored[e.tier] = stored.get(e.tier, 0) + 1
                self.books.emit_stored(e.block_hash, e.tier)
                done.append(e.block_hash)
            for h in reversed(done):  # tail first: the prefix ends most recent
                e = self.books.entries[h]
                self.books.tiers[e.tier].lru[h] = None
            for tier, n in stored.items():
                self.value.add(tier, BYTES_IN, n * self.block_bytes)
            return done

    def abort(self, lease_ids: Iterable[int]) -> None:
        """Give reserved slots back; unknown leases are ignored (they may have expired)."""
        with self._lock:
            for lid in lease_ids:
                lease = self._leases.get(lid)
                if lease is not None and lease.write:
                    self._drop_reservation(lease)

    def put(self, block_hash: BlockHash, data: object, holder: str = "put") -> bool:
        """reserve + write + commit in one call; False if present, in flight or no space.

        A payload of the wrong size raises ValueError before anything (eviction included)
        happens.
        """
        payload = as_u8(data)
        self._check_payload(payload)
        (res,) = self.reserve([block_hash], holder)
        if not isinstance(res, Reserved):
            return False
        try:
            self.write(res.lease_id, payload)
        except BaseException:
            self.abort([res.lease_id])
            raise
        self.commit([res.lease_id])
        return True

    # ------------------------------------------------------------------ reads
    def pin(
        self,
        hashes: Sequence[BlockHash],
        holder: str,
        ttl_s: float | None = None,
        *,
        promote: bool = False,
        remote: bool = False,
    ) -> list[ReadLease | None]:
        """Lease committed blocks for reading (None = miss). Counts hits and misses.

        With ``promote=True`` disk blocks are first copied into the first tier (verified), so
        shared-memory readers can map them; a block that fails verification is a miss.
        ``remote``: the reader pulls them to another node; the value ledger counts its hits as
        remote pulls (:data:`kvshare.pool.value.REMOTE`), the tier counters as usual.
        """
        check_lease_request(hashes, self.config.hash_size, ttl_s)
        with self._lock:
            self._expire()
            self._use(hashes)
            hit: dict[Tier, int] = {}
            out: list[ReadLease | None] = []
            for h in hashes:
                e = self.books.entries.get(h)
                if e is None or not e.committed:
                    self.books.tiers[self.books.order[0]].counters["misses"] += 1
                    out.append(None)
                    continue
                found = e.tier  # the tier that served it, also when promoted out of it
                if promote and e.tier != self.books.order[0] and e.pins == 0:
                    self._promote(e)
                    if self.books.entries.get(h) is not e:  # corrupt: dropped
                        self.books.tiers[self.books.order[0]].counters["misses"] += 1
                        out.append(None)
                        continue
                st = self.books.tiers[e.tier]
                e.hits += 1
                e.pins += 1
                self.books.tiers[found].counters["hits"] += 1
                hit[found] = hit.get(found, 0) + 1
                lease = self._leases.new(holder, h, ttl_s, write=False)
                out.append(ReadLease(h, lease, e.tier, e.slot, int(st.epochs[e.slot]), e.checksum))
            for h in reversed(hashes):
                e = self.books.entries.get(h)
                if e is not None and e.committed:
                    self.books.tiers[e.tier].lru.move_to_end(h)
            for tier, n in hit.items():
                self.value.add(REMOTE if remote else tier, HITS, n)
            return out

    def read_into(self, lease: ReadLease, out: object, *, remote: bool = False) -> ReadResult:
        """Copy a pinned block into ``out`` (uint8, block_bytes), verifying it (``remote``:
        for a reader on another node; the value ledger charges the copy to remote pulls).

        A stale epoch (slot reused after the lease ended) or a failed checksum is a miss with a
        reason; a corrupt block is dropped from the pool and counted. ``out`` must be writable
        and C-contiguous (ValueError otherwise, nothing read).
        """
        dest = as_u8_out(out)
        with self._lock:
            if lease.lease_id not in self._leases:
                return ReadResult(lease.block_hash, False, "lease expired")
            st = self.books.tiers[lease.tier]
            if st.epochs[lease.slot] != lease.epoch:
                return ReadResult(lease.block_hash, False, "slot reused")
            if st.store is None:
                return ReadResult(lease.block_hash, False, "no byte store")
            t0 = time.perf_counter()
            try:
                st.store.read_into(lease.slot, dest, lease.block_hash, lease.checksum)
            except CorruptBlock as exc:
                self._corrupt(lease.block_hash, str(exc))
                return ReadResult(lease.block_hash, False, f"corrupt: {exc}")
            st.counters["bytes_out"] += self.block_bytes
            self.value.moved(REMOTE if remote else lease.tier, self.block_bytes,
                             time.perf_counter() - t0, into=False)
            return ReadResult(lease.block_hash, True)

    def touch(self, hashes: Sequence[BlockHash], tier: Tier) -> int:
        """Count hits on blocks a same-node reader copied out of ``tier``'s memory with no
        lease (it knew their slots and checked their epochs itself): the LRU and the hit
        counters see them as ``acquire`` would. Returns how many are still in ``tier``."""
        with self._lock:
            self._use(hashes)
            st = self.books.tiers[tier]
            n = 0
            for h in reversed(hashes):
                e = self.books.entries.get(h)
                if e is None or not e.committed or e.tier != tier:
                    continue
                e.hits += 1
                st.lru.move_to_end(h)
                n += 1
            st.counters["hits"] += n
            st.counters["bytes_out"] += n * self.block_bytes
            self.value.add(tier, HITS, n)
            self.value.moved(tier, n * self.block_bytes, 0.0, into=False)
            return n

    def note_read(self, tier: Tier, blocks: int, *, remote: bool = False) -> None:
        """Count ``blocks`` handed to a reader that copies them itself from the tier's memory
        (shm mapping, NIXL READ), so ``bytes_out`` covers every way out of the tier; ``remote``:
        a reader on another node (the value ledger's remote pulls)."""
        with self._lock:
            self.books.tiers[tier].counters["bytes_out"] += blocks * self.block_bytes
            self.value.moved(REMOTE if remote else tier, blocks * self.block_bytes, 0.0,
                             into=False)

    def note_pull(self, seconds: float) -> None:
        """Seconds a remote reader's pull took as this pool saw it (prepare to finish), for
        the value ledger's remote pulls."""
        with self._lock:
            self.value.moved(REMOTE, 0, seconds, into=False)

    def unpin(self, lease_ids: Iterable[int]) -> None:
        """End read leases; unknown ids are ignored (they may have expired)."""
        with self._lock:
            for lid in lease_ids:
                lease = self._leases.get(lid)
                if lease is not None and not lease.write:
                    self._end_read(lease)

    def share_epochs(self, tier: Tier, out: Any) -> None:
        """Keep ``tier``'s slot epochs in ``out`` (int64, one per slot) from now on.

        ``out`` is typically shared memory, so that a process on the node that copied a slot
        out re-checks the slot's epoch itself instead of asking the pool.
        """
        with self._lock:
            st = self.books.tiers[tier]
            if not isinstance(out, np.ndarray) or out.dtype != np.int64 or out.shape != (st.num_slots,):
                raise ValueError(
                    f"epochs of tier {tier.value} need an int64 array of {st.num_slots} slots"
                )
            out[:] = st.epochs
            st.epochs = out

    def leases_alive(self, lease_ids: Sequence[int]) -> list[bool]:
        """Whether each lease is still held (not ended, not expired).

        A live read lease means its slot still holds the block it was taken for (the slot is
        never reused while leased), so a reader that copied out of shared memory checks this
        after the copy instead of comparing epochs itself.
        """
        with self._lock:
            self._expire()
            return [lid in self._leases for lid in lease_ids]

    def get(self, block_hash: BlockHash) -> ByteArray | None:
        """A verified copy of one block, or None on a miss (pin, read, unpin)."""
        (lease,) = self.pin([block_hash], "get")
        if lease is None:
            return None
        try:
            buf = np.empty(self.block_bytes, dtype=np.uint8)
            return buf if self.read_into(lease, buf).ok else None
        finally:
            self.unpin([lease.lease_id])

    def verify(self, block_hash: BlockHash) -> bool:
        """Re-check a committed block's bytes against its checksum; drop it if corrupt."""
        with self._lock:
            e = self.books.entries.get(block_hash)
            if e is None or not e.committed:
                return False
            st = self.books.tiers[e.tier]
            if st.store is None:
                return True
            buf = np.empty(self.block_bytes, dtype=np.uint8)
            try:
                st.store.read_into(e.slot, buf, block_hash, e.checksum)
                if block_checksum(buf) != e.checksum:
                    raise CorruptBlock("payload checksum mismatch")
            except CorruptBlock as exc:
                self._corrupt(block_hash, str(exc))
                return False
            return True

    # ------------------------------------------------------------------ admin
    def release_holder(self, holder: str) -> int:
        """End every lease held by ``holder`` (it died); returns how many."""
        with self._lock:
            mine = [lease for lease in self._leases.values() if lease.holder == holder]
            for lease in mine:
                self._end_lease(lease)
            return len(mine)

    def expire_leases(self) -> int:
        """End leases past their deadline now; returns how many."""
        with self._lock:
            return self._expire()

    def maintain(self) -> int:
        """Demote from the first tier until it is under the low watermark (if over the high)."""
        with self._lock:
            self._expire()
            st = self.books.tiers[self.books.order[0]]
            if st.used <= self.config.high_watermark * st.num_slots:
                return 0
            moved = 0
            target = self.config.low_watermark * st.num_slots
            while st.used > target and self.books.evict_one(st.tier):
                moved += 1
            return moved

    def remove(self, hashes: Iterable[BlockHash]) -> int:
        """Drop committed, unpinned blocks; returns how many were removed."""
        with self._lock:
            n = 0
            for h in hashes:
                e = self.books.entries.get(h)
                if e is not None and e.committed and e.pins == 0:
                    self.books.drop(e)
                    n += 1
            return n

    def clear(self) -> int:
        """Drop every unpinned committed block; one AllCleared event if nothing stays."""
        with self._lock:
            victims = [e for e in self.books.entries.values() if e.committed and e.pins == 0]
            for e in victims:
                self.books.drop(e, emit=False)
            if any(e.committed for e in self.books.entries.values()):
                for e in victims:
                    self.books.emit(BlockRemoved, e.block_hash, e.tier)
            else:
                self.books.emit_cleared()
            return len(victims)

    def close(self) -> None:
        """Close the byte stores (the host slab is unmapped and, by its owner, unlinked)."""
        with self._lock:
            for st in self.books.tiers.values():
                if st.store is not None:
                    st.store.close()

    # ------------------------------------------------------------------ internals
    def _use(self, hashes: Sequence[BlockHash]) -> None:
        """One reader's or writer's chain of blocks: the sizing estimate's uses, and the value
        ledger's lookups (a tier's share of lookups is of the same uses)."""
        self.value.add(self.books.order[0], LOOKUPS, len(hashes))
        if self._sizing is not None and hashes:
            self._sizing.lookup(hashes)

    def _sizing_locked(self, multiples: Sequence[float]) -> dict[str, Any]:
        curve = self._sizing
        assert curve is not None
        tiers: dict[str, list[tuple[int, float]]] = {}
        above = 0  # bytes of the tiers above this one
        for tier in self.books.order:
            cap = self.books.tiers[tier].num_slots * self.block_bytes
            base = curve.hit_rate(above) if above else 0.0
            tiers[tier.value] = [
                (int(m * cap), round(curve.hit_rate(above + int(m * cap)) - base, 4))
                for m in multiples
            ]
            above += cap
        return {"tiers": tiers, "lookups": curve.lookups, "blocks": curve.blocks,
                "rate": curve.rate, "tracked": curve.tracked}

    def _check_payload(self, payload: ByteArray) -> None:
        if payload.nbytes != self.block_bytes:
            raise ValueError(
                f"block payload is {payload.nbytes} bytes but this pool's blocks are "
                f"{self.block_bytes} bytes: check the KV layout (dtype, block_tokens, heads)"
            )

    def _expire(self) -> int:
        n = 0
        for lease in self._leases.due():
            self._end_lease(lease)
            self.leases_expired += 1
            n += 1
        return n

    def _end_lease(self, lease: Lease) -> None:
        if lease.write:
            self._drop_reservation(lease)
        else:
            self._end_read(lease)

    def _end_read(self, lease: Lease) -> None:
        self._leases.end(lease.lease_id)
        e = self.books.entries.get(lease.block_hash)
        if e is not None and e.pins > 0:
            e.pins -= 1

    def _drop_reservation(self, lease: Lease) -> None:
        self._leases.end(lease.lease_id)
        e = self.books.entries.get(lease.block_hash)
        if e is not None and not e.committed:
            del self.books.entries[lease.block_hash]
            self.books.free_slot(e.tier, e.slot)

    def _promote(self, e: Entry) -> None:
        first = self.books.order[0]
        e.pins += 1
        try:
            if self.books.move(e, first):
                self.books.tiers[first].counters["promotions"] += 1
        except CorruptBlock as exc:
            e.pins -= 1
            self._corrupt(e.block_hash, str(exc))
            return
        e.pins -= 1

    def _corrupt(self, block_hash: BlockHash, why: str) -> None:
        e = self.books.entries.get(block_hash)
        log.warning("dropping corrupt block %s: %s", block_hash.hex()[:16], why)
        if e is None:
            return
        self.books.tiers[e.tier].counters["corrupt"] += 1
        for lease in [x for x in self._leases.values() if x.block_hash == block_hash]:
            self._leases.end(lease.lease_id)
        e.pins = 0
        self.books.drop(e)
