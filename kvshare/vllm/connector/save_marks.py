"""Save marks: how the connector's worker side tells its scheduler side that saves are done.

Read-after-write (DESIGN.md) asks that a request's blocks be in its node's pool by the time its
answer ends. The saves run on the worker side (vLLM's worker process), the answer ends on the
scheduler side (the EngineCore process: ``request_finished`` runs in the step that finishes a
request, before that step's output leaves the engine). So instead of every step that saves
waiting for its stores (the first token of every prompt would wait for the prompt's store), a
finishing request waits for its own saves only, and only while they are still running: a
prompt's store has the whole decode to finish behind the engine's back. A request with stop
strings is the exception: vLLM's frontend, not the engine, finds those, so the engine never
sees such an answer end; its saves are waited for in the step that computed them (the
metadata's ``SaveSpec.sync``), as every save once was.

The channel is one small file in ``/dev/shm`` that both processes map (the worker may be the
same process, or a child of it: vLLM's uniproc or multiproc executor). It holds a ring of
``RING`` u32 slots: the scheduler side numbers every save it hands to the workers (``seq``,
increasing from 1), the worker side writes ``seq`` into slot ``seq % RING`` when that save has
ended (stored, failed or skipped), and a save is done when its slot holds ``seq`` or a later
number (a slot reused ``RING`` saves later). Slot 0 holds the attached worker's pid: the
scheduler side waits only when a worker has mapped the file (a worker on another host cannot,
and then nothing is waited for). Aligned u32 stores and loads are atomic on the CPUs vLLM runs
on; each slot has one writer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import tempfile
import threading
import time

import numpy as np

from kvshare.process import pid_alive

SYNC_SAVE_WAIT_S = 0.5
"""The longest an answer is held for its saves (``sync_save_mib``); a slower store (a busy
pool) goes on in the background, as a larger one does."""
RING = 16_384
"""Slots in the ring: saves in flight at once, far more than an engine's requests."""
_PID = 0
_PREFIX = "kvshare-saves-"



def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()



def sweep_stale(directory: str | None = None) -> int:
    """Remove the mark files of engines that are gone (their pid is in the name); returns how
    many were removed."""
    directory = directory or _directory()
    removed = 0
    for name in os.listdir(directory):
        m = re.fullmatch(rf"{_PREFIX}(\d+)-\w+", name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            removed += 1
    return removed


class _Mapped:
    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, RING * 4)
        finally:
            os.close(fd)
        self.path = path
        self.slots = np.frombuffer(self._map, dtype=np.uint32)

    def close(self) -> None:
        del self.slots
        with contextlib.suppress(BufferError):
            self._map.close()


class SaveMarks(_Mapped):
    """The scheduler side's end: numbers saves and waits for them (module docstring)."""

    @classmethod
    def create(cls) -> SaveMarks:
        """A new mark file for this engine (stale ones of dead engines are swept first)."""
        directory = _directory()
        with contextlib.suppress(OSError):
            sweep_stale(directory)
        fd, path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=directory)
        try:
            os.ftruncate(fd, RING * 4)
        finally:
            os.close(fd)
        return cls(path)

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._next = 0

    def next_seq(self) -> int:
        """The number of the next save handed to the workers (slot 0 is never used)."""
        self._next += 1
        if self._next % RING == _PID:
            self._next += 1
        return self._next

    @property
    def attached(self) -> bool:
        """Whether a worker has mapped the file (and so marks what it saves)."""
        return bool(self.slots[_PID])

    def done(self, seq: int) -> bool:
        return int(self.slots[seq % RING]) >= (seq & 0xFFFF_FFFF)

    def wait(self, seqs: list[int], timeout_s: float) -> bool:
        """Wait until every save in ``seqs`` is done, at most ``timeout_s``; whether they are.
        Nothing is waited for while no worker is attached."""
        if not self.attached:
            return True
        deadline = time.perf_counter() + timeout_s
        pause = 0.0002
        for seq in seqs:
            while not self.done(seq):
                if time.perf_counter() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 0.002)
        return True

    def close(self) -> None:
        """Unmap and remove the file (the engine is shutting down)."""
        super().close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class SaveMarker(_Mapped):
    """The worker side's end: marks saves done (thread-safe: store threads call it)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._lock = threading.Lock()
        self.slots[_PID] = os.getpid()

    def mark(self, seq: int) -> None:
        if seq <= 0:
            return
        with self._lock:
            self.slots[seq % RING] = seq & 0xFFFF_FFFF
