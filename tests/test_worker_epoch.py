"""A reference worker's restart shows in its load reports (``cache_epoch``), and routers then
forget the blocks they expected its earlier incarnation to hold.

Real parts: the index (``GlobalIndex``, as the index actor runs it), the worker runtime's
``LoadTracker`` and ``LoadReporter`` thread (what a reference worker process runs), and the
routing core the gateway and the Serve router share.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from actors.index.global_index import GlobalIndex
from kvshare.engines.runtime import LoadReporter, LoadTracker
from kvshare.match import EMPTY_MATCH
from kvshare.types import worker_location
from kvshare.workers import WorkerLoad
from router.core import IndexAnswer
from tests.test_router_core import NS, SYSTEMS, WORKERS, core, request


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def start(index: GlobalIndex, worker: int) -> tuple[LoadReporter, LoadTracker]:
    """One start of the reference worker ``WORKERS[worker]``: its tracker and report thread."""
    tracker = LoadTracker()
    reporter = LoadReporter(index, WORKERS[worker], tracker, interval_s=0.02)
    reporter.start()
    return reporter, tracker


def test_a_restarted_reference_worker_reports_another_epoch_and_routers_forget_its_blocks() -> None:
    index = GlobalIndex()
    index.declare_namespace(NS)
    reporters = [start(index, i)[0] for i in range(len(WORKERS))]
    try:
        wait_for(lambda: len(index.loads()) == len(WORKERS))
        first = index.loads()
        time.sleep(0.1)  # reports keep coming: the epoch of one start does not move
        assert {w: r.cache_epoch for w, r in index.loads().items()} == {
            w: r.cache_epoch for w, r in first.items()}

        c = core()
        loads = {w: WorkerLoad(w, 0, 0, 2000.0, 0.0, cache_epoch=r.cache_epoch)
                 for w, r in first.items()}
        req = request(SYSTEMS[0])
        chosen = c.rank(req, IndexAnswer(EMPTY_MATCH), c.candidates(WORKERS, loads))
        c.routed("a", chosen)
        c.prefilled("a")
        w = chosen.decision.worker
        assert list(c.pending.match(NS, req.hashes).locations) == [worker_location(w)]

        # the chosen worker's process dies and starts again under the same id
        i = next(k for k, info in enumerate(WORKERS) if info.worker_id == w)
        reporters[i].stop()
        time.sleep(0.002)  # (a restart takes far longer than the epoch's 1 ms grain)
        reporters[i] = start(index, i)[0]
        wait_for(lambda: index.loads()[w].cache_epoch != first[w].cache_epoch)
        again = index.loads()[w]
        assert again.cache_epoch > first[w].cache_epoch  # a later start, a later base
        c.candidates(WORKERS, {**loads, w: WorkerLoad(w, 0, 0, 2000.0, 1.0,
                                                      cache_epoch=again.cache_epoch)})
        assert not c.pending.match(NS, req.hashes).locations  # nothing pending there now
    finally:
        for r in reporters:
            r.stop()

