"""Reading a plan's blocks from the pools that hold them, for one worker.

One batch per (holder, transport), all in flight at once; a holder whose NIXL agent is out
is asked again over the object store (it always works). Per block the answer is ``""`` or a
miss reason; a holder that died is looked up again on the next load. Every batch is timed
into the worker's :class:`~kvshare.transfer.estimate.BandwidthEstimator` and counted.

A holder on another node none of whose blocks in a batch arrived because it was unreachable or
too slow (``source_dead``, ``deadline``: its host cut off, its node dead) is *backed off* for
:data:`BACKOFF_S`: meanwhile :meth:`BlockFetcher.reachable` says no, plans leave it out
(``KVShareClient`` plans around it) and a batch for it misses at once instead of waiting out
the deadline again. A holder that was only slow is asked again when the back-off ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from kvshare.client.types import TRANSPORT_NIXL, TRANSPORT_SHM, Plan
from kvshare.transfer.base import DEADLINE, HOLDER_DEAD, NIXL_UNAVAILABLE, Transfer, Transport
from kvshare.transfer.estimate import BandwidthEstimator
from kvshare.transfer.reader.objstore import ObjStoreTransport
from kvshare.transfer.reader.shm import KnownSlots, ShmTransport, SlotCopy
from kvshare.transfer.wire import BlockControl

log = logging.getLogger(__name__)

Count = Callable[[str, float], None]
"""``(counter, amount)``: the worker's counters."""
BACKOFF_S = 10.0
"""Seconds a remote holder that could not be reached (or not within the deadline) is left out
of plans and loads."""
UNREACHABLE = frozenset({HOLDER_DEAD, DEADLINE})


def start_nixl(namespace: str, worker_id: str) -> tuple[Transport | None, str]:
    """The worker's NIXL reader, or None and why not (remote blocks then use the object store)."""
    try:
        from kvshare.transfer.reader.nixl import NixlTransport

        return NixlTransport(f"{namespace}/worker/{worker_id}/{time.time_ns()}"), ""
    except Exception as exc:  # TransportUnavailable, missing package: objstore instead
        log.warning("NIXL unavailable for %s, remote blocks use the object store: %s",
                    worker_id, exc)
        return None, str(exc)


def in_plan_order(copy: SlotCopy, idx: list[int]) -> SlotCopy:
    """``copy`` for a batch holding the plan's blocks ``idx`` (batch positions -> plan blocks)."""

    def run(rows: np.ndarray, positions: list[int], slots: list[int]) -> None:
        copy(rows, [idx[p] for p in positions], slots)

    return run


