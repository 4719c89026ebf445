"""The transport boundary: move a batch of blocks between a pool and memory, with per-block results.

A :class:`Transport` moves block payloads between a block source (a node pool, reached through
a :class:`~kvshare.transfer.wire.BlockControl`) and caller memory. Contract shared by every
implementation (``shm``, ``nixl``, ``objstore``; checked by one conformance suite):

- ``submit_read`` / ``submit_write`` start one batch and return a :class:`Transfer` at once
  or after control messages bounded by the deadline; they never raise for I/O faults.
- ``poll`` returns ``None`` while the batch is in flight and its :class:`TransferResult` once
  done; ``wait`` polls until done. A transfer is always done by its deadline (plus the time
  of one control message that cancels it): nothing hangs.
- A result holds one :class:`BlockResult` per requested hash, in request order. ``ok=True``
  means the destination holds exactly the stored bytes (verified by checksum for remote reads,
  by the slot epoch for shared memory). Otherwise the destination bytes of that block are
  undefined and ``reason`` is one of the constants below: the caller recomputes.
- Every lease a transfer takes on the source (pins, reservations) has ended, or its release
  has been sent, when the transfer is done, whatever happened (and every lease expires shortly
  after the deadline anyway); a write is committed only for blocks that arrived whole.
"""

from __future__ import annotations

import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from kvshare.tiers.base import ByteArray
from kvshare.transfer.wire import BlockControl, Reply, SourceGone
from kvshare.types import BlockHash

log = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_GRACE_S = 2.0  # a reader that dies mid-transfer holds its pins this long past the deadline
FINISH_WAIT_S = 2.0

# Why a block is a miss. Stable strings: they appear in metrics and logs.
MISSING = "missing"  # the source does not hold the block
CORRUPT = "corrupt"  # bytes failed their checksum (source slab, disk file or the wire)
DEADLINE = "deadline"  # the batch did not finish before its deadline
HOLDER_DEAD = "source_dead"  # the source pool (or its node) died or is unreachable
NIXL_UNAVAILABLE = "nixl_unavailable"  # NIXL is not installed or failed to initialise
SLOT_REUSED = "slot_reused"  # the slot epoch changed during a shared-memory copy
NOT_SAME_NODE = "not_same_node"  # shared memory asked for a pool on another node
NO_SPACE = "no_space"  # a write found no free slot
IN_FLIGHT = "in_flight"  # a write found another writer's reservation
TRANSFER_ERROR = "transfer_error"  # the transport reported an error it could not classify

REASONS = frozenset(
    {MISSING, CORRUPT, DEADLINE, HOLDER_DEAD, NIXL_UNAVAILABLE, SLOT_REUSED, NOT_SAME_NODE,
     NO_SPACE, IN_FLIGHT, TRANSFER_ERROR}
)


class BlockResult(NamedTuple):
    """One block of a transfer: ``ok`` or a miss with a ``reason`` (one of the constants)."""

    block_hash: BlockHash
    ok: bool
    reason: str = ""


class BlockOutcomes:
    """What a batch's per-block results (``outcomes``, in request order) say: whether all
    arrived, how many, the leading run that did, and why the others missed. Mixed into the
    results that carry ``outcomes`` (:class:`TransferResult`, ``fetch.FetchResult``)."""

    outcomes: tuple[BlockResult, ...]

    @property
    def ok(self) -> bool:
        """True when every block arrived."""
        return all(o.ok for o in self.outcomes)

    @property
    def num_ok(self) -> int:
        return sum(1 for o in self.outcomes if o.ok)

    @property
    def prefix_ok(self) -> int:
        """How many leading blocks arrived (what a prefix-loading engine can use)."""
        n = 0
        for o in self.outcomes:
            if not o.ok:
                break
            n += 1
        return n

    def misses(self) -> dict[BlockHash, str]:
        """Hash -> reason of every block that did not arrive."""
        return {o.block_hash: o.reason for o in self.outcomes if not o.ok}

    def reasons(self) -> dict[str, int]:
        """How many blocks missed for each reason."""
        return miss_reasons(self.outcomes)


