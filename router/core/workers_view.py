"""Where a router gets its workers and their loads, and the load it adds itself.

- :class:`StaticWorkers`: a fixed list (``kvshare gateway --workers URL,...``); loads come
  from :meth:`report` (worker reports) only.
- :class:`IndexWorkers`: workers registered in the cluster index (a :class:`WorkerRegistry`:
  ``IndexClient``'s ``workers_async``/``loads_async``), refreshed at most every ``refresh_s``.
- Ray Serve's replicas: :class:`kvshare.router.serve.workers_view.ReplicaWorkers` (the
  registry's workers and loads for the replicas Serve offers).
- :class:`InFlight`: what this router has sent and not yet seen prefilled or finished, added
  on top of the last report so a burst between two reports is not all sent to one worker
  (Dynamo tracks active blocks in the router the same way).
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from operator import is_
from typing import Protocol

from kvshare.types import WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)


class WorkerSource(Protocol):
    """Where a router gets its workers and their load reports."""

    async def snapshot(self) -> tuple[list[WorkerInfo], dict[WorkerId, WorkerLoad]]:
        """Current workers and their latest load reports."""
        ...

    def report(self, load: WorkerLoad) -> None:
        """A load report handed to the router (a source that reads its reports elsewhere
        ignores it)."""
        ...


class WorkerRegistry(Protocol):
    """The worker registry's reads (the index client, an in-process index)."""

    async def workers_async(self) -> list[WorkerInfo]:
        """The registered workers."""
        ...

    async def loads_async(self) -> dict[WorkerId, WorkerLoad]:
        """Their latest load reports."""
        ...


