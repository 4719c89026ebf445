"""Limits on what a gateway request may carry, checked before anything else happens.

- **Body size** (:class:`BodyLimit`, ASGI middleware): a ``Content-Length`` over
  ``Limits.max_body_bytes`` is refused with 413 before a byte is read; a chunked body is
  counted as it arrives and refused with 413 as soon as it passes the limit, so a huge prompt
  never sits in the gateway's memory.
- **JSON** (:func:`read_json`): ``NaN``/``Infinity`` literals are refused (they are not JSON,
  and ``ttl_s: Infinity`` must not reach a pin); nesting deeper than ``Limits.max_depth`` is a
  400, also for a body deep enough to exhaust the parser's recursion.
- **Numbers, lengths, kinds**: the request models of :mod:`kvshare.router.gateway.requests`, validated before
  any routing or admin call, so a rejected request changes nothing.

Every refusal is an OpenAI-style error naming what to fix.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Bounds on gateway input. ``max_body_bytes``: request body (413 past it); ``max_depth``:
    JSON nesting of objects and arrays (400 past it); ``max_tokens``: the largest completion a
    request may ask for (the worker bounds it again by its model's context); ``max_ttl_s`` /
    ``max_deadline_s``: admin pin lifetime and prefetch deadline."""

    max_body_bytes: int = 8 * MiB
    max_depth: int = 32
    max_tokens: int = 131_072
    max_ttl_s: float = 30 * 86_400.0
    max_deadline_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.max_depth < 4 or self.max_tokens < 1:
            raise ValueError("limits too small: need max_body_bytes >= 1024, max_depth >= 4, "
                             "max_tokens >= 1")
        if not 0 < self.max_ttl_s < float("inf") or not 0 < self.max_deadline_s < float("inf"):
            raise ValueError("max_ttl_s and max_deadline_s must be finite positive seconds")


class BadRequest(ValueError):
    """Input refused: ``status`` (400, 413) and a message that says what to fix."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def _no_constant(name: str) -> float:
    raise BadRequest(f"{name} is not a JSON number: send a finite number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BadRequest(f"the number {text[:40]} is too large: send a finite number")
    return value


def depth_of(value: Any, limit: int) -> int:
    """Nesting depth of arrays/objects in ``value`` (iterative; stops counting past ``limit``)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        # C-level filter: a list of 8k token ids must not cost a Python step per id
        stack.extend(zip(compress(children, map(isinstance, children, repeat((dict, list)))),
                         repeat(d + 1)))
    return deepest


def parse_json(raw: bytes, limits: Limits) -> Any:
    """``raw`` as JSON within ``limits``; :class:`BadRequest` says what is wrong."""
    if len(raw) > limits.max_body_bytes:
        raise BadRequest(f"the request body is {len(raw)} bytes, over the limit of "
                         f"{limits.max_body_bytes}", 413)
    try:
        value = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise BadRequest(f"the JSON body is nested too deeply (limit {limits.max_depth})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body must be valid JSON") from None
    if depth_of(value, limits.max_depth) > limits.max_depth:
        raise BadRequest(f"the JSON body is nested deeper than {limits.max_depth} levels")
    return value


async def read_json(request: Any, limits: Limits) -> Any:
    """The body of a Starlette ``request`` parsed by :func:`parse_json`."""
    return parse_json(await request.body(), limits)


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 on_reject: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject  # told the status of each refusal (metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, f"{int(declared)} bytes")
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        from starlette.responses import JSONResponse

        message = (f"the request body is {size}, over the limit of {self.max_bytes} bytes: "
                   "send a shorter prompt")
        body = {"error": {"message": message, "type": "invalid_request_error",
                          "param": None, "code": "request_too_large"}}
        if self.on_reject is not None:
            self.on_reject(413)
        await JSONResponse(body, status_code=413)(scope, receive, send)


class _TooLarge(Exception):
    pass
