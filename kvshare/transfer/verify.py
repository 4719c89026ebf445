"""The holding pool checksums pinned slots while a reader's NIXL transfer moves them.

A NIXL READ is one-sided: the pool's CPU is idle while the reader's agent (or its NIC) copies
the slots, and the reader's own thread is busy copying (UCX ``cma`` copies inside the call
that posts the transfer, holding the GIL). Checksumming what arrived after the copy therefore
added a second full pass over the bytes to every read (measured: ~26 ms on top of ~60 ms for
256 MiB). Here the pool checksums the pinned slots in a background thread from the moment it
answers ``prepare_read(verify=True)``, in parallel with the copy, and the reader's ``finish``
waits for the verdict: a slot whose bytes no longer match their checksum (bit rot in the
slab) makes that lease invalid, so the reader's block is a ``corrupt`` miss and the pool drops
the block. What this does not cover is damage on the wire or in the reader's memory: UCX's
transports deliver bytes intact (``cma`` is a kernel copy, RDMA NICs check a CRC per packet,
TCP its own sums). ``NixlTransport(end_to_end=True)`` has the reader checksum what arrived
instead (after the read), which covers the wire and the reader's memory too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import NamedTuple

from kvshare.tiers.base import block_checksum
from kvshare.tiers.host import HostSlab
from kvshare.types import BlockHash

log = logging.getLogger(__name__)


TASK_BYTES = 32 * 1024 * 1024
"""Slots are checksummed in tasks of about this many bytes (so two threads share big batches)."""
THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
"""Checksum threads per pool: half the cores (the other half copies, on a one-host cluster)."""
WAIT_S = 10.0
"""The longest a ``finish`` waits for its checksums (then its blocks are misses)."""
PENDING_MEMORY = 1024  # holders whose verdicts are kept until their finish (oldest dropped)


class PinnedSlot(NamedTuple):
    """One slot a reader is moving: its lease, where it is and what it should hash to."""

    lease_id: int
    block_hash: BlockHash
    slot: int
    checksum: int


class Checked(NamedTuple):
    """A checked slot: its block and whether its bytes matched the checksum."""

    block_hash: BlockHash
    ok: bool


class SlotVerifier:
    """Checksums pinned slots of a host ``slab`` in the background.

    :meth:`start` queues one holder's slots; :meth:`verdict` waits for them and says which
    leases hold intact bytes. Thread-safe. The slab must stay mapped until :meth:`close`.
    """

    def __init__(self, slab: HostSlab) -> None:
        self.slab = slab
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, list[tuple[list[PinnedSlot], Future[list[bool]]]]] = (
            OrderedDict())
        self._pool: ThreadPoolExecutor | None = None

    def start(self, holder: str, slots: Sequence[PinnedSlot]) -> None:
        """Begin checksumming ``holder``'s pinned ``slots`` (a second start replaces the first)."""
        if not slots:
            return
        per_task = max(1, TASK_BYTES // self.slab.slot_bytes)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="kvshare-verify")
            parts = [list(slots[i : i + per_task]) for i in range(0, len(slots), per_task)]
            self._pending[holder] = [(p, self._pool.submit(self._check, p)) for p in parts]
            while len(self._pending) > PENDING_MEMORY:
                self._pending.popitem(last=False)

    def _check(self, slots: list[PinnedSlot]) -> list[bool]:
        rows = self.slab.array
        return [block_checksum(rows[s.slot]) == s.checksum for s in slots]

    def verdict(self, holder: str, timeout: float = WAIT_S) -> dict[int, Checked] | None:
        """Wait (up to ``timeout`` s in all) for ``holder``'s checksums: lease id -> the block
        and whether its slot's bytes are intact. Leases not checked in time are left out (not known to be
        intact). ``None`` when nothing was started for ``holder``."""
        with self._lock:
            job = self._pending.pop(holder, None)
        if job is None:
            return None
        deadline = time.monotonic() + timeout
        out: dict[int, Checked] = {}
        for part, f in job:
            try:
                ok = f.result(timeout=max(deadline - time.monotonic(), 0.0))
            except FutureTimeout:
                log.warning("checksums for %s took over %.1f s", holder, timeout)
                break
            out.update((s.lease_id, Checked(s.block_hash, good))
                       for s, good in zip(part, ok, strict=True))
        return out

    def forget(self, holder: str) -> None:
        """Drop ``holder``'s checksums unread (its reader gave up)."""
        with self._lock:
            job = self._pending.pop(holder, None)
        for _, f in job or []:
            f.cancel()

    def close(self) -> None:
        """Wait for running checksums (they read the slab) and stop the threads."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._pending.clear()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
