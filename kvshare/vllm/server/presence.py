"""A vLLM worker's registration with the index, under the lease its load reports renew.

:class:`Presence` registers :class:`~kvshare.workers.WorkerInfo` and, every
``interval_s`` (<= 100 ms), reports :class:`~kvshare.workers.WorkerLoad` from ``load_fn`` (e.g.
:meth:`kvshare.vllm.server.load.MetricsLoad.load` reading vLLM's ``/metrics``). When ``load_fn``
returns None (the engine does not answer) the lease is renewed with the last load only while
``alive_fn`` says the engine's process lives and for at most ``silent_grace_s`` since its last
answer: an engine busy with a long step on a loaded host answers ``/metrics`` late, and
dropping it from the index would throw its cache entries away. A dead engine is unregistered
at once (its entries go with it; it registers again if its process lives again); a live one
silent past the grace is not renewed, so its entries expire with its lease. When the index answers
that it does not know the worker (lease lost, index restarted) the presence registers again:
a new generation, which drops the old incarnation's entries at once; the events consumer sees
the new :attr:`generation` and republishes its inventory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvshare.types import Location, WorkerId, worker_location
from kvshare.workers import WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)


class IndexSink(Protocol):
    """What a vLLM worker needs from the index (``kvshare.actors.index.client.IndexClient`` has it)."""

    def register_worker(self, info: WorkerInfo) -> int: ...

    def report_load(self, load: WorkerLoad) -> bool: ...

    def unregister_worker(self, worker_id: WorkerId | str) -> int: ...

    def publish(self, batch: Any) -> Any:
        """Apply one Arrow event batch; the reply's ``resync`` asks for the inventory."""
        ...

    def replace_inventory(self, location: str, generation: int, batch: Any, seq: int,
                          namespace: str | None = None) -> bool: ...


class Presence:
    """Registration + lease renewal of one worker (thread-safe)."""

    def __init__(self, info: WorkerInfo, index: IndexSink,
                 load_fn: Callable[[], WorkerLoad | None] | None = None,
                 interval_s: float = 0.1, alive_fn: Callable[[], bool] | None = None,
                 silent_grace_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        if not 0 < interval_s <= 0.1:
            raise ValueError("interval_s must be in (0, 0.1] s: the worker lease renews on it")
        if silent_grace_s < 0:
            raise ValueError(f"silent_grace_s must be >= 0, got {silent_grace_s}")
        self.info = info
        self.alive_fn = alive_fn
        self.silent_grace_s = silent_grace_s
        self._clock = clock
        self._answered_at = -float("inf")
        self.index = index
        self.load_fn = load_fn or (lambda: WorkerLoad(info.worker_id))
        self.interval_s = interval_s
        self._gen = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters = dict.fromkeys(
            ("registrations", "reports", "report_errors", "engine_silent", "silent_renewals",
             "engine_dead"), 0)
        self.last_load: WorkerLoad | None = None

    @property
    def worker_id(self) -> WorkerId:
        return self.info.worker_id

    @property
    def location(self) -> Location:
        return worker_location(self.info.worker_id)

    @property
    def generation(self) -> int:
        """The generation events must carry now (0 until registered)."""
        return self._gen

    def new_incarnation(self) -> int:
        """Register again: a new generation; the index drops every older entry now."""
        with self._lock:
            self._gen = int(self.index.register_worker(self.info))
            self.counters["registrations"] += 1
            return self._gen

    def start(self) -> Presence:
        """Register and report the first load now (so a caller that returns after this finds
        the worker listed with a load, i.e. routable), then renew on a thread. An index that
        does not answer yet does not fail the start: the thread keeps trying."""
        self._tick_once()
        self._thread = threading.Thread(target=self._run, name="kvshare-vllm-lease", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._tick_once()

    def _tick_once(self) -> None:
        try:
            self.tick()
        except Exception as exc:  # index unreachable: keep trying, never stop serving
            self.counters["report_errors"] += 1
            log.debug("load report of %s failed: %s", self.worker_id, exc)

    def tick(self) -> None:
        """Register if needed, then report one load (renewing the lease): the engine's, or while
        it is silent but alive within the grace its last one. A dead engine is unregistered."""
        if self.alive_fn is not None and not self.alive_fn():
            self._dead()
            return
        if self._gen == 0:
            self.new_incarnation()
        load = self.load_fn()
        if load is None:
            self.counters["engine_silent"] += 1
            load = self._silent_load()
            if load is None:
                return
            self.counters["silent_renewals"] += 1
        else:
            self._answered_at = self._clock()
            self.last_load = load
        self.counters["reports"] += 1
        if not self.index.report_load(load):
            log.info("index forgot worker %s (lease lost or index restarted): registering again",
                     self.worker_id)
            self.new_incarnation()

    def _dead(self) -> None:
        """The engine's process is gone: unregister now rather than at the lease's end."""
        with self._lock:
            if self._gen == 0:
                return
            self._gen = 0
            self.counters["engine_dead"] += 1
        log.warning("engine of %s is dead: unregistering it", self.worker_id)
        self.index.unregister_worker(self.worker_id)

    def _silent_load(self) -> WorkerLoad | None:
        """The last load, to renew the lease with while the engine is silent but alive and
        within the grace; None: let the lease lapse."""
        if self.alive_fn is None or self.last_load is None:
            return None
        if self._clock() - self._answered_at > self.silent_grace_s:
            return None
        return self.last_load

    def stop(self, unregister: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if unregister and self._gen:
            try:
                self.index.unregister_worker(self.worker_id)
            except Exception as exc:
                log.debug("unregister of %s failed: %s", self.worker_id, exc)