class StaticWorkers:
    """A fixed set of workers; :meth:`report` records their load reports."""

    def __init__(self, workers: Sequence[WorkerInfo]) -> None:
        ids = [w.worker_id for w in workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        self.workers = list(workers)
        self._loads: dict[WorkerId, WorkerLoad] = {}

    def report(self, load: WorkerLoad) -> None:
        self._loads[load.worker_id] = load

    async def snapshot(self) -> tuple[list[WorkerInfo], dict[WorkerId, WorkerLoad]]:
        return self.workers, dict(self._loads)


class IndexWorkers:
    """Workers registered in the cluster index, cached for ``refresh_s``.

    When the index cannot answer (dead, restarting, timed out: any error) the last list it gave
    stays in use, so routing goes on from loads alone; ``failures`` counts those refreshes. The
    next refresh is tried after ``refresh_s`` again. An index that lists no workers at all
    after listing some (a recreated index before the workers registered again, leases that
    lapsed on a starved host before their workers registered again) is not believed until it
    has listed none for ``empty_grace_s``, counted from the first empty listing (a gateway
    with sparse traffic refreshes only when it routes): a worker that did leave fails to
    connect, and the gateway then tries another."""

    def __init__(self, client: WorkerRegistry, refresh_s: float = 0.5,
                 empty_grace_s: float = 5.0) -> None:
        self.client = client
        self.refresh_s = refresh_s
        self.empty_grace_s = empty_grace_s
        self.failures = 0
        self._empty_since: float | None = None  # the first empty listing after some workers
        self._at = -1e18
        self._cache: tuple[list[WorkerInfo], dict[WorkerId, WorkerLoad]] = ([], {})
        self._refreshing: asyncio.Future[None] | None = None

    def report(self, load: WorkerLoad) -> None:
        """Ignored: the loads are the ones the workers report to the index."""

    async def snapshot(self) -> tuple[list[WorkerInfo], dict[WorkerId, WorkerLoad]]:
        """The cached workers and loads, refreshed first when older than ``refresh_s``; callers
        that arrive while a refresh runs wait for that one (one index round trip for all:
        every request waiting on a worker checks it is still listed, ``upstream.unless_lapsed``)."""
        if time.monotonic() - self._at >= self.refresh_s:
            task = self._refreshing
            if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
                task = self._refreshing = asyncio.ensure_future(self._refresh())
            await asyncio.shield(task)
        return self._cache

    async def _refresh(self) -> None:
        now = time.monotonic()
        try:
            # both at once: a refresh waits for one index round trip, not two
            infos, loads = await asyncio.gather(self.client.workers_async(),
                                                self.client.loads_async())
        except Exception as exc:  # the index is a hint: keep the workers we knew
            self._at = now
            self.failures += 1
            log.warning("index did not list workers (%s): keeping the last %d",
                        type(exc).__name__, len(self._cache[0]))
            return
        self._at = now
        if infos:
            self._empty_since = None
        elif self._cache[0]:
            if self._empty_since is None:
                self._empty_since = now
            if now - self._empty_since < self.empty_grace_s:
                return
        self._cache = (list(infos), dict(loads))


class InFlight:
    """Requests this router routed: prefill tokens until first token, blocks until done;
    counted on top of a worker's report when sent after the state it describes
    (:attr:`~kvshare.workers.WorkerLoad.state_ts`: a vLLM engine's last step, else the report's
    time).

    The other way round too: prefill work that drained (first token, or done) within
    ``drain_window_s`` after a worker's last report is taken off that report's queued tokens
    (the report is stale: it still counts it).

    :meth:`loads` keeps each worker's answer until that worker's requests or drains change,
    its report is another object, or a drain leaves the window; a router deciding thousands
    of times a second thus recomputes only the worker it last sent to, not all of them.
    """

    def __init__(self, clock: Callable[[], float] = time.time, max_age_s: float = 600.0,
                 drain_window_s: float = 2.0) -> None:
        self._clock = clock
        self.max_age_s = max_age_s
        self.drain_window_s = drain_window_s
        self._reqs: dict[str, tuple[WorkerId, int, int, float]] = {}  # rid -> (w, tokens, blocks, t)
        self._per: dict[WorkerId, dict[str, tuple[int, int, float]]] = {}  # the same, by worker
        self._oldest = math.inf  # <= every request's time: sweep has nothing to do before it ages
        self._drained: dict[WorkerId, _Drains] = {}
        # rid -> the tokens the worker's own report counts for it until its first token (the
        # whole prompt: a worker queues a request's tokens before it knows its cache hit)
        self._counted: dict[str, int] = {}
        # worker -> (the report, :meth:`loads`' answer from it, the time of the first drain it
        # counts: the answer changes once that leaves the window)
        self._memo: dict[WorkerId, tuple[WorkerLoad, tuple[WorkerLoad, int], float]] = {}
        # :meth:`loads`' last call: its workers and reports (compared by identity), its answer,
        # whether it can be updated in place, and the workers whose kept answer was dropped
        # since (their requests or drains changed, or a drain left the window)
        self._last_infos: tuple[WorkerInfo, ...] = ()
        self._last_pos: dict[WorkerId, int] = {}  # their positions by worker id
        self._last_reports: list[WorkerLoad | None] = []
        self._last_out: list[tuple[WorkerLoad, int]] = []
        self._last_ok = False  # (False: recompute all)
        self._changed: set[WorkerId] = set()
        # (time, worker) when a kept answer's first counted drain leaves the window (a heap;
        # an entry whose answer was replaced since is skipped when it comes up)
        self._expiry: list[tuple[float, WorkerId]] = []
        self._due: dict[WorkerId, float] = {}  # per worker: its latest time in that heap

    def __len__(self) -> int:
        return len(self._reqs)

    def add(self, rid: str, worker: WorkerId, prefill_tokens: int, blocks: int,
            counted_tokens: int | None = None) -> None:
        """``prefill_tokens`` load the worker until the first token; ``counted_tokens``
        (default ``prefill_tokens``) are what the worker's reports count for this request
        until then, and what its drain takes off a stale report."""
        at = self._clock()
        old = self._reqs.get(rid)
        if old is not None:  # re-placed (Serve's expect, then routed): off the old worker
            self._unlist(rid, old[0])
        self._reqs[rid] = (worker, prefill_tokens, blocks, at)
        self._list(rid, worker, (prefill_tokens, blocks, at))
        self._counted[rid] = prefill_tokens if counted_tokens is None else counted_tokens
        if at < self._oldest:
            self._oldest = at

    def _list(self, rid: str, worker: WorkerId, row: tuple[int, int, float]) -> None:
        mine = self._per.get(worker)
        if mine is None:
            mine = self._per[worker] = {}
        mine[rid] = row
        self._stale(worker)

    def _unlist(self, rid: str, worker: WorkerId) -> None:
        mine = self._per.get(worker)
        if mine is not None:
            mine.pop(rid, None)
            if not mine:
                del self._per[worker]
        self._stale(worker)

    def _stale(self, worker: WorkerId) -> None:
        """``worker``'s kept answer no longer holds (:meth:`loads` computes it again); it is
        kept aside, so an equal new answer keeps its object (and what is kept per object
        downstream: the candidate, its queue wait)."""
        m = self._memo.get(worker)
        if m is not None:
            self._memo[worker] = (m[0], m[1], -math.inf)
        self._changed.add(worker)

    def prefilled(self, rid: str) -> None:
        r = self._reqs.get(rid)
        if r is not None:
            self._drain(r[0], self._counted.pop(rid, r[1]))
            self._reqs[rid] = (r[0], 0, r[2], r[3])
            self._list(rid, r[0], (0, r[2], r[3]))

    def done(self, rid: str) -> None:
        r = self._reqs.pop(rid, None)
        counted = self._counted.pop(rid, None)
        if r is not None:
            self._unlist(rid, r[0])
            self._drain(r[0], r[1] if counted is None else counted)

    def _drain(self, worker: WorkerId, tokens: int) -> None:
        if tokens <= 0:
            return
        now = self._clock()
        rows = self._drained.get(worker)
        if rows is None:
            rows = self._drained[worker] = _Drains()
        rows.add(now, tokens, now - self.drain_window_s)  # (its callers dropped the memo)

    def _fresh(self, report: WorkerLoad, now: float) -> tuple[WorkerLoad, float]:
        """``report`` less the prefill work that drained after it was taken; and the time of
        the first drain counted (inf: none)."""
        rows = self._drained.get(report.worker_id)
        if rows is None:
            return report, math.inf
        gone, first = rows.since(max(report.ts, now - self.drain_window_s))
        if not gone:
            return report, first
        return report.with_queue(max(0, report.queued_prefill_tokens - gone), report.running), first

    def _reindex(self) -> None:
        self._per = {}
        for rid, (w, t, b, at) in self._reqs.items():
            self._per.setdefault(w, {})[rid] = (t, b, at)
        self._memo.clear()
        self._expiry.clear()
        self._due.clear()
        self._last_ok = False

    def keep_only(self, workers: Collection[WorkerId]) -> None:
        """Forget the requests of every worker not in ``workers`` (removed or dead)."""
        self._reqs = {rid: r for rid, r in self._reqs.items() if r[0] in workers}
        self._counted = {rid: n for rid, n in self._counted.items() if rid in self._reqs}
        self._drained = {w: rows for w, rows in self._drained.items() if w in workers}
        self._oldest = min((r[3] for r in self._reqs.values()), default=math.inf)
        self._reindex()

    def drop(self, worker: WorkerId) -> None:
        """Forget ``worker``'s requests (it died)."""
        self.keep_only(({r[0] for r in self._reqs.values()} | set(self._drained)) - {worker})

    def sweep(self) -> None:
        """Forget requests older than ``max_age_s`` (a caller that never said done)."""
        if not self._reqs:
            return
        now = self._clock()
        if not now - self._oldest > self.max_age_s:
            return  # nothing is that old yet
        stale = [rid for rid, r in self._reqs.items() if now - r[3] > self.max_age_s]
        for rid in stale:
            del self._reqs[rid]
            self._counted.pop(rid, None)
        self._oldest = min((r[3] for r in self._reqs.values()), default=math.inf)
        self._reindex()

    def loads(
        self, infos: Sequence[WorkerInfo], reports: Mapping[WorkerId, WorkerLoad]
    ) -> list[tuple[WorkerLoad, int]]:
        """:meth:`load` of every worker in ``infos`` (kept per worker: class docstring). Given
        the same workers with the same report objects as the last call, only the workers whose
        requests or drains changed since, or whose first counted drain left the window, are
        looked at (a router's next decision: the worker it sent to, the one that finished)."""
        now = self._clock()
        last = self._last_infos
        if self._last_ok and len(infos) == len(last) and all(map(is_, infos, last)):
            got = list(map(reports.get, self._last_pos))
            if all(map(is_, got, self._last_reports)):
                return self._update(got, now)
        return self._recompute(infos, reports, now)

    def _expired(self, now: float) -> None:
        """Mark the workers whose kept answer counts a drain that has left the window now."""
        heap, cutoff, memo = self._expiry, now - self.drain_window_s, self._memo
        while heap and heap[0][0] <= cutoff:
            first, wid = heapq.heappop(heap)
            if self._due.get(wid) == first:
                del self._due[wid]
            m = memo.get(wid)
            if m is not None and m[2] == first:  # (else: an older answer's, already replaced)
                self._changed.add(wid)

    def _update(self, reports: list[WorkerLoad | None], now: float
                ) -> list[tuple[WorkerLoad, int]]:
        """:meth:`loads` as the last call's answer, recomputed where it no longer holds."""
        self._expired(now)
        out = list(self._last_out)
        if self._changed:
            pos = self._last_pos
            for wid in self._changed:
                i = pos.get(wid)
                if i is not None:
                    out[i] = self._answer(wid, reports[i], now)
            self._changed.clear()
            self._last_out = out
            out = list(out)
        return out

    def _recompute(self, infos: Sequence[WorkerInfo], reports: Mapping[WorkerId, WorkerLoad],
                   now: float) -> list[tuple[WorkerLoad, int]]:
        """:meth:`loads` looking at every worker (its kept answer reused where it holds)."""
        self._expired(now)
        memo, window = self._memo, self.drain_window_s
        get = reports.get
        out: list[tuple[WorkerLoad, int]] = []
        got: list[WorkerLoad | None] = []
        for info in infos:
            wid = info.worker_id
            report = get(wid)
            got.append(report)
            m = memo.get(wid)
            if m is not None and m[0] is report and now - window < m[2]:
                out.append(m[1])
            else:
                out.append(self._answer(wid, report, now))
        if len(memo) > 2 * len(infos) + 64:  # workers come and go: forget the departed
            live = {i.worker_id for i in infos}
            self._memo = {w: m for w, m in memo.items() if w in live}
        self._changed.clear()
        self._last_infos, self._last_reports, self._last_out = tuple(infos), got, out
        self._last_pos = {info.worker_id: i for i, info in enumerate(infos)}
        # (a worker that never reported is recomputed on every call; one listed twice has no
        # one position to update)
        self._last_ok = None not in got and len(self._last_pos) == len(infos)
        return list(out)

    def _answer(self, wid: WorkerId, report: WorkerLoad | None, now: float
                ) -> tuple[WorkerLoad, int]:
        """``wid``'s load computed now (:meth:`load`'s answer), kept with its report until its
        first counted drain leaves the window (a worker that never reported: not kept). An
        answer equal to the kept one is the kept object; the numbers are compared before any
        object is built (the other fields are the report's in both)."""
        if report is None:
            return self.load(wid, None)
        rows = self._drained.get(wid)
        gone, first = (0, math.inf) if rows is None else rows.since(
            max(report.ts, now - self.drain_window_s))
        tokens, running, blocks = self._mine(wid, report.state_ts)
        queued = (max(0, report.queued_prefill_tokens - gone) if gone
                  else report.queued_prefill_tokens) + tokens
        m = self._memo.get(wid)
        got: tuple[WorkerLoad, int]
        if (m is not None and m[0] is report and m[1][1] == blocks
                and m[1][0].queued_prefill_tokens == queued
                and m[1][0].running == report.running + running):
            got = m[1]
        elif gone or running:
            got = report.with_queue(queued, report.running + running), blocks
        else:
            got = report, blocks
        self._memo[wid] = (report, got, first)
        if first < math.inf and self._due.get(wid) != first:  # (else: it is in the heap)
            self._due[wid] = first
            heapq.heappush(self._expiry, (first, wid))
        return got

    def load(self, worker: WorkerId, report: WorkerLoad | None) -> tuple[WorkerLoad, int]:
        """The report plus this router's in-flight work sent after it; and active blocks."""
        now = self._clock()
        return self._with_mine(worker, None if report is None else self._fresh(report, now)[0],
                               now)

    def _with_mine(self, worker: WorkerId, report: WorkerLoad | None, now: float
                   ) -> tuple[WorkerLoad, int]:
        """``report`` (already freshened) plus this router's requests sent after it; and the
        worker's active blocks."""
        tokens, running, blocks = self._mine(worker, report.state_ts if report is not None else -1e18)
        if report is None:
            return WorkerLoad(worker, tokens, running, 0.0, now), blocks
        if not running:
            return report, blocks
        return report.with_queue(report.queued_prefill_tokens + tokens,
                                 report.running + running), blocks

    def _mine(self, worker: WorkerId, since: float) -> tuple[int, int, int]:
        """This router's prefill tokens and requests at ``worker`` sent after ``since``, and
        the blocks of all its requests there."""
        mine = self._per.get(worker)
        if mine is None:
            return 0, 0, 0
        tokens = running = blocks = 0
        for t, b, at in mine.values():
            blocks += b
            if at > since:
                tokens += t
                running += 1
        return tokens, running, blocks


class _Drains:
    """One worker's drained prefill tokens in time order, summed since any time in O(log n)
    (a router deciding thousands of times a second must not add up every drain each time)."""

    __slots__ = ("base", "sums", "times")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.sums: list[int] = []  # running total up to and including each row
        self.base = 0  # the running total before the first row kept

    def add(self, at: float, tokens: int, forget_before: float) -> None:
        self.times.append(at)
        self.sums.append((self.sums[-1] if self.sums else self.base) + tokens)
        if self.times[0] < forget_before:  # drop the rows out of the window, in bulk
            cut = bisect.bisect_left(self.times, forget_before)
            if cut >= 64 or cut * 2 >= len(self.times):
                self.base = self.sums[cut - 1]
                del self.times[:cut], self.sums[:cut]

    def since(self, t: float) -> tuple[int, float]:
        """Tokens drained strictly after ``t``, and when the first of them drained (inf:
        none did)."""
        if not self.times or self.times[-1] <= t:
            return 0, math.inf
        i = bisect.bisect_right(self.times, t)
        return self.sums[-1] - (self.sums[i - 1] if i else self.base), self.times[i]
