"""Host tier: one pre-allocated, pre-touched slab of fixed slots in POSIX shared memory.

The slab is a file in ``/dev/shm`` (or ``$KVSHARE_SHM_DIR``: :func:`shm_dir`) named
``kvshare-{namespace}-{node}-{generation}``, created with ``os.open`` + ``mmap`` (not ``multiprocessing.shared_memory``, whose resource tracker
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
SHM_DIR_ENV = "KVSHARE_SHM_DIR"
_PAGE = mmap.PAGESIZE
_CHUNK = 512 * 1024  # copy-and-hash step: stays in L2 (results page: best of 64 KiB..2 MiB)
_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


def shm_dir() -> str:
    """The directory of this node's host slabs and their epochs: ``$KVSHARE_SHM_DIR``, else
    ``/dev/shm``. Point it at a hugetlbfs mount (``mount -t hugetlbfs -o pagesize=2M none
    /mnt/huge`` with pages reserved in ``vm.nr_hugepages``) or a tmpfs mounted with
    ``huge=within_size`` to back slabs with 2 MiB pages. The pools read it (set it where Ray is
    started); a worker reading over shm maps the directory its pool names in its
    :class:`~kvshare.transfer.wire.SlabInfo`. Raises ValueError when it is not a writable
    directory."""
    path = os.environ.get(SHM_DIR_ENV) or SHM_DIR
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"{SHM_DIR_ENV}={path!r} is not a writable directory: point it at a tmpfs or "
            "hugetlbfs mount, or unset it for /dev/shm"
        )
    return path


def file_bytes(directory: str, size: int) -> int:
    """``size`` rounded up to the block size of ``directory``'s file system: hugetlbfs files
    must be whole huge pages long (its block size is the huge page size; tmpfs: 4 KiB)."""
    block = max(int(os.statvfs(directory).f_bsize), 1)
    return -(-size // block) * block


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
    for path in glob.glob(os.path.join(shm_dir(), "kvshare-*")):
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
    for path in glob.glob(os.path.join(shm_dir(), f"kvshare-{namespace}-{node}-*")):
        name = os.path.basename(path)
        if name == keep or not name.removeprefix(f"kvshare-{namespace}-{node}-").isdigit():
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(name)
    return removed


def shm_huge_pages() -> str:
    """How the slab directory (:func:`shm_dir`) hands out huge pages: ``hugetlbfs`` when it is
    a hugetlbfs mount (always huge), else its tmpfs ``huge=`` mount option (``never`` when not
    set), or the system-wide ``shmem_enabled`` when that is ``force`` or ``deny`` (they
    override every tmpfs mount). The slab asks for huge pages (``MADV_HUGEPAGE``), so
    ``advise``, ``within_size`` or ``always`` give them: a user enables them with
    ``mount -o remount,huge=within_size /dev/shm`` (or ``huge=advise``; in /etc/fstab to keep),
    or points ``KVSHARE_SHM_DIR`` at a hugetlbfs mount."""
    where = os.path.realpath(shm_dir())
    mount = _mount_of(where)
    if mount is not None and mount[0] == "hugetlbfs":
        return "hugetlbfs"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            text = f.read()
        system = text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        system = ""
    if system in ("force", "deny"):
        return system
    if mount is None or mount[0] != "tmpfs":
        return "unknown"
    opts = dict(o.partition("=")[::2] for o in mount[1].split(","))
    return opts.get("huge", "never")


def _mount_of(path: str) -> tuple[str, str] | None:
    """``(fs type, options)`` of the mount holding ``path`` (the longest mount point that is
    a prefix of it, per /proc/mounts), or None when unreadable."""
    best: tuple[int, str, str] | None = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 4:
                    continue
                point = fields[1]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) >= best[0]):
                    best = (len(point), fields[2], fields[3])
    except OSError:
        return None
    return None if best is None else (best[1], best[2])


def shm_free_bytes() -> int:
    """Free bytes in the slab directory (:func:`shm_dir`; containers often give /dev/shm
    only 64 MiB)."""
    st = os.statvfs(shm_dir())
    return st.f_bavail * st.f_frsize


class HostSlab(TierStore):
    """``num_slots`` slots of ``slot_bytes`` each in one shared mapping.

    Block copies in and out use :func:`~kvshare.tiers.base.copy_block`: streaming
    (non-temporal) stores where ``kvshare._native._copy`` is built, unless ``stream_copies=False``.
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
        directory: str = "",
    ) -> None:
        check_geometry("host slab", slot_bytes, num_slots)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.name = name
        self.path: str | None = None  # the slab's file (named slabs)
        self.stream_copies = stream_copies
        self._owner = create and name is not None
        self._lock_fd: int | None = None  # the owner's shared flock marks the slab as alive
        self._pinned_ptr = 0  # address registered with CUDA (cudaHostRegister)
        size = slot_bytes * num_slots
        if name is None:
            self._mm = mmap.mmap(-1, size)
        else:
            where = directory or shm_dir()
            path = self.path = os.path.join(where, name)
            mapped = file_bytes(where, size)
            if create:
                if mapped > shm_free_bytes():
                    raise MemoryError(
                        f"host slab of {size} bytes does not fit in {where} "
                        f"({shm_free_bytes()} bytes free): lower --host-gb or enlarge {where}"
                    )
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            else:
                fd = os.open(path, os.O_RDWR)
            try:
                if create:
                    os.ftruncate(fd, mapped)
                elif os.fstat(fd).st_size != mapped:
                    raise ValueError(
                        f"slab {name} is {os.fstat(fd).st_size} bytes, expected {mapped}: "
                        "the pool was restarted with another size; re-attach"
                    )
                self._mm = mmap.mmap(fd, mapped)
                if create:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                    self._lock_fd = fd
            finally:
                if self._lock_fd is None:
                    os.close(fd)
        self.array: ByteArray = np.frombuffer(self._mm, dtype=np.uint8, count=size).reshape(
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
    def attach(cls, name: str, slot_bytes: int, num_slots: int, directory: str = "") -> HostSlab:
        """Map an existing slab created by a pool on this node (read-write), from ``directory``
        (the pool's: :class:`~kvshare.transfer.wire.SlabInfo`) or else :func:`shm_dir`."""
        return cls(slot_bytes, num_slots, name, create=False, pin_cuda=False, directory=directory)

    def _pin_cuda(self) -> None:
        """Register the mapping with CUDA (page-locked: device copies from and into it are
        DMA). cudaHostRegister reports failure in its return value, not by raising."""
        try:
            import torch

            if torch.cuda.is_available():
                t = torch.from_numpy(self.array.reshape(-1))
                err = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                    t.data_ptr(), t.numel(), 0)
                if int(err) != 0:
                    log.warning("could not pin host slab with CUDA: cudaHostRegister error %s",
                                err)
                else:
                    self._pinned_ptr = t.data_ptr()
        except Exception as exc:  # pinning is an optimisation only
            log.warning("could not pin host slab with CUDA: %s", exc)

    def _unpin_cuda(self) -> None:
        """Undo :meth:`_pin_cuda` before unmapping: a range left registered stays locked and
        makes a later slab mapped at the same address fail to register."""
        if self._pinned_ptr:
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)  # type: ignore[no-untyped-call]
            except Exception as exc:
                log.warning("could not unpin host slab: %s", exc)
            self._pinned_ptr = 0

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

    @property
    def directory(self) -> str:
        """The folder of the slab's file ("" for an anonymous slab): where readers map it and
        its epochs from (``SlabInfo.directory``)."""
        return os.path.dirname(self.path) if self.path else ""

    def close(self) -> None:
        """Unmap (unregistering it from CUDA first); the owner also unlinks the segment."""
        self._unpin_cuda()
        self.array = np.empty((0, self.slot_bytes), dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._owner and self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
