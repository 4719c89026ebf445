"""InFlight keeps each worker's load between calls; this checks it answers exactly as the
version that recomputed every worker on every call (kept here as the reference) on random
sequences of routing, first tokens, completions, stale and fresh reports, workers leaving and
a clock that moves on."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from kvshare.types import NodeId, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad
from router.workers_view import InFlight, _Drains


class Recomputing:
    """Requests this router routed: prefill tokens until first token, blocks until done.

    The other way round too: prefill work that drained (first token, or done) within
    ``drain_window_s`` after a worker's last report is taken off that report's queued tokens
    (the report is stale: it still counts it).
    """

    def __init__(self, clock: Callable[[], float] = time.time, max_age_s: float = 600.0,
                 drain_window_s: float = 2.0) -> None:
        self._clock = clock
        self.max_age_s = max_age_s
        self.drain_window_s = drain_window_s
        self._reqs: dict[str, tuple[WorkerId, int, int, float]] = {}  # rid -> (w, tokens, blocks, t)
        self._oldest = math.inf  # <= every request's time: sweep has nothing to do before it ages
        self._drained: dict[WorkerId, _Drains] = {}
        # rid -> the tokens the worker's own report counts for it until its first token (the
        # whole prompt: a worker queues a request's tokens before it knows its cache hit)
        self._counted: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def add(self, rid: str, worker: WorkerId, prefill_tokens: int, blocks: int,
            counted_tokens: int | None = None) -> None:
        """``prefill_tokens`` load the worker until the first token; ``counted_tokens``
        (default ``prefill_tokens``) are what the worker's reports count for this request
        until then, and what its drain takes off a stale report."""
        at = self._clock()
        self._reqs[rid] = (worker, prefill_tokens, blocks, at)
        self._counted[rid] = prefill_tokens if counted_tokens is None else counted_tokens
        if at < self._oldest:
            self._oldest = at

    def prefilled(self, rid: str) -> None:
        r = self._reqs.get(rid)
        if r is not None:
            self._drain(r[0], self._counted.pop(rid, r[1]))
            self._reqs[rid] = (r[0], 0, r[2], r[3])

    def done(self, rid: str) -> None:
        r = self._reqs.pop(rid, None)
        counted = self._counted.pop(rid, None)
        if r is not None:
            self._drain(r[0], r[1] if counted is None else counted)

    def _drain(self, worker: WorkerId, tokens: int) -> None:
        if tokens <= 0:
            return
        now = self._clock()
        rows = self._drained.get(worker)
        if rows is None:
            rows = self._drained[worker] = _Drains()
        rows.add(now, tokens, now - self.drain_window_s)

    def _fresh(self, report: WorkerLoad) -> WorkerLoad:
        """``report`` less the prefill work that drained after it was taken."""
        rows = self._drained.get(report.worker_id)
        if rows is None:
            return report
        gone = rows.since(max(report.ts, self._clock() - self.drain_window_s))[0]
        if not gone:
            return report
        return report.with_queue(max(0, report.queued_prefill_tokens - gone), report.running)

    def keep_only(self, workers: Collection[WorkerId]) -> None:
        """Forget the requests of every worker not in ``workers`` (removed or dead)."""
        self._reqs = {rid: r for rid, r in self._reqs.items() if r[0] in workers}
        self._counted = {rid: n for rid, n in self._counted.items() if rid in self._reqs}
        self._drained = {w: rows for w, rows in self._drained.items() if w in workers}
        self._oldest = min((r[3] for r in self._reqs.values()), default=math.inf)

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

    def loads(
        self, infos: Sequence[WorkerInfo], reports: Mapping[WorkerId, WorkerLoad]
    ) -> list[tuple[WorkerLoad, int]]:
        """:meth:`load` of every worker in ``infos`` (one pass over the requests)."""
        if self._drained:
            reports = {w: self._fresh(r) if w in self._drained else r for w, r in reports.items()}
        get = reports.get
        if not self._reqs:
            return [
                (r, 0) if (r := get(i.worker_id)) is not None else self.load(i.worker_id, None)
                for i in infos
            ]
        per: dict[WorkerId, list[tuple[int, int, float]]] = {}
        for w, t, b, at in self._reqs.values():
            row = per.get(w)
            if row is None:
                per[w] = [(t, b, at)]
            else:
                row.append((t, b, at))
        out: list[tuple[WorkerLoad, int]] = []
        for info in infos:
            wid = info.worker_id
            report, mine = get(wid), per.get(wid)
            if mine is None or report is None:
                out.append((report, 0) if mine is None and report is not None
                           else self.load(wid, report))
                continue
            tokens = running = blocks = 0
            for t, b, at in mine:
                blocks += b
                if at > report.ts:
                    tokens += t
                    running += 1
            if running:  # else the report itself (same values)
                report = report.with_queue(report.queued_prefill_tokens + tokens,
                                           report.running + running)
            out.append((report, blocks))
        return out

    def load(self, worker: WorkerId, report: WorkerLoad | None) -> tuple[WorkerLoad, int]:
        """The report plus this router's in-flight work sent after it; and active blocks."""
        if report is not None and self._drained:
            report = self._fresh(report)
        if not self._reqs and report is not None:
            return report, 0
        since = report.ts if report is not None else -1e18
        tokens = running = blocks = 0
        for w, t, b, at in self._reqs.values():
            if w != worker:
                continue
            blocks += b
            if at > since:
                tokens += t
                running += 1
        if report is None:
            return WorkerLoad(worker, tokens, running, 0.0, self._clock()), blocks
        return report.with_queue(report.queued_prefill_tokens + tokens,
                                 report.running + running), blocks


