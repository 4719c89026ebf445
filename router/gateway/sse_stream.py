"""One streamed OpenAI completion over HTTP, retried while nothing of it has arrived.

A pooled keep-alive connection can be closed by the server (uvicorn closes idle ones after 5
s) just as a request is sent on it: httpx then raises a ``TransportError`` (``ReadError``,
``RemoteProtocolError``) before any byte of the answer, and the request is lost although the
server never saw it or, if it did, aborts it once the connection is gone. :func:`stream_events`
sends such a request again, on a new connection, up to ``attempts`` times; once any byte of the
answer has arrived, an error is the caller's (a half-streamed answer cannot be replayed).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx

log = logging.getLogger(__name__)


class UpstreamError(RuntimeError):
    """The server answered with a status other than 200 (the message has its body)."""


async def stream_events(http: httpx.AsyncClient, url: str, body: Mapping[str, Any], *,
                        attempts: int = 2, what: str = "server") -> AsyncIterator[dict[str, Any]]:
    """POST ``body`` to ``url`` and yield every ``data:`` event of its SSE answer, parsed
    (``[DONE]`` ends it). A transport error before the answer's first byte is retried (module
    docstring); a non-200 status raises :class:`UpstreamError` naming ``what``."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        received = False
        try:
            async with http.stream("POST", url, json=dict(body)) as resp:
                received = True
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode("utf-8", "replace")[:500]
                    raise UpstreamError(f"{what} answered {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        return
                    yield json.loads(line[6:])
            return
        except httpx.TransportError as exc:
            if received or attempt == attempts:
                raise
            log.info("%s dropped the connection before answering (%r); sending again", what, exc)