@dataclass(frozen=True)
class TransferResult(BlockOutcomes):
    """Outcome of one batch: per-block outcomes in request order, bytes moved, wall time."""

    transport: str
    op: str
    outcomes: tuple[BlockResult, ...]
    nbytes: int = 0
    seconds: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


def miss_reasons(outcomes: Sequence[BlockResult]) -> dict[str, int]:
    """How many of ``outcomes`` missed for each reason."""
    out: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            out[o.reason] = out.get(o.reason, 0) + 1
    return out


def all_missed(
    transport: str, op: str, hashes: Sequence[BlockHash], reason: str, seconds: float = 0.0
) -> TransferResult:
    """A result in which every block missed for ``reason``."""
    return TransferResult(
        transport, op, tuple(BlockResult(h, False, reason) for h in hashes), 0, seconds
    )


_ids = itertools.count(1)


@dataclass
class Transfer:
    """One submitted batch. Transports keep their own state in ``state``; callers only poll."""

    transport: str
    op: str
    hashes: tuple[BlockHash, ...]
    deadline: float  # time.monotonic() by which the batch must be done
    holder: str  # lease holder on the source, unique to this transfer
    started: float = field(default_factory=time.monotonic)
    transfer_id: int = field(default_factory=lambda: next(_ids))
    result: TransferResult | None = None
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def finish_reasons(self, reasons: Sequence[str], bufs: Sequence[ByteArray]) -> TransferResult:
        """:meth:`finish` with one reason per block (``""`` = it arrived), counting the bytes
        of the buffers whose block did."""
        outs = [BlockResult(h, r == "", r) for h, r in zip(self.hashes, reasons, strict=True)]
        return self.finish(outs, sum(b.nbytes for b, o in zip(bufs, outs, strict=True) if o.ok))

    def finish(self, outcomes: Sequence[BlockResult], nbytes: int) -> TransferResult:
        """Record the result (once) and return it."""
        if self.result is None:
            assert len(outcomes) == len(self.hashes)
            self.result = TransferResult(
                self.transport, self.op, tuple(outcomes), nbytes, time.monotonic() - self.started
            )
        return self.result


def check_batch(hashes: Sequence[BlockHash], buffers: Sequence[ByteArray], block_bytes: int) -> None:
    """Caller mistakes raise ValueError naming the fix; nothing is moved."""
    if len(hashes) != len(buffers):
        raise ValueError(
            f"got {len(hashes)} hashes but {len(buffers)} buffers: pass one buffer per block"
        )
    if len(set(hashes)) != len(hashes):
        raise ValueError("a batch lists the same block hash twice: de-duplicate the batch")
    for b in buffers:
        if b.dtype.itemsize * b.size != block_bytes or not b.flags.c_contiguous:
            raise ValueError(
                f"each buffer must be a contiguous {block_bytes}-byte block, got "
                f"{b.size * b.dtype.itemsize} bytes: check the KV layout of the namespace"
            )


def lease_ttl(deadline_s: float) -> float:
    """TTL of the leases a transfer takes: its deadline plus a grace period."""
    return max(deadline_s, 0.0) + LEASE_GRACE_S


def call(reply: Reply[T], timeout: float) -> T:
    """Await a control reply for at most ``timeout`` s (TimeoutError / SourceGone)."""
    if timeout <= 0 and not reply.done():
        raise TimeoutError("deadline passed before the control reply arrived")
    return reply.get(max(timeout, 0.0))


def finish_quietly(control: BlockControl, holder: str, lease_ids: Sequence[int]) -> list[bool]:
    """End ``holder``'s leases; a dead source has nothing left to release (returns [])."""
    try:
        return call(control.finish(holder, lease_ids), FINISH_WAIT_S)
    except (TimeoutError, SourceGone) as exc:
        log.debug("finish(%s): %s", holder, exc)
        return []


class Closeable(Protocol):
    def close(self) -> None: ...


