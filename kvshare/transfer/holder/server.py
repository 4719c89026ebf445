"""The pool side of every transport: serve control messages over one TieredBlockPool.

A :class:`BlockServer` lives in the process that owns the pool (a NodePoolActor, one per
namespace) and answers the :class:`~kvshare.transfer.wire.BlockControl` calls: it pins blocks
for readers (promoting disk blocks into the host slab so they can be mapped or read over
NIXL), copies blocks out for the object-store path, reserves and commits slots for writers,
and owns the NIXL source agent that exposes the host slab. Leases are taken under the
transfer's holder name, and ``finish`` ends them all, so a reader that dies or times out
leaves nothing pinned beyond the lease TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from kvshare.pool.tiered import TieredBlockPool
from kvshare.pool.types import AlreadyPresent, InFlightWrite, NoSpace, Reserved
from kvshare.tiers.base import ByteArray, CorruptBlock, block_checksum
from kvshare.tiers.host import HostSlab
from kvshare.transfer import wire
from kvshare.transfer.base import (
    CORRUPT,
    DEADLINE,
    IN_FLIGHT,
    MISSING,
    NIXL_UNAVAILABLE,
    NO_SPACE,
    TransportUnavailable,
)
from kvshare.transfer.epochs import SharedEpochs, epochs_name
from kvshare.transfer.nixl_agent import NixlSource
from kvshare.transfer.probe import probe_hashes, seed_probe_blocks
from kvshare.transfer.verify import PinnedSlot, SlotVerifier
from kvshare.types import BlockHash, Tier

log = logging.getLogger(__name__)

T = TypeVar("T")

FINISHED_MEMORY = 4096  # holders remembered as finished (a late prepare for them pins nothing)


class BlockServer:
    """Transport control over ``pool`` on node ``node``; ``nixl=True`` starts a NIXL agent.

    NIXL failing to start is not an error: ``nixl_error`` records why and replies carry no
    agent, so pullers fall back to another transport.
    """

    def __init__(self, pool: TieredBlockPool, node: str, *, nixl: bool = True) -> None:
        self.pool = pool
        self.node = node
        self.block_bytes = pool.block_bytes
        store = pool.store(Tier.HOST)
        self.slab: HostSlab | None = store if isinstance(store, HostSlab) else None
        self.nixl_error = ""
        self._nixl: NixlSource | None = None
        self._epochs: SharedEpochs | None = None
        if self.slab is not None and self.slab.name is not None:
            SharedEpochs.remove_stale(self.slab.name, self.slab.directory)
            slots = int(pool.stats()["tiers"][Tier.HOST.value]["capacity_slots"])
            self._epochs = SharedEpochs(epochs_name(self.slab.name), slots, create=True,
                                        directory=self.slab.directory)
            pool.share_epochs(Tier.HOST, self._epochs.array)
        # A reader that timed out sends ``finish`` while its ``prepare`` may still be queued or
        # running (threaded actors): remember finished holders so that nothing stays pinned.
        self._lock = threading.Lock()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._pulls: dict[str, float] = {}  # remote reader -> when its prepare pinned blocks
        self._verifier = SlotVerifier(self.slab) if self.slab is not None else None
        if nixl and self.slab is not None:
            try:
                self._nixl = NixlSource(self.agent_name, self.slab)
            except TransportUnavailable as exc:
                self.nixl_error = str(exc)
                log.warning("NIXL source for %s unavailable: %s", self.agent_name, exc)
        elif nixl:
            self.nixl_error = "nixl_unavailable: the pool has no host slab to expose"

    @property
    def generation(self) -> int:
        return self.pool.config.generation

    @property
    def agent_name(self) -> str:
        """``{namespace}/{node}/{generation}``: new pool generation, new agent."""
        return f"{self.pool.config.namespace}/{self.node}/{self.generation}"

    # ------------------------------------------------------------------ discovery
    def slab_info(self) -> wire.SlabInfo | None:
        s = self.slab
        if s is None or s.name is None:
            return None
        return wire.SlabInfo(s.name, s.slot_bytes, s.num_slots, self.generation, self.node,
                             self._epochs.name if self._epochs is not None else "",
                             s.directory)

    def nixl_info(self) -> wire.NixlPeerInfo | None:
        if self._nixl is None:
            return None
        return self._nixl.info(self.generation)

    @property
    def nixl_source(self) -> NixlSource | None:
        """The NIXL agent exposing the slab (None when NIXL is off or failed to start)."""
        return self._nixl

    # ------------------------------------------------------------------ holders
    def _take(self, holder: str, take: Callable[[], T]) -> T | None:
        """``take()`` (pins or reservations for ``holder``) under the lock, or None when
        ``holder`` already finished: its transfer ended, nobody would end new leases."""
        with self._lock:
            return None if holder in self._finished else take()

    def _too_late(self, hashes: Sequence[BlockHash]) -> wire.SlotReply:
        return wire.SlotReply(self.generation, (DEADLINE,) * len(hashes))

    def _serving(self, holder: str, ttl_s: float) -> None:
        """A NIXL reader moves bytes of the slab for ``holder`` from now until it finishes."""
        with self._lock:  # a finish that came first closed it for good
            if self._nixl is not None and holder not in self._finished:
                self._nixl.serving(holder, ttl_s)

    def _end_holder(self, holder: str) -> None:
        """End every lease of ``holder`` and remember it finished (under the lock)."""
        if self._nixl is not None:
            self._nixl.served(holder)
        started = self._pulls.pop(holder, None)
        if started is not None:
            self.pool.note_pull(time.perf_counter() - started)
        self.pool.release_holder(holder)
        self._finished[holder] = None
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def _slot_reply(self, blocks: list[wire.SourceBlock | str]) -> wire.SlotReply:
        """A prepare's reply: per block a slot or a reason, with the slab and NIXL agent."""
        agent = self._nixl.name if self._nixl is not None else ""
        return wire.SlotReply(self.generation, tuple(blocks), self.slab_info(), agent,
                              self.nixl_error)

    # ------------------------------------------------------------------ reads
    def prepare_read(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, verify: bool = False,
        nixl: bool = False,
    ) -> wire.SlotReply:
        """Pin ``hashes`` in the host slab for ``holder``; a miss says missing or corrupt.
        ``nixl``: the reader READs them over NIXL (the agent is progressed until ``finish``).

        With ``verify`` the pinned slots are checksummed in the background from now on, and
        ``finish`` with their lease ids waits for that and reports a slot whose bytes do not
        match as an invalid lease (and drops its block): see :mod:`kvshare.transfer.verify`.
        A NIXL reader is counted as a remote pull (:mod:`kvshare.pool.value`), timed from this
        prepare to its ``finish``.
        """
        return self._prepare(hashes, holder, ttl_s, verify, nixl, remote=nixl)

    def _prepare(self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, verify: bool,
                 nixl: bool, *, remote: bool) -> wire.SlotReply:
        t0 = time.perf_counter()
        taken = self._take(holder, lambda: ([h in self.pool for h in hashes],
                                            self.pool.pin(hashes, holder, ttl_s, promote=True,
                                                          remote=remote)))
        if taken is None:
            return self._too_late(hashes)
        known, leases = taken
        blocks: list[wire.SourceBlock | str] = []
        for was, lease in zip(known, leases, strict=True):
            if lease is None:
                blocks.append(CORRUPT if was else MISSING)
            elif lease.tier != Tier.HOST:  # promotion found no room in the host tier
                self.pool.unpin([lease.lease_id])
                blocks.append(NO_SPACE)
            else:
                blocks.append(wire.SourceBlock(lease.lease_id, lease.slot, lease.epoch, lease.checksum))
        if verify and self._verifier is not None:
            self._verifier.start(holder, [
                PinnedSlot(b.lease_id, h, b.slot, b.checksum)
                for h, b in zip(hashes, blocks, strict=True) if isinstance(b, wire.SourceBlock)])
        # the reader copies these slots itself (shm mapping, NIXL): they leave the slab now
        pinned = sum(isinstance(b, wire.SourceBlock) for b in blocks)
        self.pool.note_read(Tier.HOST, pinned, remote=remote)
        if remote and pinned:
            with self._lock:
                if holder not in self._finished:
                    self._pulls.setdefault(holder, t0)
        if nixl and pinned:
            self._serving(holder, ttl_s)
        return self._slot_reply(blocks)

    def push_read(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, request: wire.PushRequest
    ) -> wire.SlotReply:
        """Pin ``hashes``, NIXL-WRITE them into the reader's memory, end the pins (nixl_push).

        Raises ValueError (nothing pinned) when the request does not match the pool's blocks.
        """
        start = time.monotonic()
        if len(request.dest_addrs) != len(hashes):
            raise ValueError(f"push_read got {len(hashes)} hashes but "
                             f"{len(request.dest_addrs)} addresses")
        if request.block_bytes != self.block_bytes:
            raise ValueError(
                f"buffers hold {request.block_bytes} bytes but the pool's blocks are "
                f"{self.block_bytes} bytes: check the KV layout of the namespace"
            )
        prep = self._prepare(hashes, holder, ttl_s, False, False, remote=True)
        blocks: list[wire.SourceBlock | str] = list(prep.blocks)
        moving = [i for i, b in enumerate(blocks) if isinstance(b, wire.SourceBlock)]
        try:
            if not moving:
                reason = ""
            elif self._nixl is None:
                reason = NIXL_UNAVAILABLE
            else:
                slots = [b.slot for b in blocks if isinstance(b, wire.SourceBlock)]
                reason = self._nixl.write_slots(slots, [request.dest_addrs[i] for i in moving],
                                                request, start)
        finally:
            self.finish(holder, [])
        if reason:
            for i in moving:
                blocks[i] = reason
        return wire.SlotReply(prep.generation, tuple(blocks))

    def finish(self, holder: str, lease_ids: Sequence[int]) -> list[bool]:
        """Report which of ``lease_ids`` were still valid, then end every lease of ``holder``.

        For a ``prepare_read(verify=True)`` a lease is valid only if its slot also passed the
        checksum (waited for here, at most ``verify.WAIT_S``); blocks that failed are dropped.
        Without lease ids the checksums are not waited for.
        """
        verdict = None
        if self._verifier is not None and lease_ids:
            verdict = self._verifier.verdict(holder)
        elif self._verifier is not None:
            self._verifier.forget(holder)
        with self._lock:
            alive = self.pool.leases_alive(lease_ids)
            self._end_holder(holder)
        if verdict is None:
            return alive
        corrupt = [s.block_hash for s in verdict.values() if not s.ok]
        if corrupt:
            self.report_corrupt(corrupt)
        return [a and lid in verdict and verdict[lid].ok for a, lid in zip(alive, lease_ids, strict=True)]

    def touch(self, hashes: Sequence[BlockHash]) -> int:
        """Blocks a same-node reader copied from the host slab with no pin (it checked their
        epochs itself): counted as hits, kept fresh in the LRU (:meth:`TieredBlockPool.touch`)."""
        return self.pool.touch(hashes, self.pool.books.order[0])

    def read_blocks(self, hashes: Sequence[BlockHash]) -> wire.BlockBatch:
        """Copy the held blocks out (object-store path); disk blocks are verified on read."""
        holder = "objstore-read"
        known = [h in self.pool for h in hashes]
        leases = self.pool.pin(hashes, holder, 30.0, remote=True)
        n = sum(1 for x in leases if x is not None)
        data = np.empty((n, self.block_bytes), dtype=np.uint8)
        rows = [-1] * len(hashes)
        sums = [0] * len(hashes)
        reasons = [""] * len(hashes)
        row = 0
        try:
            for i, (was, lease) in enumerate(zip(known, leases, strict=True)):
                if lease is None:
                    reasons[i] = CORRUPT if was else MISSING
                    continue
                res = self.pool.read_into(lease, data[row], remote=True)
                if res.ok:
                    rows[i], sums[i] = row, lease.checksum
                    row += 1
                else:
                    reasons[i] = CORRUPT if res.reason.startswith("corrupt") else MISSING
        finally:
            self.pool.unpin([x.lease_id for x in leases if x is not None])
        return wire.BlockBatch(data[:row], tuple(rows), tuple(sums), tuple(reasons))

    def report_corrupt(self, hashes: Sequence[BlockHash]) -> int:
        """A reader saw bad bytes: re-verify those blocks and drop the corrupt ones."""
        return sum(1 for h in hashes if h in self.pool and not self.pool.verify(h))

    # ------------------------------------------------------------------ writes
    def prepare_write(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, nixl: bool = False
    ) -> wire.SlotReply:
        """Reserve a host slot per new hash for ``holder`` (``"present"`` if already held);
        ``nixl``: the writer WRITEs them over NIXL (the agent is progressed until the commit)."""
        res = self._take(holder, lambda: self.pool.reserve(hashes, holder, ttl_s))
        if res is None:
            return self._too_late(hashes)
        slots: list[wire.SourceBlock | str] = []
        for r in res:
            if isinstance(r, Reserved):
                if r.tier != Tier.HOST:
                    self.pool.abort([r.lease_id])
                    slots.append(NO_SPACE)
                else:
                    slots.append(wire.SourceBlock(r.lease_id, r.slot, r.epoch, -1))
            elif isinstance(r, AlreadyPresent):
                slots.append(wire.PRESENT)
            elif isinstance(r, InFlightWrite):
                slots.append(IN_FLIGHT)
            else:
                assert isinstance(r, NoSpace)
                slots.append(NO_SPACE)
        if nixl and any(isinstance(s, wire.SourceBlock) for s in slots):
            self._serving(holder, ttl_s)
        return self._slot_reply(slots)

    def commit_write(
        self, holder: str, lease_ids: Sequence[int], checksums: Sequence[int]
    ) -> list[BlockHash]:
        """Commit the reservations that are still live; abort every other one of ``holder``."""
        with self._lock:
            alive = self.pool.leases_alive(lease_ids)
            keep = [(lid, ck) for lid, ck, ok in zip(lease_ids, checksums, alive, strict=True) if ok]
            done = self.pool.commit([k[0] for k in keep], [k[1] for k in keep]) if keep else []
            self._end_holder(holder)
            return done

    def write_blocks(
        self, hashes: Sequence[BlockHash], data: ByteArray, checksums: Sequence[int]
    ) -> list[str]:
        """Store blocks that arrived as bytes (object-store path); per block ``""`` (stored),
        :data:`~kvshare.transfer.wire.PRESENT` (already held) or a miss reason.

        A payload whose checksum differs from the sender's was damaged on the way: not stored.
        """
        if data.shape != (len(hashes), self.block_bytes) or len(checksums) != len(hashes):
            raise ValueError(
                f"write_blocks needs data of shape ({len(hashes)}, {self.block_bytes}) and one "
                f"checksum per hash, got {tuple(data.shape)}: check the KV layout (dtype, "
                "block_tokens, heads)"
            )
        out: list[str] = []
        for i, h in enumerate(hashes):
            if block_checksum(data[i]) != checksums[i]:
                out.append(CORRUPT)
                continue
            (r,) = self.pool.reserve([h], "objstore-write")
            if isinstance(r, AlreadyPresent):
                out.append(wire.PRESENT)
            elif isinstance(r, Reserved):
                try:
                    self.pool.write(r.lease_id, data[i])
                    self.pool.commit([r.lease_id], [checksums[i]])
                    out.append("")
                except (CorruptBlock, OSError) as exc:
                    log.warning("write of %s failed: %s", h.hex()[:16], exc)
                    self.pool.abort([r.lease_id])
                    out.append(CORRUPT)
            else:
                out.append(IN_FLIGHT if isinstance(r, InFlightWrite) else NO_SPACE)
        return out

    def probe_blocks(self, n: int) -> list[BlockHash]:
        """Seed (once) and name ``n`` probe blocks that readers time transports with."""
        if not 0 < n <= 64:
            raise ValueError(f"probe needs 1..64 blocks, got {n}")
        seed_probe_blocks(self.pool, self.node, n)
        return probe_hashes(self.node, n, self.pool.config.hash_size)

    def close(self) -> None:
        if self._verifier is not None:
            self._verifier.close()
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None
        if self._epochs is not None:  # the pool keeps its (now private) copy of the epochs
            self.pool.share_epochs(Tier.HOST, self._epochs.array.copy())
            self._epochs.close()
            self._epochs = None
