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
TCP its own sums).

The other way, :class:`LandingCheck`: the reader checksums each group of blocks the moment it
landed, in a native thread (``kvshare._native._hashq``, no GIL) while the next group copies, so the
check costs about one cache-warm hash of the last group and covers the wire and the reader's
memory too. ``NixlTransport(end_to_end=True)`` uses it where the extension is built
(``LANDING_CHECKS``); on a 2-core host the pool's check measured faster, so it stays the default.
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

from kvshare.tiers.base import ByteArray, block_checksum
from kvshare.tiers.host import HostSlab
from kvshare.types import BlockHash

log = logging.getLogger(__name__)


def _bind_native() -> bool:
    """Whether ``kvshare._native._hashq`` is built and computes the same xxh3-64 as block_checksum."""
    try:
        import xxhash._xxhash as lib

        from kvshare._native import _hashq
    except ImportError:
        return False
    probe = bytes(range(256)) * 1031
    return bool(_hashq.bind(lib.__file__ or "")) and _hashq.digest(probe) == block_checksum(probe)


LANDING_CHECKS: bool = _bind_native()
"""Whether :class:`LandingCheck` can hash in a native thread (the extension built and bound)."""

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


class LandingCheck:
    """Checksums buffers in a native thread as the caller reports them landed.

    :meth:`landed` queues a buffer (kept alive and unchanged by the caller until :meth:`sums`
    returned or :meth:`close`); :meth:`sums` waits for all of them. Needs ``LANDING_CHECKS``.
    """

    def __init__(self, capacity: int) -> None:
        from kvshare._native import _hashq

        self._queue: _hashq.HashQueue | None = _hashq.HashQueue(capacity)
        self._order: list[int] = []

    def landed(self, key: int, buf: ByteArray) -> None:
        """Queue ``buf`` (C-contiguous) under ``key``."""
        assert self._queue is not None, "LandingCheck used after close"
        self._queue.push(int(buf.ctypes.data), int(buf.nbytes))
        self._order.append(key)

    def sums(self, timeout: float) -> dict[int, int] | None:
        """key -> xxh3-64 of every landed buffer, or None if not done within ``timeout`` s.
        Closes the check either way."""
        got = self._queue.wait(timeout) if self._queue is not None else None
        self.close()
        return None if got is None else dict(zip(self._order, got, strict=True))

    def close(self) -> None:
        """Stop hashing (after the buffer in progress); no buffer is read afterwards."""
        queue, self._queue = self._queue, None
        if queue is not None:
            queue.close()