class ClosingGroup(Protocol):
    """A mapping of open things (``dict[str, HostSlab]`` and the like)."""

    def values(self) -> Iterable[Closeable]: ...

    def clear(self) -> None: ...


def close_all(*groups: ClosingGroup) -> None:
    """Close every value of each mapping in turn and empty it (a cache of open slabs, agents)."""
    for group in groups:
        for item in group.values():
            item.close()
        group.clear()


def holder_name(prefix: str, transfer_id: int) -> str:
    """Lease holder of one transfer: ``{prefix}#t{id}`` (releasing it ends all its leases)."""
    return f"{prefix}#t{transfer_id}"


class Transport(ABC):
    """Moves batches of blocks between a block source and caller memory (see module doc)."""

    name: str

    @abstractmethod
    def submit_read(
        self, source: Any, hashes: Sequence[BlockHash], dest: Sequence[ByteArray],
        *, deadline_s: float,
    ) -> Transfer:
        """Start copying the blocks ``hashes`` from ``source`` into ``dest`` (one per block)."""

    @abstractmethod
    def submit_write(
        self, sink: Any, hashes: Sequence[BlockHash], data: Sequence[ByteArray],
        *, deadline_s: float,
    ) -> Transfer:
        """Start storing ``data`` (one payload per block) as ``hashes`` in ``sink``."""

    @abstractmethod
    def poll(self, transfer: Transfer) -> TransferResult | None:
        """The result once the batch is done (leases ended), else None. Never blocks long."""

    def new_transfer(
        self, op: str, hashes: Sequence[BlockHash], bufs: Sequence[ByteArray], deadline_s: float,
        holder_prefix: str,
    ) -> Transfer:
        """A fresh transfer of ``hashes`` (one buffer each in ``bufs``, checked: ValueError
        naming the fix) due in ``deadline_s``, leased as ``{prefix}#t{id}``."""
        if hashes:
            check_batch(hashes, bufs, bufs[0].nbytes)
        t = Transfer(self.name, op, tuple(hashes), time.monotonic() + deadline_s, "")
        t.holder = holder_name(holder_prefix, t.transfer_id)
        return t

    def wait(self, transfer: Transfer) -> TransferResult:
        """Poll until done; bounded by the transfer's deadline. Counted in :attr:`counters`."""
        while True:
            res = self.poll(transfer)
            if res is not None:
                self.record(res)
                return res
            time.sleep(0 if transfer.remaining > 0.002 else 0.0002)

    @property
    def counters(self) -> dict[str, float]:
        """Batches, blocks, bytes, seconds and misses per reason of the batches waited for."""
        c: dict[str, float] | None = self.__dict__.get("_counters")
        if c is None:
            c = self.__dict__["_counters"] = {}
        return c

    def record(self, res: TransferResult) -> None:
        """Add a finished batch to :attr:`counters` (``wait`` does this; pollers may call it)."""
        c = self.counters
        for key, value in (("batches", 1), ("blocks", len(res.outcomes)),
                           ("blocks_ok", res.num_ok), ("bytes", res.nbytes),
                           ("seconds", res.seconds)):
            c[key] = c.get(key, 0) + value
        for reason, n in res.reasons().items():
            c[f"miss_{reason}"] = c.get(f"miss_{reason}", 0) + n

    def read(
        self, source: Any, hashes: Sequence[BlockHash], dest: Sequence[ByteArray],
        *, deadline_s: float = 10.0,
    ) -> TransferResult:
        """``submit_read`` + ``wait``."""
        return self.wait(self.submit_read(source, hashes, dest, deadline_s=deadline_s))

    def write(
        self, sink: Any, hashes: Sequence[BlockHash], data: Sequence[ByteArray],
        *, deadline_s: float = 10.0,
    ) -> TransferResult:
        """``submit_write`` + ``wait``."""
        return self.wait(self.submit_write(sink, hashes, data, deadline_s=deadline_s))

    def close(self) -> None:
        """Release agents, mappings and registrations."""


class TransportUnavailable(RuntimeError):
    """A transport cannot run in this process (e.g. NIXL missing); ``reason`` says which."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
