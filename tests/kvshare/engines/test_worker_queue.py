"""The reference worker's queue and text output without HTTP: fairness, bounds, cancels, stops."""

from __future__ import annotations

import time

import pytest
from engine_helpers import small_engine

from kvshare.engines.openai_api import parse_request
from kvshare.engines.runtime import WorkerRuntime
from kvshare.engines.scheduler import FairQueue, Overloaded
from kvshare.engines.text_out import TextOut
from kvshare.engines.worker import ReferenceWorker
from kvshare.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def runtime() -> WorkerRuntime:
    return WorkerRuntime(ReferenceWorker(small_engine(threads=1), None))


def request(runtime: WorkerRuntime, tenant: str, max_tokens: int = 4, **extra: object):  # type: ignore[no-untyped-def]
    body = {"prompt": "fair queues", "max_tokens": max_tokens, "ignore_eos": True,
            "kvshare": {"token_ids": [5, 6, 7, 8], "tenant": tenant}, **extra}
    return parse_request(body, chat=False, namespace="q", tokenizer=runtime.engine.tokenizer)


def test_tenants_take_turns_and_a_full_queue_refuses(runtime: WorkerRuntime) -> None:
    queue = FairQueue(runtime, max_pending=5)
    try:
        hog = queue.submit(request(runtime, "a", max_tokens=4000))  # holds the engine
        while not hog.started:
            time.sleep(0.01)
        waiting = [queue.submit(request(runtime, "a")) for _ in range(3)]
        quiet = queue.submit(request(runtime, "b"))
        with pytest.raises(Overloaded, match="5 requests queued or running"):
            queue.submit(request(runtime, "b"))
        assert queue.refused == 1 and runtime.load.running == 5
        hog.cancel()
        assert hog.future.result(timeout=60).ended == "cancelled"
        for job in [*waiting, quiet]:
            assert len(job.future.result(timeout=60).tokens) == 4
        assert quiet.ahead == 1  # one of a's three waiting requests ran first, not all three
        assert sorted(j.ahead for j in waiting) == [0, 2, 3]
        assert runtime.load.running == 0 and queue.pending == 0
    finally:
        queue.close()


def test_a_request_cancelled_while_queued_never_runs(runtime: WorkerRuntime) -> None:
    queue = FairQueue(runtime, max_pending=4)
    try:
        hog = queue.submit(request(runtime, "a", max_tokens=4000))
        gone = queue.submit(request(runtime, "b", max_tokens=50))
        gone.cancel()
        hog.cancel()
        c = gone.future.result(timeout=60)
        assert c.ended == "cancelled" and c.tokens == []
        assert runtime.load.as_dict()["queued_prefill_tokens"] == 0 and runtime.load.running == 0
    finally:
        queue.close()


def test_a_deadline_ends_generation_with_what_it_has(runtime: WorkerRuntime) -> None:
    c = runtime.run(runtime.admit(request(runtime, "a", max_tokens=8000, deadline_s=0.2)))
    assert c.ended == "deadline" and 0 < len(c.tokens) < 8000
    assert runtime.finish_reason(c, request(runtime, "a")) == "length"


def test_text_out_never_sends_a_stop_string_or_half_a_character() -> None:
    tok = ByteTokenizer(512)
    ids = list("héllo wörld, stop here END more".encode())
    out = TextOut(tok, ["END", "never"], skip={1})
    sent = [out.push(t) for t in [*ids[:3], 1, *ids[3:]]]
    assert "".join(sent) + out.flush() == "héllo wörld, stop here " and out.stopped
    assert all("\ufffd" not in s and "EN" not in s for s in sent)
    plain = TextOut(tok)
    assert "".join(plain.push(t) for t in ids) + plain.flush() == "héllo wörld, stop here END more"
