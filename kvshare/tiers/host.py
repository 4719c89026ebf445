"""Host tier: one pre-allocated, pre-touched slab of fixed slots in POSIX shared memory.

The slab is a file in ``/dev/shm`` named ``kvshare-{namespace}-{node}-{generation}``, created
with ``os.open`` + ``mmap`` (not ``multiprocessing.shared_memory``, whose resource tracker
unlinks a segment when any attached process exits). Other processes on the node attach with
:meth:`HostSlab.attach` and read or write slots in place; the pool's slot epochs, not
checksums, guard those reads. With ``name=None`` the slab is anonymous (single process).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import mmap
import os
import re
import time

import numpy as np
import xxhash

from kvshare.tiers.base import ByteArray, TierStore, block_checksum, check_geometry, copy_block
from kvshare.types import BlockHash, Tier

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE
_CHUNK = 512 * 1024  # copy-and-hash step: stays in L2 (measured best of 64 KiB..2 MiB)
_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


def segment_name(namespace: str, node: str, generation: int) -> str:
    """The shared-memory segment name of one pool generation."""
    for what, value in (("namespace", namespace), ("node", node)):
        if not _SAFE.match(value):
            raise ValueError(f"{what} {value!r} may only hold letters, digits, '.', '_' and '-'")
    return f"kvshare-{namespace}-{node}-{generation}"


def remove_orphan_segments(min_age_s: float = 2.0) -> list[str]:
    """Unlink every ``kvshare-*`` segment whose owner is gone, with its ``.epochs`` companion.

    A live owner holds a shared ``flock`` on its segment for as long as it runs (the kernel
    drops it when the process dies, however it dies), so a segment on which an exclusive lock
    can be taken has no owner. Segments younger than ``min_age_s`` are left alone (their owner
    may be between creating and locking them).
    """
    removed: list[str] = []
    now = time.time()
    for path in glob.glob(os.path.join(SHM_DIR, "kvshare-*")):
        if path.endswith(".epochs"):
            if not os.path.exists(path.removesuffix(".epochs")) and _older(path, now, min_age_s):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    removed.append(os.path.basename(path))
            continue
        if not _older(path, now, min_age_s):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # an owner is alive
        finally:
            os.close(fd)
        for victim in (path, path + ".epochs"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(victim)
                removed.append(os.path.basename(victim))
    return removed


def _older(path: str, now: float, min_age_s: float) -> bool:
    try:
        return now - os.stat(path).st_mtime >= min_age_s
    except FileNotFoundError:
        return False


def remove_stale_segments(namespace: str, node: str, keep: str | None = None) -> list[str]:
    """Unlink this node's older slabs of ``namespace`` and every orphaned kvshare segment
    (a pool that died, or a cluster torn down without ``kvshare down``, left them)."""
    removed = remove_orphan_segments()
    for path in glob.glob(os.path.join(SHM_DIR, f"kvshare-{namespace}-{node}-*")):
        name = os.path.basename(path)
        if name == keep or not name.removeprefix(f"kvshare-{namespace}-{node}-").isdigit():
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(name)
    return removed


def shm_huge_pages() -> str:
    """How ``/dev/shm`` hands out transparent huge pages: its tmpfs ``huge=`` mount option
    (``never`` when not set), or the system-wide ``shmem_enabled`` when that is ``force`` or
    ``deny`` (they override every mount). The slab asks for huge pages (``MADV_HUGEPAGE``), so
    ``advise``, ``within_size`` or ``always`` give them: a user enables them with
    ``mount -o remount,huge=within_size /dev/shm`` (or ``huge=advise``; in /etc/fstab to keep)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
        system = text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        system = ""
    if system in ("force", "deny"):
        return system
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 4 and fields[1] == SHM_DIR:
                    opts = dict(o.partition("=")[::2] for o in fields[3].split(","))
                    return opts.get("huge", "never")
    except OSError:
        pass
    return "unknown"


