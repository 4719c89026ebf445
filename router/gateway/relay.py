"""Relaying one streamed answer to the client, resumed on another worker if its worker dies.

:class:`StreamRelay` owns a streamed request from the worker's first chunk to its end. What
the client receives, in order:

- complete server-sent events as they arrive (an unfinished one waits for its separator);
  a vLLM stream's usage event gets the gateway's stages (:func:`timing.usage_events`);
- from the event carrying the worker's ``kvshare`` figures on, nothing until the stream ends:
  that tail is sent at the end with the TTFT breakdown joined into the figures' event
  (:func:`timing.stream_tail`);
- past the request's deadline (plus :data:`upstream.DEADLINE_GRACE_S`): what is buffered,
  then ``data: [DONE]``;
- a worker that fails mid-stream (an ``httpx.HTTPError``) on a resumable request
  (:func:`stream_resume.resumable`) is replaced once: the request is routed again without it
  and the new stream is relayed from where the client is (:class:`stream_resume.Skip`);
- when it cannot be resumed (sampled, no other worker, a second failure, or
  :class:`stream_resume.Diverged`): an in-band error event, then ``data: [DONE]``.

:meth:`StreamRelay.close` must run however the response ends (``upstream.Relay`` runs it):
it closes the live upstream response (a worker stops generating when its stream is closed),
finishes the request in the router and releases the admission slot.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

import httpx

from kvshare.router.core.embed import CacheAwareRouter, Routed
from kvshare.router.core.policy import NoEligibleWorker
from kvshare.router.gateway import timing, upstream
from kvshare.router.gateway.stream_resume import Delivered, Diverged, Skip
from kvshare.router.gateway.upstream import Answer, Failure, Outgoing, Slot

log = logging.getLogger(__name__)
_SEP = b"\n\n"
_FIGURES = b'"kvshare"'  # the worker's figures event: held back from here to the end
_DONE = b"data: [DONE]\n\n"


class StreamRelay:
    """One streamed answer's relay (module docstring). Built from the first worker's
    :class:`~kvshare.router.gateway.upstream.Answer` (its first chunk arrived, nothing was sent
    to the client yet); takes over ``slot``. Iterate :meth:`events` once, then :meth:`close`."""

    def __init__(self, router: CacheAwareRouter, http: httpx.AsyncClient, out: Outgoing,
                 answer: Answer, slot: Slot, *, stages: dict[str, float], vllm: bool,
                 resumable: bool, t_send: float) -> None:
        """``stages``: the gateway's breakdown when the first chunk arrived; ``vllm``: the
        worker reports no figures of its own; ``resumable``: the request may be sent again
        mid-stream; ``t_send``: ``time.perf_counter()`` when it was first sent."""
        assert answer.rest is not None, "a streamed answer"
        self._router = router
        self._http = http
        self._out = out
        self._slot = slot
        slot.handed_over = True  # released by close()
        self._first = answer.first
        self.stages = stages
        self.vllm = vllm
        self.resumable = resumable
        self.t_send = t_send
        # the worker streaming now (another after a resume), its response and unread chunks
        self.live: Routed = answer.routed
        self.response: httpx.Response = answer.response
        self.rest: AsyncIterator[bytes] = answer.rest
        self.skip: Skip | None = None  # filters the resumed stream; set by the one resume
        self.delivered = Delivered()  # what the client was sent
        self.buf = b""  # received, not yet a complete event (before the figures' event)
        self.tail: list[bytes] = []  # from the figures' event on: sent at the end
        self.upstream_s = 0.0  # seconds from sending to the figures' event

    async def events(self) -> AsyncIterator[bytes]:
        """The bytes to send the client, in the order the module docstring gives."""
        self._router.prefilled(self.live.request_id)
        chunk = self._first
        while True:
            try:
                if self.tail:
                    self.tail.append(chunk)
                else:
                    self.buf += chunk
                    at = self.buf.find(_FIGURES)
                    cut = self.buf.rfind(_SEP, 0, at if at >= 0 else len(self.buf))
                    if cut >= 0:
                        yield self._sent(self.buf[:cut + 2])
                        self.buf = self.buf[cut + 2:]
                    if at >= 0:
                        self.upstream_s = time.perf_counter() - self.t_send
                        self.tail, self.buf = [self.buf], b""
                if time.monotonic() > self._out.deadline + upstream.DEADLINE_GRACE_S:
                    yield b"".join([self.buf, *self.tail]) + _DONE
                    return
                chunk = await self._next()
            except StopAsyncIteration:
                yield self._end()
                return
            except (httpx.HTTPError, Diverged) as exc:
                first = await self._resume(exc) if isinstance(exc, httpx.HTTPError) else None
                if first is not None:  # what was not sent is sent again by the other worker
                    self.buf, self.tail, chunk = b"", [], first
                    continue
                yield self._failed(exc)
                return

    async def close(self) -> None:
        """Close the live response, finish the request in the router, release the slot."""
        await self.response.aclose()
        self._router.finished(self.live.request_id)
        self._slot.release()

    async def _next(self) -> bytes:
        """The live stream's next chunk (filtered after a resume); raises
        ``StopAsyncIteration`` at its end, ``httpx.HTTPError`` or :class:`Diverged`."""
        chunk = await self.rest.__anext__()
        if self.skip is not None:
            chunk = self.skip.feed(chunk)
        return chunk

    def _sent(self, events: bytes) -> bytes:
        """Complete ``events`` as the client gets them, recorded as delivered."""
        data = timing.usage_events(events, self.stages) if self.vllm else events
        self.delivered.sent(data)
        return data

    def _end(self) -> bytes:
        """What is left to send when the live stream ended: the buffer, or the tail with the
        breakdown joined in (observed, and recorded in the router's recent requests)."""
        if self.skip is not None:  # a last event with no separator
            if self.tail:
                self.tail.append(self.skip.flush())
            else:
                self.buf += self.skip.flush()
        if not self.tail:
            return timing.usage_events(self.buf, self.stages) if self.vllm else self.buf
        end, breakdown = timing.stream_tail(b"".join(self.tail), self.live.timings,
                                            self.upstream_s)
        self._router.recent.finish_stream(self.live.request_id, end)
        if breakdown is not None:
            timing.observe(self._router.metrics.ttft_stages, breakdown)
        return end

    def _failed(self, exc: Exception) -> bytes:
        """The in-band error event ending a stream that could not go on."""
        if isinstance(exc, Diverged):
            log.warning("resumed stream of %s diverged: %s", self.live.request_id, exc)
        event = {"error": {"message": f"worker {self.live.decision.worker} failed "
                                      f"mid-stream ({type(exc).__name__})",
                           "type": "upstream_error", "code": "worker_failed"}}
        return f"data: {json.dumps(event)}\n\n".encode() + _DONE

    async def _resume(self, exc: httpx.HTTPError) -> bytes | None:
        """The live worker died mid-stream: send the request to another one and return the
        first of its events past what the client has (None: it cannot be resumed). The dead
        worker's response is closed and finished either way."""
        metrics = self._router.metrics
        dead = self.live.decision.worker
        metrics.upstream.labels(dead, "dropped_mid_stream").inc()
        await self.response.aclose()
        self._router.finished(self.live.request_id)
        if not self.resumable or self.skip is not None:  # sampled, or already resumed once
            return None
        try:
            again = await self._router.route(token_ids=self.live.token_ids,
                                             tenant=self.live.tenant, exclude=[dead])
        except NoEligibleWorker:
            return None
        answer = await upstream.send(self._http, self._router, again, self._out)
        if isinstance(answer, Failure):
            return None
        if answer.rest is None or answer.response.status_code != 200:
            await answer.response.aclose()
            self._router.finished(answer.routed.request_id)
            return None
        self.live, self.response, self.rest = answer.routed, answer.response, answer.rest
        self._router.prefilled(self.live.request_id)
        metrics.upstream.labels(self.live.decision.worker, "resumed_mid_stream").inc()
        self.skip = Skip(self.delivered)
        log.info("stream of %s resumed on %s after %s died (%s)", self.live.request_id,
                 self.live.decision.worker, dead, type(exc).__name__)
        return self.skip.feed(answer.first)
