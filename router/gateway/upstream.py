"""Sending a routed request to a worker, and to another one while nothing reached the client.

:func:`send` POSTs the request to the routed worker. Until the client has been sent a byte,
every failure is retried on another worker (routed again, excluding those tried; the cache is
advisory, so the other worker recomputes and answers the same): a refused or dropped
connection (the worker is marked down), a worker that died before answering or before its
first streamed chunk, a 5xx, a 429 (its queue is full), and a worker whose registration
lapsed while the gateway waited for its answer (``lapsed``: its host's link is down or its
node died, so nothing would come back before the request's deadline; the routers' worker list,
checked every :data:`LAPSE_CHECK_S`, no longer has it). At most ``max_tries`` workers are
tried. A request a fault displaced (its worker died or failed) is not bounced when the workers
left are full: it waits for a queue slot on them (backing off up to their ``Retry-After``,
within its deadline), as it would have waited in the dead worker's queue. What comes back is
an :class:`Answer` (a non-streaming body read whole, or a stream whose first chunk has
arrived) or a :class:`Failure` with the status the gateway answers: 429 with ``Retry-After``
when every worker tried was full (backpressure on a request no fault touched), 502 when none
could answer, 504 when the request's deadline passed first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from starlette.responses import StreamingResponse

from kvshare.router.core.embed import CacheAwareRouter, Routed
from kvshare.router.core.policy import NoEligibleWorker
from kvshare.types import WorkerId

DEADLINE_GRACE_S = 2.0  # the worker ends at the deadline itself; the gateway waits this longer
FIRST_WAIT_S = 0.05  # a displaced request's first wait for a full worker; it doubles up to Retry-After
T = TypeVar("T")
LAPSE_CHECK_S = 0.25  # how often a request waiting for a worker checks it is still registered


@dataclass
class Answer:
    """A worker's answer: ``body`` (non-streaming, read whole) or an open ``response`` whose
    first chunk is ``first`` and whose rest is ``rest`` (streaming)."""

    routed: Routed
    response: httpx.Response
    body: bytes = b""
    first: bytes = b""
    rest: AsyncIterator[bytes] | None = None
    tries: int = 1


@dataclass(frozen=True)
class Failure:
    """No worker answered: the gateway's status, message, code and ``Retry-After`` (429)."""

    status: int
    message: str
    code: str
    retry_after_s: int | None = None
    tried: tuple[WorkerId, ...] = field(default=())


@dataclass(frozen=True)
class Outgoing:
    """How to build the request for a worker: the path, headers, whether it streams, the
    deadline (``time.monotonic()``) and ``body_for(routed, deadline_s)``, the JSON to POST."""

    path: str
    headers: Mapping[str, str]
    stream: bool
    deadline: float
    body_for: Callable[[Routed, float], dict[str, Any]]


async def send(http: httpx.AsyncClient, router: CacheAwareRouter, routed: Routed,
               out: Outgoing, max_tries: int = 3) -> Answer | Failure:
    """See the module docstring. Each failed try is finished in the router (its in-flight load
    released) and counted in ``kvshare.router.core.metrics.upstream``."""
    tried: list[WorkerId] = []  # every try, in order (a full worker once per try)
    failed: list[WorkerId] = []  # workers that failed (down, dropped, 5xx): not tried again
    full: dict[WorkerId, int] = {}  # workers that answered 429 since the last wait: Retry-After
    wait_s = FIRST_WAIT_S
    last = ""
    while True:
        d = routed.decision
        left = out.deadline - time.monotonic()
        if left <= 0:
            return Failure(504, "the request's deadline passed before a worker answered",
                           "deadline_exceeded", tried=tuple(tried))
        try:
            outcome = (await unless_lapsed(router, d.worker, _try(http, routed, out, left))
                       or ("lapsed", 0))
        except BaseException:  # cancelled (the client went away): not in flight any more
            router.finished(routed.request_id)
            raise
        if isinstance(outcome, Answer):
            outcome.tries = len(tried) + 1
            router.metrics.upstream.labels(d.worker, str(outcome.response.status_code)).inc()
            return outcome
        reason, retry_after = outcome
        router.finished(routed.request_id)
        router.metrics.upstream.labels(d.worker, reason).inc()
        tried.append(d.worker)
        if reason == "timeout":
            return Failure(504, f"worker {d.worker} did not answer within the request's deadline",
                           "deadline_exceeded", tried=tuple(tried))
        if reason == "unreachable":
            router.mark_down(d.worker)  # refused the connection: avoid it for a while
        if reason == "429":
            full[d.worker] = retry_after
        else:
            failed.append(d.worker)
        last = reason
        try:
            if len(failed) + len(full) >= max_tries:
                raise NoEligibleWorker("tries exhausted")
            routed = await router.route(token_ids=routed.token_ids, tenant=routed.tenant,
                                        exclude=[*failed, *full])
            continue
        except NoEligibleWorker:
            pass
        if full and failed:  # displaced by a fault: wait for a slot on the full ones
            pause = min(wait_s, max(full.values()), out.deadline - time.monotonic())
            if pause > 0:
                await asyncio.sleep(pause)
                wait_s *= 2
                full.clear()
                try:
                    routed = await router.route(token_ids=routed.token_ids,
                                                tenant=routed.tenant, exclude=failed)
                    continue
                except NoEligibleWorker:
                    pass
        if full and not failed:
            return Failure(429, f"every worker tried is at its queue limit ({sorted(full)}): "
                                "retry shortly", "workers_busy", max(full.values()),
                           tuple(tried))
        return Failure(502, f"no worker could answer (tried {sorted(set(tried))}, last: {last})",
                       "worker_unreachable", tried=tuple(tried))