def shm_free_bytes() -> int:
    """Free bytes in ``/dev/shm`` (containers often give it only 64 MiB)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


class HostSlab(TierStore):
    """``num_slots`` slots of ``slot_bytes`` each in one shared mapping.

    Block copies in and out use :func:`~kvshare.tiers.base.copy_block`: streaming
    (non-temporal) stores where ``kvshare._copy`` is built, unless ``stream_copies=False``.
    """

    tier = Tier.HOST

    def __init__(
        self,
        slot_bytes: int,
        num_slots: int,
        name: str | None = None,
        *,
        create: bool = True,
        pin_cuda: bool = True,
        stream_copies: bool = True,
    ) -> None:
        check_geometry("host slab", slot_bytes, num_slots)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.name = name
        self.stream_copies = stream_copies
        self._owner = create and name is not None
        self._lock_fd: int | None = None  # the owner's shared flock marks the slab as alive
        size = slot_bytes * num_slots
        if name is None:
            self._mm = mmap.mmap(-1, size)
        else:
            path = os.path.join(SHM_DIR, name)
            if create:
                if size > shm_free_bytes():
                    raise MemoryError(
                        f"host slab of {size} bytes does not fit in {SHM_DIR} "
                        f"({shm_free_bytes()} bytes free): lower --host-gb or enlarge /dev/shm"
                    )
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            else:
                fd = os.open(path, os.O_RDWR)
            try:
                if create:
                    os.ftruncate(fd, size)
                elif os.fstat(fd).st_size != size:
                    raise ValueError(
                        f"slab {name} is {os.fstat(fd).st_size} bytes, expected {size}: "
                        "the pool was restarted with another size; re-attach"
                    )
                self._mm = mmap.mmap(fd, size)
                if create:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    self._lock_fd = fd
            finally:
                if self._lock_fd is None:
                    os.close(fd)
        self.array: ByteArray = np.frombuffer(self._mm, dtype=np.uint8).reshape(
            num_slots, slot_bytes
        )
        if create:
            # Huge pages cut TLB misses on 2 MiB block copies and the page pinning of NIXL's
            # reads; /dev/shm gets them only where its mount allows (see shm_huge_pages).
            with contextlib.suppress(AttributeError, OSError):
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            self.array.reshape(-1)[::_PAGE] = 0  # pre-touch: page faults now, not per store
            if pin_cuda:
                self._pin_cuda()

    @classmethod
    def attach(cls, name: str, slot_bytes: int, num_slots: int) -> HostSlab:
        """Map an existing slab created by a pool on this node (read-write)."""
        return cls(slot_bytes, num_slots, name, create=False, pin_cuda=False)

    def _pin_cuda(self) -> None:
        try:
            import torch

            if torch.cuda.is_available():
                t = torch.from_numpy(self.array.reshape(-1))
                torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                    t.data_ptr(), t.numel(), 0)
        except Exception as exc:  # pinning is an optimisation only
            log.warning("could not pin host slab with CUDA: %s", exc)

    def huge_page_bytes(self) -> int:
        """Bytes of this process's slab mapping backed by 2 MiB pages (from /proc/self/smaps;
        0 where unknown). See :func:`shm_huge_pages` for what enables them."""
        if self.array.size == 0:
            return 0
        addr = int(self.array.ctypes.data)
        inside = False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split(maxsplit=1)[0]
                    if "-" in head and not head.endswith(":"):
                        lo, hi = (int(x, 16) for x in head.split("-"))
                        inside = lo <= addr < hi
                    elif inside and head in ("ShmemPmdMapped:", "FilePmdMapped:"):
                        kib = int(line.split()[1])
                        if kib:
                            return kib * 1024
        except (OSError, ValueError):
            pass
        return 0

    def view(self, slot: int) -> ByteArray:
        """The slot's bytes, writable, zero-copy."""
        self._check(slot)
        row: ByteArray = self.array[slot]
        return row

    def write(self, slot: int, data: ByteArray, block_hash: BlockHash, checksum: int) -> None:
        self._check(slot, data)
        copy_block(self.array[slot], data, self.stream_copies)

    def write_checksummed(self, slot: int, data: ByteArray, block_hash: BlockHash) -> int:
        """Copy in cache-sized chunks and hash each source chunk while it is still in cache.

        One pass over memory instead of two (hash the source, then copy it); the digest is
        the same as ``block_checksum(data)`` (xxh3-64 streaming == one-shot). The source, not
        the slot, is hashed: streaming stores leave the slot's lines out of the cache, while
        the copy has just loaded the source's.
        """
        self._check(slot, data)
        dest = self.array[slot]
        hasher = xxhash.xxh3_64()
        for start in range(0, self.slot_bytes, _CHUNK):
            part = data[start : start + _CHUNK]
            copy_block(dest[start : start + _CHUNK], part, self.stream_copies)
            hasher.update(part.data)
        return int(hasher.intdigest())

    def read_into(self, slot: int, out: ByteArray, block_hash: BlockHash, checksum: int) -> None:
        self._check(slot, out)
        copy_block(out, self.array[slot], self.stream_copies)

    def checksum(self, slot: int) -> int:
        return block_checksum(self.view(slot))

    def discard(self, slot: int) -> None:
        self._check(slot)

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment."""
        self.array = np.empty((0, self.slot_bytes), dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._owner and self.name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
