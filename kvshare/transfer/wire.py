"""The control interface between a reader's transport and the pool that holds the blocks.

Defined once, here: :class:`BlockControl` (what a transport asks of the pool), the messages
it carries and :class:`Reply` (every call returns one, so transports bound control messages by
their deadline too; the reader's helpers :func:`~kvshare.transfer.base.call`,
:func:`~kvshare.transfer.base.finish_quietly` and :func:`~kvshare.transfer.base.lease_ttl`
await them). Bytes never travel in these messages except for the object-store path
(``BlockBatch``); the others carry slot numbers, epochs, checksums, lease ids and addresses.

The pool's side implements it in :class:`~kvshare.transfer.holder.server.BlockServer`; the reader's
side reaches a BlockServer through :class:`~kvshare.transfer.reader.control.LocalControl`
(in-process) or :class:`~kvshare.transfer.reader.control.ActorControl` (a NodePoolActor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from kvshare.tiers.base import ByteArray
from kvshare.types import BlockHash

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

PRESENT = "present"
"""A write's answer for a block the pool already holds (counts as stored)."""



class SourceGone(Exception):
    """The pool behind a control handle died or cannot be reached."""


@dataclass(frozen=True)
class SlabInfo:
    """Where a pool's host slab lives, for processes on the same node to map it."""

    name: str
    slot_bytes: int
    num_slots: int
    generation: int
    node: str
    epochs: str = ""  # shared-memory slot epochs (kvshare.transfer.epochs); "" = ask the pool
    # the directory of both files (the pool's KVSHARE_SHM_DIR, kvshare.tiers.host.shm_dir), so a
    # reader maps them whatever its own environment says; "" = the reader's shm_dir()
    directory: str = ""


@dataclass(frozen=True)
class NixlPeerInfo:
    """A pool's NIXL agent: name, metadata (for ``add_remote_agent``) and its slab address."""

    agent: str
    metadata: bytes
    base_addr: int
    slot_bytes: int
    num_slots: int
    generation: int


@dataclass(frozen=True)
class SourceBlock:
    """One pinned block at the source: its host slot, the slot epoch and its checksum."""

    lease_id: int
    slot: int
    epoch: int
    checksum: int


@dataclass(frozen=True)
class SlotReply:
    """The pool's per-hash answer about its slab slots, in request order: a
    :class:`SourceBlock` or a reason per hash.

    - ``prepare_read``: pinned blocks (or a miss reason);
    - ``prepare_write``: reserved slots, ``checksum`` -1 (:data:`PRESENT`: the pool already
      holds the block, which counts as stored);
    - ``push_read``: the blocks NIXL-written into the reader's memory (checksum to verify),
      already unpinned; no ``slab``.

    ``slab``/``nixl_agent``/``nixl_error``: where the prepared slots are and the pool's NIXL
    agent (``""``: none working).
    """

    generation: int
    blocks: tuple[SourceBlock | str, ...]
    slab: SlabInfo | None = None
    nixl_agent: str = ""
    nixl_error: str = ""


@dataclass(frozen=True)
class BlockBatch:
    """Blocks copied out by the source for the object-store path.

    ``data`` is ``[n, block_bytes]`` uint8 holding the found blocks in request order;
    ``rows[i]`` is the row of request ``i`` or -1 (then ``reasons[i]`` says why).
    """

    data: ByteArray
    rows: tuple[int, ...]
    checksums: tuple[int, ...]
    reasons: tuple[str, ...]

    @staticmethod
    def empty(n: int, reason: str, block_bytes: int) -> BlockBatch:
        return BlockBatch(
            np.empty((0, block_bytes), np.uint8), (-1,) * n, (0,) * n, (reason,) * n
        )


@dataclass(frozen=True)
class PushRequest:
    """Where the pool WRITEs (``nixl_push``): the reader's agent, its metadata, one address
    per hash, and the time the pool has left."""

    agent: str
    metadata: bytes
    dest_addrs: tuple[int, ...]
    block_bytes: int
    deadline_s: float


class Reply(Protocol[T_co]):
    """A control call in flight (or done)."""

    def done(self) -> bool: ...

    def get(self, timeout: float) -> T_co:
        """The reply; TimeoutError after ``timeout`` s, SourceGone if the pool is dead."""
        ...


class Ready(Generic[T]):
    """A reply that is already there (in-process control), or, with ``error``, a call that
    failed before it was sent (``get`` raises it)."""

    def __init__(self, value: T, error: Exception | None = None) -> None:
        self._value = value
        self._error = error

    def done(self) -> bool:
        return True

    def get(self, timeout: float) -> T:
        if self._error is not None:
            raise self._error
        return self._value


class BlockControl(Protocol):
    """What transports ask of the pool that holds (or receives) the blocks.

    Leases are taken under ``holder``; ``finish`` ends every lease of ``holder`` and reports,
    for the given read leases, whether each was still valid (lease alive, slot epoch unchanged),
    which is the shared-memory reader's epoch re-check. ``prepare_read(verify=True)`` also has
    the pool checksum the pinned slots while the reader moves them; ``finish`` then counts a
    slot that failed as invalid (the NIXL reader's integrity check, :mod:`kvshare.transfer.verify`).
    ``nixl=True`` on a prepare says the reader moves the bytes over NIXL itself: the pool then
    progresses its agent continuously until ``finish`` (or the lease's end), which UCX over TCP
    needs to move at link speed (:mod:`kvshare.transfer.nixl_agent`).
    """

    def slab_info(self) -> Reply[SlabInfo | None]: ...

    def nixl_info(self) -> Reply[NixlPeerInfo | None]: ...

    def prepare_read(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, verify: bool = False,
        nixl: bool = False,
    ) -> Reply[SlotReply]: ...

    def finish(self, holder: str, lease_ids: Sequence[int]) -> Reply[list[bool]]: ...

    def read_blocks(self, hashes: Sequence[BlockHash]) -> Reply[BlockBatch]: ...

    def prepare_write(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, nixl: bool = False
    ) -> Reply[SlotReply]: ...

    def commit_write(
        self, holder: str, lease_ids: Sequence[int], checksums: Sequence[int]
    ) -> Reply[list[BlockHash]]: ...

    def write_blocks(
        self, hashes: Sequence[BlockHash], data: ByteArray, checksums: Sequence[int]
    ) -> Reply[list[str]]: ...

    def report_corrupt(self, hashes: Sequence[BlockHash]) -> Reply[int]: ...

    def touch(self, hashes: Sequence[BlockHash]) -> Reply[int]:
        """Blocks read from the host slab with no pin (epochs checked by the reader): hits."""
        ...

    def probe_blocks(self, n: int) -> Reply[list[BlockHash]]:
        """Hashes of ``n`` probe blocks the pool holds (seeded on first request)."""
        ...

    def push_read(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, request: PushRequest
    ) -> Reply[SlotReply]:
        """Pin ``hashes``, NIXL-WRITE them into the reader's addresses, end the pins."""
        ...
