"""Starting NIXL agents (UCX backend) and the pool's side: the agent that exposes a host slab.

:class:`NixlSource` lets remote agents READ the slab (``nixl``) and WRITEs slots into a
reader's registered memory on request (``nixl_push``, :meth:`NixlSource.write_slots`).

NIXL is optional: :func:`make_agent` raises :class:`TransportUnavailable` with reason
``nixl_unavailable`` when the package is missing or the agent cannot start (for instance
``UCX_TLS`` without ``tcp``), so callers fall back to the object store.

Measured on 2-core CPU hosts (ENVIRONMENT.md): agents run without NIXL's progress thread (it
busy-polls a core); the reading side drives progress by polling ``check_xfer_state``. The
passive source side runs a pump thread that progresses its agent (``get_new_notifs``): every
:data:`PUMP_PERIOD_S` while idle (so UCX accepts connections from new readers), and
continuously while a transfer it serves is in flight (:class:`ServingWindows`: from a reader's
``prepare`` to its ``finish``, never past the lease's deadline). Over UCX TCP (hosts without
RDMA) the source's worker must answer every GET itself, so a source that progresses once per
period moves one socket buffer per period: 0.14-0.21 GB/s polled every 1 ms against
0.69-0.87 GB/s polled continuously, between two emulated hosts. Over ``cma`` (one host) and
RDMA the READ is one-sided and the pump does not matter. ``KVSHARE_NIXL_BUSY_POLL=0`` keeps
the pump periodic (a host that cannot spare the core while it serves).

UCX settings: :func:`make_agent` fills in :data:`UCX_DEFAULTS` (TCP tunables only; a variable
already in the environment wins) before the first agent of a process starts.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvshare.tiers.host import HostSlab
from kvshare.transfer.base import (
    DEADLINE,
    HOLDER_DEAD,
    NIXL_UNAVAILABLE,
    TRANSFER_ERROR,
    TransportUnavailable,
)
from kvshare.transfer.wire import NixlPeerInfo, PushRequest

log = logging.getLogger(__name__)

PUMP_PERIOD_S = 0.002
"""How often an idle source progresses its agent (seconds)."""
UCX_DEFAULTS: dict[str, str] = {
    "UCX_TCP_TX_SEG_SIZE": "1m",
    "UCX_TCP_RX_SEG_SIZE": "1m",
}
"""UCX variables :func:`make_agent` sets unless the environment has them. Over TCP a READ is
served by the source in active messages of ``TX_SEG_SIZE`` (UCX's default 8 KiB: ~2,000
messages, each copied and sent by the source's progress loop, per 16 MiB block); 1 MiB
segments cut that 128-fold (the receiver's ``RX_SEG_SIZE`` must hold a whole segment). They
only size the TCP transport's buffers: ``cma``, shared memory and RDMA are untouched. Figures
on the results page (``benchmarks/transfer.py --hosts``)."""
_LIVE: weakref.WeakSet[NixlSource] = weakref.WeakSet()


@atexit.register
def _stop_pumps() -> None:
    """Stop pump threads before the interpreter (and NIXL's C++ objects) go away."""
    for src in list(_LIVE):
        src.stop_pump()


def make_agent(name: str) -> Any:
    """A NIXL agent named ``name`` with the UCX backend and no progress thread."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as exc:  # ImportError, or a broken install failing to load its library
        raise TransportUnavailable(NIXL_UNAVAILABLE, f"nixl is not importable ({exc})") from exc
    try:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    except Exception as exc:
        raise TransportUnavailable(
            NIXL_UNAVAILABLE, f"NIXL agent {name!r} failed to start ({exc}); check UCX_TLS"
        ) from exc
    if "UCX" not in agent.backends:
        raise TransportUnavailable(NIXL_UNAVAILABLE, "NIXL has no UCX backend plugin")
    return agent


def dram_reg(array: np.ndarray) -> list[tuple[int, int, int, str]]:
    """Registration descriptor of one contiguous host buffer."""
    return [(int(array.ctypes.data), int(array.nbytes), 0, "")]


def xfer_descs(addrs: Sequence[int], size: int) -> np.ndarray:
    """NIXL DRAM descriptors ``[addr, size, device 0]`` for ``addrs``."""
    n = len(addrs)
    out = np.zeros((n, 3), dtype=np.uint64)
    out[:, 0] = np.asarray(addrs, dtype=np.uint64)
    out[:, 1] = size
    return out


def failure_reason(what: str) -> str:
    """The miss reason of a failed NIXL transfer: the peer is gone, or another error."""
    return HOLDER_DEAD if "DISCONNECT" in what.upper() else TRANSFER_ERROR


class ServingWindows:
    """Transfers a source serves now: ``open(key, until)`` at a reader's prepare, ``close(key)``
    at its finish; ``busy(now)`` while any is open and before its ``until`` (monotonic seconds).

    A reader that dies without finishing keeps a window only until its deadline, so the pump
    never polls continuously for longer than the longest lease it granted. Thread-safe.
    """

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def open(self, key: str, until: float) -> None:
        with self._lock:
            self._until[key] = max(until, self._until.get(key, until))

    def close(self, key: str) -> None:
        with self._lock:
            self._until.pop(key, None)

    def busy(self, now: float) -> bool:
        """Whether a window is open at ``now`` (expired windows are dropped)."""
        with self._lock:
            for key in [k for k, until in self._until.items() if until <= now]:
                del self._until[key]
            return bool(self._until)


class NixlSource:
    """A NIXL agent that registers one host slab once and lets remote agents READ/WRITE it."""

    def __init__(self, name: str, slab: HostSlab) -> None:
        self.name = name
        self.slab = slab
        self.agent = make_agent(name)
        flat = slab.array.reshape(-1)
        self.base_addr = int(flat.ctypes.data)
        try:
            self._reg = self.agent.register_memory(dram_reg(flat), "DRAM")
        except Exception as exc:
            raise TransportUnavailable(NIXL_UNAVAILABLE, f"slab registration failed ({exc})") from exc
        self._metadata: bytes = self.agent.get_agent_metadata()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when a window opens, and to stop
        self.windows = ServingWindows()
        self.busy_poll = os.environ.get("KVSHARE_NIXL_BUSY_POLL", "1") != "0"
        self._lock = threading.Lock()
        self._pump = threading.Thread(target=self._run_pump, name=f"nixl-pump-{name}", daemon=True)
        self._pump.start()
        self._remotes: dict[str, tuple[bytes, str]] = {}  # reader agent -> (metadata, name)
        _LIVE.add(self)

    def info(self, generation: int) -> NixlPeerInfo:
        return NixlPeerInfo(
            self.name, self._metadata, self.base_addr, self.slab.slot_bytes, self.slab.num_slots,
            generation,
        )

    def serving(self, holder: str, ttl_s: float) -> None:
        """A reader (``holder``) is about to move bytes from or to the slab: progress the agent
        continuously until :meth:`served` or for ``ttl_s`` seconds, whichever comes first."""
        if self.busy_poll:
            self.windows.open(holder, time.monotonic() + ttl_s)
            self._wake.set()

    def served(self, holder: str) -> None:
        self.windows.close(holder)

    def _run_pump(self) -> None:
        while not self._stop.is_set():
            if not self.windows.busy(time.monotonic()):
                self._wake.wait(PUMP_PERIOD_S)
                self._wake.clear()
                if self._stop.is_set():
                    break
            with self._lock:
                try:
                    self.agent.get_new_notifs()
                except Exception as exc:  # keep pumping; a broken agent shows up in readers
                    log.debug("nixl pump: %s", exc)
            time.sleep(0)  # busy: still let the actor's threads (a reader's finish) in

    def _remote(self, agent: str, metadata: bytes) -> str:
        """This agent's name for reader ``agent`` (re-added when its metadata changed)."""
        cached = self._remotes.get(agent)
        if cached is not None and cached[0] == metadata:
            return cached[1]
        if cached is not None:  # the reader registered more memory: refresh its metadata
            try:
                self.agent.remove_remote_agent(cached[1])
            except Exception as exc:
                log.debug("remove_remote_agent(%s): %s", cached[1], exc)
            self._remotes.pop(agent)
        raw = self.agent.add_remote_agent(metadata)
        remote = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._remotes[agent] = (metadata, remote)
        return remote

    def write_slots(self, slots: Sequence[int], addrs: Sequence[int], req: PushRequest,
                    start: float) -> str:
        """Post one WRITE of slab ``slots`` to the reader's ``addrs``, poll it until done or
        ``req.deadline_s`` after ``start`` (monotonic; then it is cancelled); '' when done,
        else the miss reason."""
        size = req.block_bytes
        deadline = start + req.deadline_s
        with self._lock:  # the pump thread shares the agent
            handle = None
            try:
                remote = self._remote(req.agent, req.metadata)
                handle = self.agent.initialize_xfer(
                    "WRITE",
                    self.agent.get_xfer_descs(xfer_descs([self.base_addr + s * size for s in slots], size), "DRAM"),
                    self.agent.get_xfer_descs(xfer_descs(list(addrs), size), "DRAM"),
                    remote,
                )
                status = self.agent.transfer(handle)
                while status == "PROC" and time.monotonic() < deadline:
                    status = self.agent.check_xfer_state(handle)
                if status == "PROC" or time.monotonic() > deadline:
                    return DEADLINE
                if status != "DONE":
                    log.warning("nixl push to %s: %s", req.agent, status)
                    return failure_reason(str(status))
                return ""
            except Exception as exc:
                log.warning("nixl push to %s failed: %s", req.agent, exc)
                return failure_reason(str(exc))
            finally:
                if handle is not None:
                    try:
                        self.agent.release_xfer_handle(handle)  # cancels a WRITE still in flight
                    except Exception as exc:
                        log.warning("nixl push handle could not be released: %s", exc)

    def stop_pump(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._pump is not threading.current_thread():
            self._pump.join(timeout=1.0)

    def close(self) -> None:
        """Stop the pump and deregister the slab (before the slab is unmapped)."""
        self.stop_pump()
        with self._lock:
            try:
                self.agent.deregister_memory(self._reg)
            except Exception as exc:
                log.debug("nixl deregister: %s", exc)