def test_kept_loads_answer_as_recomputing_every_worker() -> None:
    rng = random.Random(11)
    for trial in range(30):
        now = [1000.0]

        def clock(now: list[float] = now) -> float:
            return now[0]

        window = rng.choice((0.5, 2.0))
        fast, ref = InFlight(clock, 50.0, window), Recomputing(clock, 50.0, window)
        infos = [WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i % 3}"), ("m",), f"http://w{i}")
                 for i in range(5)]
        reports: dict[WorkerId, WorkerLoad] = {}
        live: list[str] = []
        for step in range(400):
            now[0] += rng.choice((0.0, 0.0, 0.001, 0.05, 0.3, 1.5, 30.0))
            op = rng.random()
            w = rng.choice(infos).worker_id
            if op < 0.3:
                rid = f"r{trial}-{step}" if rng.random() < 0.9 or not live else rng.choice(live)
                tokens, blocks = rng.randrange(0, 3000), rng.randrange(0, 40)
                counted = rng.choice((None, tokens + rng.randrange(0, 5000)))
                for x in (fast, ref):
                    x.add(rid, w, tokens, blocks, counted_tokens=counted)
                live.append(rid)
            elif op < 0.45 and live:
                rid = rng.choice(live)
                fast.prefilled(rid)
                ref.prefilled(rid)
            elif op < 0.65 and live:
                rid = live.pop(rng.randrange(len(live)))
                fast.done(rid)
                ref.done(rid)
            elif op < 0.8:  # a report, taken a little while ago
                reports[w] = WorkerLoad(w, rng.randrange(0, 20000), rng.randrange(0, 5), 2000.0,
                                        now[0] - rng.random() * 3, waiting=rng.randrange(0, 3))
            elif op < 0.83:
                gone = rng.choice(infos).worker_id
                fast.drop(gone)
                ref.drop(gone)
            elif op < 0.86:
                fast.sweep()
                ref.sweep()
            shown = infos if rng.random() < 0.8 else rng.sample(infos, 3)
            seen = {k: v for k, v in reports.items() if rng.random() < 0.95}
            assert fast.loads(shown, seen) == ref.loads(shown, seen), (trial, step)
            assert fast.load(w, seen.get(w)) == ref.load(w, seen.get(w))
            assert len(fast) == len(ref)
