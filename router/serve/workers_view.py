"""The Serve router's workers view: its replicas as the routing core's workers, with their
registrations and load reports from the worker registry.

:class:`ReplicaWorkers` is to :class:`~kvshare.router.serve.request_router.KVShareRequestRouter`
what :class:`~kvshare.router.core.workers_view.IndexWorkers` is to the asyncio gateway, with
what Serve needs besides:

- the worker each replica serves (:meth:`ReplicaWorkers.worker_of`: the one its routing stats
  name, else its own :func:`~kvshare.router.serve.request.replica_worker_id`);
- registrations read in a request's path only while a replica's worker is unknown, else in
  the background (:meth:`ReplicaWorkers.refresh`), so a decision waits on no registry call;
- load reports by a request's deadline, or followed in the background (:meth:`ReplicaWorkers.loads`);
- the workers and loads of the replicas Serve offers for one request
  (:meth:`ReplicaWorkers.infos`, :meth:`ReplicaWorkers.with_queue_lengths`: a replica's running
  count at least the queue length Serve probed).

Kept apart from the router's module, which Serve pickles by value into each handle's process.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping
from dataclasses import replace
from typing import Any

from ray.exceptions import RayError
from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router.common import ReplicaQueueLengthCache
from ray.serve._private.request_router.replica_wrapper import RunningReplica

from kvshare.router.core.workers_view import WorkerRegistry
from kvshare.router.serve.request import FRONTS_WORKER, ServeRouterSettings, replica_worker_id
from kvshare.types import NodeId, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad

log = logging.getLogger("ray.serve")


class ReplicaWorkers:
    """Serve's replicas as workers, their registrations and load reports (module docstring).

    ``registry``: where registrations and reports are read (None until the router connects);
    ``on_read``: called with every registration list read (the router learns the workers'
    hashing from it)."""

    def __init__(self, settings: ServeRouterSettings,
                 on_read: Callable[[list[WorkerInfo]], None]) -> None:
        self.settings = settings
        self.registry: WorkerRegistry | None = None
        self._on_read = on_read
        self.registered: dict[WorkerId, WorkerInfo] = {}
        self._workers_at = -1e9
        self.workers_task: asyncio.Task[None] | None = None
        self.reported: dict[WorkerId, WorkerLoad] = {}
        self.loads_at = -1e9
        self._loads_task: asyncio.Task[None] | None = None
        self._fronted: dict[ReplicaID, WorkerId] = {}

    # ------------------------------------------------------------------ replicas -> workers
    def worker_of(self, replica: RunningReplica) -> WorkerId:
        """The kvshare worker a replica serves: the one it names in its routing stats
        (:data:`~kvshare.router.serve.request.FRONTS_WORKER`, e.g. a replica in front of a vLLM server
        registered by ``kvshare vllm start``), else its own :func:`replica_worker_id`."""
        named = (getattr(replica, "routing_stats", None) or {}).get(FRONTS_WORKER)
        wid = WorkerId(named) if isinstance(named, str) and named else replica_worker_id(
            replica.replica_id)
        self._fronted[replica.replica_id] = wid
        return wid

    def worker_of_id(self, replica_id: ReplicaID) -> WorkerId:
        """:meth:`worker_of` a replica known by its id (its own id's worker if never seen)."""
        return self._fronted.get(replica_id) or replica_worker_id(replica_id)

    def namespaces(self, replica_ids: Iterable[ReplicaID]) -> set[str]:
        """The namespaces the replicas' workers registered."""
        return {ns for r in replica_ids
                if (w := self.registered.get(self.worker_of_id(r))) is not None
                for ns in w.namespaces}

    def infos(self, by_worker: Mapping[WorkerId, RunningReplica], namespace: str
              ) -> list[WorkerInfo]:
        """The workers of the replicas offered, in their order: as registered, else a
        worker on the replica's node serving ``namespace``."""
        return [self.registered.get(w) or WorkerInfo(w, NodeId(r.node_id), (namespace,))
                for w, r in by_worker.items()]

    @staticmethod
    def with_queue_lengths(by_worker: Mapping[WorkerId, RunningReplica],
                           reported: Mapping[WorkerId, WorkerLoad],
                           queue_lens: ReplicaQueueLengthCache) -> dict[WorkerId, WorkerLoad]:
        """The reports, with each replica's running count at least the queue length Serve
        last probed (``queue_lens``: Serve's own, fresher view of what runs there)."""
        loads = dict(reported)
        for wid, replica in by_worker.items():
            queue_len = queue_lens.get(replica.replica_id) or 0
            report = loads.get(wid)
            if queue_len and (report is None or report.running < queue_len):
                loads[wid] = (replace(report, running=queue_len) if report is not None
                              else WorkerLoad(wid, 0, queue_len))
        return loads

    # ------------------------------------------------------------------ replica set changes
    def replicas_changed(self) -> None:
        """Serve's replica set changed: re-read the registrations on the next request."""
        self._workers_at = -1e9

    def died(self, replica_id: ReplicaID) -> WorkerId:
        """A replica died: forget its worker's registration; returns that worker."""
        wid = self.worker_of_id(replica_id)
        self.registered.pop(wid, None)
        return wid

    # ------------------------------------------------------------------ registrations
    async def refresh(self, replica_ids: Collection[ReplicaID]) -> None:
        """The workers' registrations. Read in a request's path only while a replica's worker
        is unknown (at most every 0.25 s); once every replica's is known, re-read in the
        background every ``workers_refresh_s``, so a decision waits on no registry call."""
        now = time.monotonic()
        age = now - self._workers_at
        if all(self.worker_of_id(r) in self.registered for r in replica_ids):
            if age >= self.settings.workers_refresh_s and self.workers_task is None:
                self._workers_at = now  # a failed read is retried a period later
                self.workers_task = self._in_background(
                    self._read_workers(), "workers_task", "worker registrations")
            return
        if age >= 0.25:
            await self._read_workers()

    async def _read_workers(self) -> None:
        assert self.registry is not None  # (refreshed once the router connected)
        infos = await self.registry.workers_async()
        self.registered = {w.worker_id: w for w in infos}
        self._workers_at = time.monotonic()
        self._on_read(infos)

    def _in_background(self, read: Coroutine[Any, Any, None], slot: str, what: str
                       ) -> asyncio.Task[None]:
        """``read`` as a task that empties attribute ``slot`` when it ends; a failed read
        keeps what the last one read (and is retried)."""
        def ended(task: asyncio.Task[None]) -> None:
            setattr(self, slot, None)
            if not task.cancelled() and task.exception() is not None:
                log.info("kvshare %s unavailable: %s", what, task.exception())

        task = asyncio.get_running_loop().create_task(read)
        task.add_done_callback(ended)
        return task

    # ------------------------------------------------------------------ load reports
    async def loads(self, deadline: float) -> dict[WorkerId, WorkerLoad]:
        """The workers' load reports by ``deadline`` (event loop time; the last ones read, if
        late or down); with ``loads_refresh_s``, the latest read, refreshed in the background."""
        every = self.settings.loads_refresh_s
        if every and self._loads_task is None:
            self._loads_task = self._in_background(
                self._follow_loads(every, weakref.ref(self)), "_loads_task", "load reports")
        if every and self.reported:
            return self.reported
        try:
            remaining = max(0.001, deadline - asyncio.get_running_loop().time())
            await asyncio.wait_for(self._read_loads(), remaining)
        except (TimeoutError, RayError):
            pass
        return self.reported

    async def _read_loads(self) -> None:
        assert self.registry is not None  # (read once the router connected)
        self.reported = dict(await self.registry.loads_async())
        self.loads_at = time.monotonic()

    @staticmethod
    async def _follow_loads(every: float, view: weakref.ref[ReplicaWorkers]) -> None:
        """Read the load reports every ``every`` seconds for as long as the view lives, so a
        decision's are at most about that old however far apart decisions come (read only
        when a decision found them old, a quiet spell left the next decision seconds-old
        reports). A failed read keeps the last ones and is retried at the next tick."""
        while True:
            await asyncio.sleep(every)  # (the decision that started this has just read them)
            me = view()
            if me is None:
                return
            try:
                await me._read_loads()
            except (TimeoutError, RayError) as exc:
                log.debug("kvshare load reports unavailable: %s", exc)
            del me  # (the sleep must not keep the view alive)
