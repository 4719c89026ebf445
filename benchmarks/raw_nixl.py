"""Raw NIXL baseline for ``benchmarks/transfer.py``: one READ of the same bytes from the same
kind of memory, between two plain processes, with nothing of kvshare around it.

The source process maps a file in ``/dev/shm`` (tmpfs, like a pool's host slab: ``os.open`` +
``mmap``, ``MADV_HUGEPAGE`` where the kernel honours it, pre-touched), fills it with random
bytes, registers it once with a NIXL agent (UCX backend, no progress thread, as kvshare's
agents) and pumps notifications. The reader process registers a 2 MiB-aligned, pre-touched
destination once and times READs of all blocks (one transfer with one descriptor per block,
polled with ``check_xfer_state``): no leases, no control messages, no checksums. The figure is
the median of ``repeats`` timed transfers after one warm-up.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

MiB = 2**20


def _agent(name: str) -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _source(conn: Connection, total: int, path: str) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping keeps the pages; nothing is left behind in /dev/shm
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    slab = np.frombuffer(mm, dtype=np.uint8)
    slab[:] = np.frombuffer(np.random.default_rng(2).bytes(total), dtype=np.uint8)
    agent = _agent("raw-source")
    reg = agent.register_memory([(int(slab.ctypes.data), total, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), int(slab.ctypes.data)))
    while not conn.poll(0.002):  # a light pump, as kvshare's NixlSource runs
        agent.get_new_notifs()
    conn.recv()
    agent.deregister_memory(reg)
    del slab
    conn.send("closed")


def _reader(conn: Connection, total: int, block_bytes: int, repeats: int) -> None:
    from kvshare.transfer.reader.nixl import aligned_empty

    metadata, base = conn.recv()
    dest = aligned_empty(total)
    dest.fill(1)  # pre-touched
    agent = _agent("raw-reader")
    reg = agent.register_memory([(int(dest.ctypes.data), total, 0, "")], "DRAM")
    peer = agent.add_remote_agent(metadata)
    n = total // block_bytes
    local = np.zeros((n, 3), dtype=np.uint64)
    remote = np.zeros((n, 3), dtype=np.uint64)
    local[:, 0] = int(dest.ctypes.data) + np.arange(n, dtype=np.uint64) * block_bytes
    remote[:, 0] = base + np.arange(n, dtype=np.uint64) * block_bytes
    local[:, 1] = remote[:, 1] = block_bytes
    ldesc, rdesc = agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM")
    warm = False
    while conn.recv() == "read":
        times = []
        for _ in range(repeats + (0 if warm else 1)):
            t = time.perf_counter()
            handle = agent.initialize_xfer("READ", ldesc, rdesc, peer)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            times.append(time.perf_counter() - t)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL READ failed: {state}")
        conn.send(total / statistics.median(times if warm else times[1:]) / 1e9)
        warm = True
    agent.remove_remote_agent(peer)
    agent.deregister_memory(reg)
    conn.send("closed")


class RawNixl:
    """The two processes (see the module docstring), kept alive so that a benchmark can
    interleave raw reads with its own; ``env`` is set in both (e.g. ``UCX_TLS``)."""

    def __init__(self, total: int, block_bytes: int, repeats: int = 5,
                 env: dict[str, str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        self._src, src_conn = ctx.Pipe()
        self._rd, rd_conn = ctx.Pipe()
        path = f"/dev/shm/kvshare-rawnixl-{os.getpid()}-{time.monotonic_ns()}"
        self._procs = [
            ctx.Process(target=_source, args=(src_conn, total, path), daemon=True),
            ctx.Process(target=_reader, args=(rd_conn, total, block_bytes, repeats), daemon=True),
        ]
        try:
            for p in self._procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if not self._src.poll(120):
            self.close()
            raise TimeoutError("raw NIXL source did not start in 120 s")
        self._rd.send(self._src.recv())

    def read_gbps(self) -> float:
        """Median GB/s of ``repeats`` READs of all blocks (the first call warms up first)."""
        self._rd.send("read")
        if not self._rd.poll(300):
            raise TimeoutError("raw NIXL reader did not answer in 300 s")
        gbps: float = self._rd.recv()
        return gbps

    def close(self) -> None:
        for conn in (self._rd, self._src):
            try:
                conn.send("stop")
                conn.poll(10)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
