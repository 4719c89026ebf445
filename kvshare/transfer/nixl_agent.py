"""Starting NIXL agents (UCX backend) and the source side that exposes a host slab.

NIXL is optional: :func:`make_agent` raises :class:`TransportUnavailable` with reason
``nixl_unavailable`` when the package is missing or the agent cannot start (for instance
``UCX_TLS`` without ``tcp``), so callers fall back to the object store.

Measured on 2-core CPU hosts (ENVIRONMENT.md): agents run without NIXL's progress thread (it
busy-polls a core); the reading side drives progress by polling ``check_xfer_state``, and the
passive source side runs a light pump thread (``get_new_notifs`` every few ms) so that UCX can
accept connections from new readers.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Any

import numpy as np

from kvshare.tiers.host import HostSlab
from kvshare.transfer.base import NIXL_UNAVAILABLE, TransportUnavailable
from kvshare.transfer.wire import NixlPeerInfo

log = logging.getLogger(__name__)

PUMP_PERIOD_S = 0.002
_LIVE: weakref.WeakSet[NixlSource] = weakref.WeakSet()


@atexit.register
def _stop_pumps() -> None:
    """Stop pump threads before the interpreter (and NIXL's C++ objects) go away."""
    for src in list(_LIVE):
        src.stop_pump()


def make_agent(name: str) -> Any:
    """A NIXL agent named ``name`` with the UCX backend and no progress thread."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
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
        self._lock = threading.Lock()
        self._pump = threading.Thread(target=self._run_pump, name=f"nixl-pump-{name}", daemon=True)
        self._pump.start()
        _LIVE.add(self)

    def info(self, generation: int) -> NixlPeerInfo:
        return NixlPeerInfo(
            self.name, self._metadata, self.base_addr, self.slab.slot_bytes, self.slab.num_slots,
            generation,
        )

    def _run_pump(self) -> None:
        while not self._stop.wait(PUMP_PERIOD_S):
            with self._lock:
                try:
                    self.agent.get_new_notifs()
                except Exception as exc:  # keep pumping; a broken agent shows up in readers
                    log.debug("nixl pump: %s", exc)

    def stop_pump(self) -> None:
        self._stop.set()
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
