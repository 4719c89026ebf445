"""Disk tier: one file per slot under a directory, each with a self-describing header.

File ``{dir}/slot-{slot:08d}.blk`` = header || payload. The header names the block hash, the
layout fingerprint, the payload length and its xxh3-64 checksum, and carries its own checksum.
A block is written to ``.tmp`` and renamed into place, so a crash mid-write leaves at most a
``.tmp`` file, which recovery deletes; a file whose header or payload fails verification is
deleted and counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct

import numpy as np
import xxhash

from kvshare.tiers.base import ByteArray, CorruptBlock, TierStore, block_checksum, check_geometry
from kvshare.types import BlockHash, Tier

log = logging.getLogger(__name__)

_MAGIC = b"KVSB0001"
# magic, hash length, hash (padded to 32), layout fingerprint (16 ascii), payload length,
# payload checksum, header checksum (over everything before it)
_HEAD = struct.Struct("<8sI32s16sQQ")
_HEAD_CK = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _HEAD_CK.size


class DiskStore(TierStore):
    """Slot files under ``directory`` for blocks of one layout."""

    tier = Tier.DISK

    def __init__(
        self, directory: str, slot_bytes: int, num_slots: int, layout_fingerprint: str,
        *, fsync: bool = False,
    ) -> None:
        check_geometry("disk store", slot_bytes, num_slots)
        self.directory = directory
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.fingerprint = layout_fingerprint.encode("ascii")[:16].ljust(16, b"\0")
        self.fsync = fsync
        self.discarded = 0
        os.makedirs(directory, exist_ok=True)

    def _path(self, slot: int) -> str:
        return os.path.join(self.directory, f"slot-{slot:08d}.blk")

    def _header(self, block_hash: BlockHash, checksum: int) -> bytes:
        head = _HEAD.pack(
            _MAGIC, len(block_hash), bytes(block_hash).ljust(32, b"\0"), self.fingerprint,
            self.slot_bytes, checksum,
        )
        return head + _HEAD_CK.pack(xxhash.xxh3_64_intdigest(head))

    def write(self, slot: int, data: ByteArray, block_hash: BlockHash, checksum: int) -> None:
        self._check(slot, data)
        path = self._path(slot)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        try:
            os.write(fd, self._header(block_hash, checksum))
            view = data.data.cast("B")
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _read_header(self, fd: int) -> tuple[BlockHash, int]:
        raw = os.read(fd, HEADER_BYTES)
        if len(raw) != HEADER_BYTES:
            raise CorruptBlock("short header")
        head, (head_ck,) = raw[: _HEAD.size], _HEAD_CK.unpack(raw[_HEAD.size :])
        if xxhash.xxh3_64_intdigest(head) != head_ck:
            raise CorruptBlock("header checksum mismatch")
        magic, hlen, hpad, fp, length, checksum = _HEAD.unpack(head)
        if magic != _MAGIC or hlen > 32:
            raise CorruptBlock("bad magic")
        if fp != self.fingerprint or length != self.slot_bytes:
            raise CorruptBlock("block written for another layout")
        return BlockHash(hpad[:hlen]), checksum

    def read_into(self, slot: int, out: ByteArray, block_hash: BlockHash, checksum: int) -> None:
        """Read and verify: header, hash (unless ``block_hash`` is empty), payload checksum."""
        self._check(slot, out)
        try:
            fd = os.open(self._path(slot), os.O_RDONLY)
        except FileNotFoundError as exc:
            raise CorruptBlock(f"slot file {self._path(slot)} is missing") from exc
        try:
            stored_hash, stored_ck = self._read_header(fd)
            if block_hash and stored_hash != block_hash:
                raise CorruptBlock("slot holds another block")
            with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                n = f.readinto(out.data.cast("B"))
            if n != self.slot_bytes:
                raise CorruptBlock(f"payload is {n} bytes, expected {self.slot_bytes}")
        finally:
            os.close(fd)
        if block_checksum(out) != stored_ck or (checksum >= 0 and stored_ck != checksum):
            raise CorruptBlock("payload checksum mismatch")

    def checksum(self, slot: int) -> int:
        fd = os.open(self._path(slot), os.O_RDONLY)
        try:
            return self._read_header(fd)[1]
        finally:
            os.close(fd)

    def discard(self, slot: int) -> None:
        self._check(slot)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(slot))

    def recover(self) -> list[tuple[int, BlockHash, int]]:
        """Verify every slot file; delete torn and corrupt ones (counted in ``discarded``)."""
        found: list[tuple[int, BlockHash, int]] = []
        buf = np.empty(self.slot_bytes, dtype=np.uint8)
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            slot = _slot_of(name)
            if slot is None or slot >= self.num_slots:
                if name.endswith(".tmp") or slot is not None:
                    os.unlink(path)
                    self.discarded += 1
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    block_hash, checksum = self._read_header(fd)
                finally:
                    os.close(fd)
                self.read_into(slot, buf, block_hash, checksum)
            except (CorruptBlock, OSError) as exc:
                log.warning("discarding disk block %s: %s", path, exc)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self.discarded += 1
                continue
            found.append((slot, block_hash, checksum))
        return found


def _slot_of(name: str) -> int | None:
    if name.startswith("slot-") and name.endswith(".blk"):
        digits = name[5:-4]
        if digits.isdigit():
            return int(digits)
    return None
