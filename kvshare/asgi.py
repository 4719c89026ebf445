"""ASGI helpers the worker server and the gateway share: noticing that the client went away.

A Starlette ``StreamingResponse`` already stops its body when the client disconnects; a plain
response does not, so a client that gives up on a long non-streaming completion would keep
the engine busy. :func:`unless_disconnected` runs the work next to a watch on the request's
ASGI ``receive`` (after the body was read it returns only ``http.disconnect``) and cancels the
work as soon as the client is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


def serve(app: Any, hosts: list[str], port: int, log_level: str = "warning") -> None:
    """Run ``app`` with uvicorn on every address of ``hosts`` at ``port`` until stopped
    (:func:`kvshare.addresses.bind_listeners`)."""
    import uvicorn

    from kvshare.addresses import bind_listeners

    socks = bind_listeners(hosts, port)
    uvicorn.Server(uvicorn.Config(app, log_level=log_level)).run(sockets=socks)


async def until_disconnected(request: Any) -> None:
    """Return once the client of ``request`` (a Starlette request whose body was read) is gone."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def unless_disconnected(request: Any, work: Awaitable[T]) -> tuple[bool, T | None]:
    """``(True, result)`` of ``work``, or ``(False, None)`` when the client disconnected first
    (``work`` is then cancelled: an upstream call closes its connection)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        finished = task.done()
        if not finished:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if not finished:
        return False, None
    return True, task.result()
