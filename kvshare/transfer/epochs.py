"""Slot epochs in shared memory: the shared-memory reader's check after a copy, without a message.

The pool bumps a slot's epoch whenever the slot is given to another block (and when it is
freed). A reader pinned ``(slot, epoch)``; after copying the slot it reads the epoch from
``{shm_dir}/{slab}.epochs`` (beside the slab) and keeps the copy only if the epoch is unchanged. Epochs only grow
(no ABA). Ordering: the pool bumps the epoch before a writer may touch the slot, and the reader
loads the epoch after its copy; on x86 (TSO) a reader that saw any new bytes therefore sees
the new epoch.

Liveness: the creator holds an exclusive ``flock`` on the file for as long as it lives (the
kernel drops it when the process dies, however it dies), so a reader learns whether the pool
behind a mapping is still there with one non-blocking ``flock`` (:meth:`owner_alive`): what a
read that asks the pool nothing (known slots) checks, so a dead pool's blocks are misses.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import mmap
import os

import numpy as np
import numpy.typing as npt

from kvshare.tiers.host import file_bytes, shm_dir

SUFFIX = ".epochs"


def epochs_name(slab_name: str) -> str:
    return slab_name + SUFFIX


class SharedEpochs:
    """``num_slots`` int64 epochs in ``{directory or shm_dir()}/{name}``; the creator owns (and
    unlinks) it."""

    def __init__(self, name: str, num_slots: int, *, create: bool, directory: str = "") -> None:
        self.name = name
        self._owner = create
        where = directory or shm_dir()
        self.path = os.path.join(where, name)
        size = 8 * num_slots
        mapped = file_bytes(where, size)  # hugetlbfs: whole huge pages
        fd = os.open(self.path, (os.O_CREAT | os.O_TRUNC | os.O_RDWR) if create else os.O_RDONLY,
                     0o600)
        try:
            if create:
                os.ftruncate(fd, mapped)
            elif os.fstat(fd).st_size != mapped:
                raise ValueError(f"epochs segment {name} has another size: the pool restarted")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if create else 0)
            self._mm = mmap.mmap(fd, mapped, prot=prot)
            if create:  # held while this process lives (best effort: tmpfs and hugetlbfs lock)
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # the creator's lock, or the reader's handle to test it
        self.array: npt.NDArray[np.int64] = np.frombuffer(self._mm, dtype=np.int64, count=num_slots)

    def owner_alive(self) -> bool:
        """Whether the process that created the file still holds it (module docstring)."""
        if self._owner:
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # the creator's exclusive lock stands
        except OSError:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    @staticmethod
    def remove_stale(slab_name: str, directory: str = "") -> None:
        """Unlink epochs segments of older generations of the same namespace and node in
        ``directory`` (default ``shm_dir()``)."""
        prefix = slab_name.rsplit("-", 1)[0] + "-"
        where = directory or shm_dir()
        for path in glob.glob(os.path.join(where, f"{glob.escape(prefix)}*{SUFFIX}")):
            gen = os.path.basename(path)[len(prefix) : -len(SUFFIX)]
            if gen.isdigit() and os.path.basename(path) != epochs_name(slab_name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.int64)
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
