"""The worker's queue: bounded, fair between tenants, cancellable.

The engine runs one request at a time (:class:`~kvshare.engines.worker.ReferenceWorker`). A
:class:`FairQueue` holds what waits for it and runs it on one engine thread:

- **Bounded.** At most ``max_pending`` requests are queued or running; one more is refused
  with :class:`Overloaded` (the server answers 429 with ``Retry-After``) before it is counted
  as load, so a router sends it elsewhere.
- **Fair.** Each tenant (the gateway's ``kvshare.tenant``) has its own FIFO and the engine
  takes the tenants' heads in turn, so a tenant with many requests waiting delays another
  tenant's next request by at most one of its own, not by all of them. :attr:`Job.ahead`
  counts the requests that started while a job waited.
- **Cancellable.** :meth:`Job.cancel` (the client went away) ends the job's generation at the
  next token, or before its prefill if it still waits; a job past its deadline ends the
  same way (:meth:`~kvshare.engines.runtime.WorkerRuntime.run`). Either way the engine and
  the job's load are free for the next request at once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvshare.engines.openai_api import ParsedRequest
from kvshare.engines.runtime import WorkerRuntime
from kvshare.engines.worker import Completion


class Overloaded(Exception):
    """The queue is full: try again after ``retry_after_s`` (or another worker)."""

    def __init__(self, pending: int, retry_after_s: int) -> None:
        super().__init__(f"this worker has {pending} requests queued or running (its limit): "
                         f"retry in {retry_after_s} s or on another worker")
        self.pending = pending
        self.retry_after_s = retry_after_s


@dataclass
class Job:
    """One admitted request: its result arrives in :attr:`future`."""

    req: ParsedRequest
    on_delta: Callable[[str], None] | None
    future: Future[Completion] = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)
    started: float = 0.0
    ahead: int = 0  # requests that started while this one waited
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """The client went away: stop generating for it (or never start)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def queue_s(self) -> float:
        """Seconds it waited for the engine (so far, while it still waits)."""
        return (self.started or time.monotonic()) - self.enqueued


class FairQueue:
    """Bounded per-tenant round-robin queue in front of one :class:`WorkerRuntime`."""

    def __init__(self, runtime: WorkerRuntime, max_pending: int = 32,
                 retry_after_s: int = 1) -> None:
        if max_pending < 1 or retry_after_s < 1:
            raise ValueError("max_pending and retry_after_s must be >= 1")
        self.runtime = runtime
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self.refused = 0
        self._queues: OrderedDict[str, deque[Job]] = OrderedDict()  # tenants in turn order
        self._waiting: list[Job] = []
        self._pending = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvshare-engine", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Requests queued or running."""
        with self._cv:
            return self._pending

    def submit(self, req: ParsedRequest, on_delta: Callable[[str], None] | None = None) -> Job:
        """Queue ``req`` under its tenant; :class:`Overloaded` when full, BadRequest/ValueError
        from :meth:`WorkerRuntime.admit` when it cannot run here (nothing is queued then)."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the worker is stopping")
            if self._pending >= self.max_pending:
                self.refused += 1
                raise Overloaded(self._pending, self.retry_after_s)
            job = Job(self.runtime.admit(req), on_delta)
            self._pending += 1
            self._queues.setdefault(req.tenant, deque()).append(job)
            self._waiting.append(job)
            self._cv.notify()
        return job

    def _next(self) -> Job | None:
        with self._cv:
            while not self._queues and not self._closed:
                self._cv.wait()
            if not self._queues:
                return None
            tenant, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            del self._queues[tenant]
            if queue:  # the tenant goes to the back of the turn order
                self._queues[tenant] = queue
            self._waiting.remove(job)
            for other in self._waiting:
                other.ahead += 1
            job.started = time.monotonic()
            return job

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            waited = job.future.set_running_or_notify_cancel()
            if not waited:
                job.cancel()  # its waiter gave up: run() only settles the load it counted
            try:
                c = self.runtime.run(job.req, job.on_delta, job._cancel.is_set)
            except Exception as exc:  # the engine failed: the host reports it
                if waited:
                    job.future.set_exception(exc)
            else:
                if waited:
                    job.future.set_result(c)
            finally:
                with self._cv:
                    self._pending -= 1

    def close(self) -> None:
        """Stop taking requests; the running one finishes, queued ones are cancelled."""
        with self._cv:
            self._closed = True
            for job in self._waiting:
                job.cancel()
            self._cv.notify_all()
