"""Registered inference workers under leases that their load reports renew.

Plain class, no Ray. The index owns one; a worker whose reports stop for ``ttl_s`` is expired
(the index then drops its ``worker:<id>`` entries).

A lease does not run out while the index itself was not listening: workers report every
<= 100 ms, so a gap of more than half a lease between two calls into the registry means the
index was not running (its process starved of CPU on a loaded host, a long GC, a big call ahead
in its queue) or nobody called it, not that every worker stopped at once. The reports queued
behind such a gap are about to renew their leases, so every lease still running when the gap
began runs until at least half a lease after it ends, instead of all expiring on the first call
after it.
A worker that did die is expired ``ttl_s`` after its last report while the index hears others,
and at most ``ttl_s / 2`` after the first call that ends a silence.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvshare.actors.index.engine_value import EngineCacheLedger
from kvshare.types import NodeId, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad


class WorkerRegistry:
    """``worker_id -> (WorkerInfo, latest WorkerLoad, lease deadline)``."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError("worker lease ttl must be positive")
        self.ttl_s = ttl_s
        self._clock = clock
        self._info: dict[WorkerId, WorkerInfo] = {}
        self._load: dict[WorkerId, WorkerLoad] = {}
        self._deadline: dict[WorkerId, float] = {}
        self._next = float("inf")
        self._heard = clock()  # the last call into the registry (:meth:`_listen`)
        self.stalls = 0  # gaps the leases were extended over
        self.longest_stall_s = 0.0
        self.expired = 0  # workers expired (their reports stopped)
        self.engine_value = EngineCacheLedger(clock=clock)  # what their own caches served

    def _listen(self) -> float:
        """The time now, after giving every lease still running when a silence began at least
        half a lease past its end (module docstring)."""
        now = self._clock()
        began, self._heard = self._heard, now
        if now - began > self.ttl_s / 2 and self._deadline:
            self.stalls += 1
            self.longest_stall_s = max(self.longest_stall_s, now - began)
            until = now + self.ttl_s / 2
            self._deadline = {w: max(d, until) if d > began else d
                              for w, d in self._deadline.items()}
            self._next = min(self._deadline.values())
        return now

    @staticmethod
    def check(info: WorkerInfo) -> None:
        """ValueError naming the bad field of a registration."""
        if not isinstance(info, WorkerInfo):
            raise ValueError(f"register_worker needs a WorkerInfo, got {type(info).__name__}")
        if not isinstance(info.worker_id, str) or not info.worker_id or ":" in info.worker_id:
            raise ValueError(f"worker_id {info.worker_id!r} must be a non-empty string without ':'")
        if not isinstance(info.node, str) or not info.node:
            raise ValueError("WorkerInfo.node must be the worker's Ray node id")
        if not info.namespaces or not all(isinstance(n, str) for n in info.namespaces):
            raise ValueError("WorkerInfo.namespaces must name at least one namespace")
        if not isinstance(info.tp, int) or info.tp < 1:
            raise ValueError(f"WorkerInfo.tp must be a positive int, got {info.tp!r}")

    def register(self, info: WorkerInfo) -> None:
        self.check(info)
        wid = info.worker_id
        self._info[wid] = info
        self._load.setdefault(wid, WorkerLoad(wid))
        self._renew(wid)

    def report(self, load: WorkerLoad) -> bool:
        """Record a load report and renew the lease; False if the worker is not registered."""
        if not isinstance(load, WorkerLoad):
            raise ValueError(f"report_load needs a WorkerLoad, got {type(load).__name__}")
        if load.worker_id not in self._info:
            return False
        self._load[load.worker_id] = load
        self.engine_value.report(self._info[load.worker_id], load)
        self._renew(load.worker_id)
        return True

    def _renew(self, wid: WorkerId) -> None:
        deadline = self._listen() + self.ttl_s
        self._deadline[wid] = deadline
        self._next = min(self._next, deadline)

    def expire(self) -> list[WorkerId]:
        """Remove workers whose lease ended; returns their ids."""
        now = self._listen()
        if now < self._next:
            return []
        gone = [w for w, d in self._deadline.items() if d <= now]
        for w in gone:
            self.remove(w)
        self.expired += len(gone)
        self._next = min(self._deadline.values(), default=float("inf"))
        return gone

    def remove(self, wid: WorkerId) -> bool:
        self._load.pop(wid, None)
        self.engine_value.forget(wid)
        self._deadline.pop(wid, None)
        return self._info.pop(wid, None) is not None

    def on_node(self, node: NodeId | str) -> list[WorkerId]:
        return [w for w, info in self._info.items() if info.node == node]

    def __contains__(self, wid: object) -> bool:
        return wid in self._info

    def workers(self) -> list[WorkerInfo]:
        return list(self._info.values())

    def loads(self) -> dict[WorkerId, WorkerLoad]:
        return dict(self._load)
