"""A streamed completion whose connection the server drops (:mod:`kvshare.router.gateway.sse_stream`), against a
real HTTP server on loopback that misbehaves on cue."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvshare.router.gateway.sse_stream import UpstreamError, stream_events

SSE_OK = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
          + b"".join(b"data: " + json.dumps({"choices": [{"text": t}]}).encode() + b"\n\n"
                     for t in ("a", "b"))
          + b"data: [DONE]\n\n")
CUT_OFF = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           b"40\r\ndata: {")  # a chunk of 64 bytes announced, 7 sent, then the server is gone
BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\nconnection: close\r\n\r\nbusy"


class Server:
    """Answers the n-th request with ``script[n]``: bytes to send then close, or None (close
    at once, without a byte: the dropped keep-alive connection)."""

    def __init__(self, script: list[bytes | None]) -> None:
        self.script = script
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n")
                      if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        answer = self.script[min(self.requests, len(self.script) - 1)]
        self.requests += 1
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        writer.close()


async def _serve(script: list[bytes | None]) -> tuple[Server, asyncio.Server, str]:
    s = Server(script)
    srv = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return s, srv, f"http://127.0.0.1:{port}/v1/completions"


async def _collect(events: AsyncIterator[dict[str, Any]]) -> list[str]:
    return [c["text"] for e in [e async for e in events] for c in e["choices"]]


def test_a_connection_dropped_before_any_answer_is_sent_again() -> None:
    async def go() -> tuple[list[str], int]:
        s, srv, url = await _serve([None, SSE_OK])
        async with srv, httpx.AsyncClient() as http:
            texts = await _collect(stream_events(http, url, {"prompt": [1, 2]}))
        return texts, s.requests

    texts, requests = asyncio.run(go())
    assert texts == ["a", "b"]
    assert requests == 2


def test_drops_past_the_attempts_raise_the_transport_error() -> None:
    async def go() -> int:
        s, srv, url = await _serve([None, None, None])
        async with srv, httpx.AsyncClient() as http:
            with pytest.raises(httpx.TransportError):
                await _collect(stream_events(http, url, {"prompt": [1]}, attempts=2))
        return s.requests

    assert asyncio.run(go()) == 2


def test_a_drop_after_the_answer_started_is_not_replayed() -> None:
    """Headers arrived, then the server died: the server was working on it; sending it
    again could run it twice, so the caller gets the error (and the server one request)."""
    async def go() -> int:
        s, srv, url = await _serve([CUT_OFF, SSE_OK])
        async with srv, httpx.AsyncClient() as http:
            with pytest.raises(httpx.TransportError):
                await _collect(stream_events(http, url, {"prompt": [1]}))
        return s.requests

    assert asyncio.run(go()) == 1


def test_a_status_other_than_200_names_the_server_and_is_not_retried() -> None:
    async def go() -> int:
        s, srv, url = await _serve([BUSY, SSE_OK])
        async with srv, httpx.AsyncClient() as http:
            with pytest.raises(UpstreamError, match="vLLM worker w1 answered 503: busy"):
                await _collect(stream_events(http, url, {"prompt": [1]}, what="vLLM worker w1"))
        return s.requests

    assert asyncio.run(go()) == 1
