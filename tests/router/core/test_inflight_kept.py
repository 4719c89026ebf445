"""InFlight keeps each worker's load between calls; this checks it answers exactly as
recomputing every worker from every request on every call (the version before, kept here as
the reference) on random
sequences of routing, first tokens, completions, stale and fresh reports, workers leaving and
a clock that moves on (and the same worker list again, whose last answer ``loads`` updates
only where a worker's requests or drains changed)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvshare.router.core.workers_view import InFlight
from kvshare.types import NodeId, WorkerId
from kvshare.workers import WorkerInfo, WorkerLoad


class Recomputing(InFlight):
    """The loads as before the change: every worker recomputed on every call, from all the
    requests in flight (the bookkeeping calls are InFlight's own)."""

    def _fresh_now(self, report: WorkerLoad) -> WorkerLoad:
        rows = self._drained.get(report.worker_id)
        if rows is None:
            return report
        gone = rows.since(max(report.ts, self._clock() - self.drain_window_s))[0]
        if not gone:
            return report
        return report.with_queue(max(0, report.queued_prefill_tokens - gone), report.running)

    def loads(self, infos: Sequence[WorkerInfo],
              reports: Mapping[WorkerId, WorkerLoad]) -> list[tuple[WorkerLoad, int]]:
        reports = {w: self._fresh_now(r) for w, r in reports.items()}
        per: dict[WorkerId, list[tuple[int, int, float]]] = {}
        for w, t, b, at in self._reqs.values():
            per.setdefault(w, []).append((t, b, at))
        out: list[tuple[WorkerLoad, int]] = []
        for info in infos:
            wid = info.worker_id
            report, mine = reports.get(wid), per.get(wid)
            if mine is None or report is None:
                out.append((report, 0) if mine is None and report is not None
                           else self.load(wid, report))
                continue
            tokens = running = blocks = 0
            for t, b, at in mine:
                blocks += b
                if at > report.state_ts:
                    tokens += t
                    running += 1
            if running:
                report = report.with_queue(report.queued_prefill_tokens + tokens,
                                           report.running + running)
            out.append((report, blocks))
        return out

    def load(self, worker: WorkerId, report: WorkerLoad | None) -> tuple[WorkerLoad, int]:
        if report is not None:
            report = self._fresh_now(report)
        since = report.state_ts if report is not None else -1e18
        tokens = running = blocks = 0
        for w, t, b, at in self._reqs.values():
            if w == worker:
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
                ts = now[0] - rng.random() * 3  # (as_of: a vLLM engine's last step, earlier)
                reports[w] = WorkerLoad(w, rng.randrange(0, 20000), rng.randrange(0, 5), 2000.0,
                                        ts, waiting=rng.randrange(0, 3),
                                        as_of=rng.choice((0.0, ts - rng.random() * 4)))
            elif op < 0.83:
                gone = rng.choice(infos).worker_id
                fast.drop(gone)
                ref.drop(gone)
            elif op < 0.86:
                fast.sweep()
                ref.sweep()
            pick = rng.random()  # (the same list object again: the answer kept from the last)
            shown = infos if pick < 0.8 else rng.sample(infos, 3) if pick < 0.97 else [
                *infos, infos[0]]  # (a worker listed twice)
            seen = {k: v for k, v in reports.items() if rng.random() < 0.95}
            assert fast.loads(shown, seen) == ref.loads(shown, seen), (trial, step)
            assert fast.load(w, seen.get(w)) == ref.load(w, seen.get(w))
            assert len(fast) == len(ref)