async def unless_lapsed(router: CacheAwareRouter, worker: WorkerId,
                        answer: Awaitable[T]) -> T | None:
    """``answer``, or None (``answer`` cancelled) once ``worker`` is no longer among the
    router's workers: its lease lapsed while its answer was awaited (its host cut off or
    dead, so the answer would come late or never)."""
    task = asyncio.ensure_future(answer)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LAPSE_CHECK_S)
            if done:
                return task.result()
            infos, _ = await router.workers.snapshot()
            if infos and all(i.worker_id != worker for i in infos):
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # (its response closed)
                return None
    finally:
        if not task.done():  # this request was cancelled (the client went away)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _try(http: httpx.AsyncClient, routed: Routed, out: Outgoing,
               left: float) -> Answer | tuple[str, int]:
    """One worker's answer, or why it gave none (``unreachable``, ``dropped``, ``timeout``,
    ``429`` with its Retry-After, ``5xx`` status) while nothing reached the client."""
    d = routed.decision
    timeout = httpx.Timeout(left + DEADLINE_GRACE_S, connect=min(5.0, left + DEADLINE_GRACE_S))
    request = http.build_request("POST", f"{d.endpoint}{out.path}", json=out.body_for(routed, left),
                                 headers=dict(out.headers), timeout=timeout)
    try:
        resp = await http.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout):
        return "unreachable", 0
    except httpx.TimeoutException:
        return "timeout", 0
    except httpx.TransportError:
        return "dropped", 0
    try:
        if resp.status_code == 429 or resp.status_code >= 500:
            status = resp.status_code
            await resp.aclose()
            return str(status), _retry_after(resp)
        if resp.status_code != 200 or not out.stream:
            body = await resp.aread()
            await resp.aclose()
            return Answer(routed, resp, body=body)
        rest = resp.aiter_raw()
        first = await rest.__anext__()  # nothing is sent on until the worker sent something
        return Answer(routed, resp, first=first, rest=rest)
    except StopAsyncIteration:
        await resp.aclose()
        return "dropped", 0
    except httpx.TimeoutException:
        await resp.aclose()
        return "timeout", 0
    except httpx.TransportError:
        await resp.aclose()
        return "dropped", 0
    except BaseException:
        await resp.aclose()
        raise


def _retry_after(resp: httpx.Response) -> int:
    value = resp.headers.get("retry-after", "")
    return int(value) if value.isdigit() else 1


class Slot:
    """An admitted request's hold on its admission slot: :meth:`release` frees it once; a
    streaming response takes it over (``handed_over``) and releases it when it ends."""

    def __init__(self, free: Callable[[], None]) -> None:
        self._free: Callable[[], None] | None = free
        self.handed_over = False

    def release(self) -> None:
        free, self._free = self._free, None
        if free is not None:
            free()


class Relay(StreamingResponse):
    """A streamed answer whose ``cleanup`` runs however the response ends: finished, the
    client gone (Starlette cancels the body), or never started."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.cleanup()