class BlockFetcher:
    """The worker's readers (``shm``, ``nixl`` when up, ``objstore``) and the pools' controls.

    ``control_for(node_id)``: that node's pool control (None: it has none).
    """

    def __init__(self, *, node: str, worker_id: str, control_for: Callable[[str], BlockControl | None],
                 nixl: Transport | None, estimator: BandwidthEstimator, count: Count,
                 deadline_s: float, known: KnownSlots | None = None) -> None:
        self.control_for = control_for
        self.shm = ShmTransport(node, holder=f"{worker_id}-load", known=known)
        self.objstore = ObjStoreTransport(holder=f"{worker_id}-obj")
        self.nixl = nixl
        self.estimator = estimator
        self.deadline_s = deadline_s
        self._count = count
        self._controls: dict[str, BlockControl] = {}
        self._backoff: dict[str, float] = {}  # location -> time.monotonic() it ends

    def reachable(self, location: str) -> bool:
        """False while ``location`` (``node:<id>``) is backed off (module docstring)."""
        until = self._backoff.get(location)
        return until is None or time.monotonic() >= until

    def _back_off(self, location: str) -> None:
        self._backoff[location] = time.monotonic() + BACKOFF_S
        self._count("holders_backed_off", 1)
        log.warning("kvshare: holder %s unreachable, left out of loads for %.0f s", location,
                    BACKOFF_S)

    def control(self, node_id: str) -> BlockControl | None:
        """The node's pool control (cached); None (not cached) when it cannot be found."""
        control = self._controls.get(node_id)
        if control is None:
            try:
                control = self.control_for(node_id)
            except Exception as exc:  # its pool died with its node: a miss, not an error
                log.info("no pool control for node %s: %s", node_id, exc)
                control = None
            if control is not None:
                self._controls[node_id] = control
        return control

    def transport(self, name: str) -> Transport:
        if name == TRANSPORT_SHM:
            return self.shm
        if name == TRANSPORT_NIXL and self.nixl is not None:
            return self.nixl
        return self.objstore

    def fetch(self, plan: Plan, staging: np.ndarray, spent: dict[str, float],
              direct: SlotCopy | None = None) -> list[str]:
        """Read the plan's blocks into ``staging`` (or, with ``direct``, straight into the
        target); per block ``""`` or a miss reason. ``spent`` gets each transport's seconds
        from the first submit to its last batch's end."""
        t_start = time.perf_counter()
        groups: dict[tuple[str, str], list[int]] = {}
        for i, b in enumerate(plan.blocks):
            groups.setdefault((b.location, b.transport), []).append(i)
        reasons = [""] * plan.load_blocks
        running: list[tuple[Transport, Transfer, list[int], str, float, str]] = []
        retry: list[tuple[str, list[int]]] = []
        for (loc, transport), idx in groups.items():
            node = loc.removeprefix("node:")
            control = self.control(node) if self.reachable(loc) else None
            if control is None:
                for i in idx:
                    reasons[i] = HOLDER_DEAD
                continue
            tr = self.transport(transport)
            hs = [plan.blocks[i].block_hash for i in idx]
            t0 = time.perf_counter()
            bufs = [staging[i] for i in idx]
            if direct is not None and tr is self.shm:
                t = self.shm.submit_read(control, hs, bufs, deadline_s=self.deadline_s,
                                         copy=in_plan_order(direct, idx))
            else:
                t = tr.submit_read(control, hs, bufs, deadline_s=self.deadline_s)
            running.append((tr, t, idx, tr.name, t0, loc))
        for tr, t, idx, used, t0, loc in running:  # each batch's own peer for the estimator
            res = tr.wait(t)
            spent[used] = time.perf_counter() - t_start
            self._timed(used, t0)
            self.estimator.observe(used, loc, res.nbytes, res.seconds)
            for i, o in zip(idx, res.outcomes, strict=True):
                reasons[i] = "" if o.ok else o.reason
            if tr is self.nixl and all(reasons[i] == NIXL_UNAVAILABLE for i in idx):
                retry.append((plan.blocks[idx[0]].location, idx))
            if all(reasons[i] == HOLDER_DEAD for i in idx):  # look the pool up again next time
                self._controls.pop(plan.blocks[idx[0]].location.removeprefix("node:"), None)
            if tr is not self.shm and all(reasons[i] in UNREACHABLE for i in idx):
                self._back_off(loc)
        for loc, idx in retry:  # the holder has no NIXL agent: the object store always works
            control = self.control(loc.removeprefix("node:"))
            if control is None:
                continue
            hs = [plan.blocks[i].block_hash for i in idx]
            t0 = time.perf_counter()
            res = self.objstore.read(control, hs, [staging[i] for i in idx],
                                     deadline_s=self.deadline_s)
            spent[self.objstore.name] = time.perf_counter() - t_start
            self._timed(self.objstore.name, t0)
            self.estimator.observe(self.objstore.name, loc, res.nbytes, res.seconds)
            for i, o in zip(idx, res.outcomes, strict=True):
                reasons[i] = "" if o.ok else o.reason
        return reasons

    def _timed(self, transport: str, t0: float) -> None:
        """One batch read of ``transport`` finished: count it and its submit-to-done time."""
        self._count(f"transfers_{transport}", 1)
        self._count(f"transfer_seconds_{transport}", time.perf_counter() - t0)

    def close(self) -> None:
        """Close the readers (the NIXL one is its owner's to close)."""
        self.shm.close()
