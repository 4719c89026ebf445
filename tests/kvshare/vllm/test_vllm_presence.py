"""A vLLM worker's presence: once :meth:`Presence.start` returns the worker is listed with a
load (routable: ``start_workers`` returns only then); an index that does not answer yet does
not fail the start, and the worker registers as soon as it answers."""

from __future__ import annotations

import time
from typing import Any

from kvshare.actors.index.global_index import GlobalIndex
from kvshare.types import NodeId, WorkerId
from kvshare.vllm.server.presence import Presence
from kvshare.workers import WorkerInfo, WorkerLoad

WID = WorkerId("w-presence")
INFO = WorkerInfo(WID, NodeId("n0"), ("ns",))


def _load() -> WorkerLoad:
    return WorkerLoad(WID, queued_prefill_tokens=7, ts=time.time())


def _index(cls: type[GlobalIndex] = GlobalIndex) -> Any:
    index = cls()
    index.declare_namespace("ns")
    return index


class _Slow(GlobalIndex):
    """An index a round trip away (a Ray actor on another node): registering takes a while."""

    def register_worker(self, info: WorkerInfo) -> int:
        time.sleep(0.3)
        return super().register_worker(info)


def test_the_worker_is_listed_with_its_load_when_start_returns() -> None:
    index = _index(_Slow)
    presence = Presence(INFO, index, _load, interval_s=0.1).start()
    try:  # no wait: a caller acting on the return must find it
        assert [w.worker_id for w in index.workers()] == [WID]
        load = index.loads()[WID]
        assert load.ts > 0 and load.queued_prefill_tokens == 7
    finally:
        presence.stop()
    assert index.workers() == []


class _Unreachable(GlobalIndex):
    """An index that raises until ``up`` is set."""

    up = False

    def register_worker(self, info: WorkerInfo) -> int:
        if not self.up:
            raise ConnectionError("index not reachable")
        return super().register_worker(info)

    def report_load(self, load: WorkerLoad) -> bool:
        if not self.up:
            raise ConnectionError("index not reachable")
        return super().report_load(load)


def test_an_index_that_does_not_answer_yet_does_not_fail_the_start() -> None:
    index = _index(_Unreachable)
    presence = Presence(INFO, index, _load, interval_s=0.02).start()
    try:
        assert presence.counters["report_errors"] >= 1 and index.workers() == []
        index.up = True
        deadline = time.monotonic() + 5
        while not index.workers() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [w.worker_id for w in index.workers()] == [WID]
        assert index.loads()[WID].ts > 0
    finally:
        presence.stop()


class _Engine:
    """What the presence reads: a load (None: ``/metrics`` did not answer) and liveness."""

    def __init__(self) -> None:
        self.answers = True
        self.alive = True

    def load(self) -> WorkerLoad | None:
        return _load() if self.answers else None


def test_a_busy_engine_keeps_its_lease_while_alive_and_a_dead_or_hung_one_loses_it() -> None:
    """An engine that answers ``/metrics`` late (a long step on a loaded host) is still
    listed, with its last load, past the index's lease: dropping it would drop its cache
    entries and strand the requests routed to it. A dead process loses the lease at once, a
    live one silent past ``silent_grace_s`` too."""
    now = [0.0]
    index = GlobalIndex(worker_ttl_s=3.0, clock=lambda: now[0])
    index.declare_namespace("ns")
    engine = _Engine()
    presence = Presence(INFO, index, engine.load, alive_fn=lambda: engine.alive,
                        silent_grace_s=10.0, clock=lambda: now[0])

    def run(seconds: float) -> None:  # the lease thread's ticks, every 100 ms; a router
        for i in range(int(seconds * 10)):  # lists the workers every 500 ms
            now[0] += 0.1
            presence.tick()
            if i % 5 == 4:
                index.workers()

    presence.tick()
    first = index.loads()[WID]
    engine.answers = False
    run(8.0)  # silent for more than two leases, within the grace
    assert [w.worker_id for w in index.workers()] == [WID]
    assert index.loads()[WID] == first  # the last load, as it was
    assert presence.counters["silent_renewals"] == 80
    run(6.0)  # past the grace (and its last lease): a hung engine is dropped
    assert index.workers() == []

    engine.answers = True
    presence.tick()  # it answers again: registered again
    assert [w.worker_id for w in index.workers()] == [WID]
    engine.answers, engine.alive = False, False
    presence.tick()  # dead: unregistered at once, not registered again
    assert index.workers() == [] and presence.counters["engine_dead"] == 1
    run(1.0)
    assert index.workers() == [] and presence.counters["engine_dead"] == 1


def test_without_a_liveness_check_a_silent_engine_is_not_renewed() -> None:
    now = [0.0]
    index = GlobalIndex(worker_ttl_s=3.0, clock=lambda: now[0])
    index.declare_namespace("ns")
    engine = _Engine()
    presence = Presence(INFO, index, engine.load, clock=lambda: now[0])
    presence.tick()
    engine.answers = False
    for i in range(35):
        now[0] += 0.1
        presence.tick()
        if i % 5 == 4:
            index.workers()  # a router's refresh
    assert index.workers() == [] and presence.counters["silent_renewals"] == 0
