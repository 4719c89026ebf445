"""A streamed answer as the client receives it (router/gateway/relay.py), with a fake router
and worker stream: events go on as they arrive, the worker's figures wait for the end and
carry the breakdown, a stream past its deadline or whose worker died ends with ``[DONE]``, and
closing gives everything back."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx

from kvshare.router.core.metrics import RouterMetrics
from kvshare.router.gateway.relay import StreamRelay
from kvshare.router.gateway.upstream import Answer, Outgoing, Slot

DONE = b"data: [DONE]\n\n"


def ev(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text(t: str) -> bytes:
    return ev({"choices": [{"index": 0, "text": t, "finish_reason": None}]})


FIGURES = ev({"choices": [], "kvshare": {"worker_s": 0.25, "breakdown": {"prefill": 0.2}}})


class FakeRouter:
    """What a relay asks of a CacheAwareRouter, recorded."""

    def __init__(self) -> None:
        self.metrics = RouterMetrics()
        self.calls: list[tuple[str, str]] = []
        self.recent = SimpleNamespace(finish_stream=lambda rid, end: self.calls.append(
            ("finish_stream", rid)))

    def prefilled(self, request_id: str) -> None:
        self.calls.append(("prefilled", request_id))

    def finished(self, request_id: str) -> None:
        self.calls.append(("finished", request_id))


class FakeResponse:
    status_code = 200
    closed = 0

    async def aclose(self) -> None:
        self.closed += 1


async def chunks(*parts: bytes | Exception) -> AsyncIterator[bytes]:
    for part in parts:
        if isinstance(part, Exception):
            raise part
        yield part


def relay_of(first: bytes, *rest: bytes | Exception, deadline_s: float = 60.0,
             resumable: bool = False) -> tuple[StreamRelay, FakeRouter, FakeResponse, list[int]]:
    router, resp, freed = FakeRouter(), FakeResponse(), list[int]()
    routed = SimpleNamespace(request_id="r1", decision=SimpleNamespace(worker="w1"),
                             timings={"parse": 0.001}, token_ids=[1, 2], tenant=None)
    answer = Answer(routed, resp, first=first, rest=chunks(*rest))  # type: ignore[arg-type]
    out = Outgoing("/v1/completions", {}, True, time.monotonic() + deadline_s, lambda r, s: {})
    slot = Slot(lambda: freed.append(1))
    relay = StreamRelay(router, httpx.AsyncClient(), out, answer, slot,  # type: ignore[arg-type]
                        stages={"parse": 0.001, "upstream": 0.01}, vllm=False,
                        resumable=resumable, t_send=time.perf_counter())
    assert slot.handed_over
    return relay, router, resp, freed


def sent(relay: StreamRelay) -> list[bytes]:
    async def run() -> list[bytes]:
        return [data async for data in relay.events()]
    return asyncio.run(run())


def test_events_go_on_as_they_arrive_and_the_figures_wait_for_the_end() -> None:
    relay, router, resp, freed = relay_of(text("Hel")[:9], text("Hel")[9:] + text("lo"),
                                          FIGURES, DONE)
    out = sent(relay)
    assert out[0] == text("Hel") + text("lo")  # the unfinished event waited for its end
    end = out[-1]
    assert end.endswith(DONE)
    figures = json.loads(end.split(b"\n\n")[0][6:])["kvshare"]
    assert figures["breakdown"]["prefill"] == 0.2 and "network" in figures["breakdown"]
    assert figures["breakdown"]["parse"] == 0.001
    assert relay.delivered.text == {0: "Hello"}
    assert router.calls == [("prefilled", "r1"), ("finish_stream", "r1")]
    asyncio.run(relay.close())
    assert resp.closed == 1 and freed == [1] and router.calls[-1] == ("finished", "r1")


def test_a_stream_past_its_deadline_ends_with_what_was_buffered_and_done() -> None:
    relay, _, _, _ = relay_of(text("a") + b"data: {", deadline_s=-10.0)
    assert sent(relay) == [text("a"), b"data: {" + DONE]


def test_a_worker_dying_mid_stream_of_a_sampled_request_ends_with_an_error_event() -> None:
    relay, router, resp, _ = relay_of(text("a"), httpx.ReadError("gone"))
    out = sent(relay)
    assert out[0] == text("a")
    error = json.loads(out[-1].split(b"\n\n")[0][6:])["error"]
    assert error["code"] == "worker_failed" and "w1" in error["message"]
    assert out[-1].endswith(DONE)
    assert resp.closed == 1 and ("finished", "r1") in router.calls
    assert router.metrics.upstream.labels("w1", "dropped_mid_stream")._value.get() == 1
