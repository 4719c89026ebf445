"""The gateway's request handling: :class:`Gateway`, one method per endpoint and concern.

A completion goes ``proxy`` (the caller's tenant and validated body, :meth:`Gateway.read`;
an admission slot) -> ``forward`` (routed, :meth:`Gateway.route_body`; sent,
:func:`upstream.send`) -> a whole JSON reply (the worker's figures fed back to the cost model,
:meth:`Gateway.learn_prefill`) or a :class:`~kvshare.router.gateway.relay.StreamRelay`.
:func:`kvshare.router.gateway.app.create_app` registers the methods as the app's routes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvshare.asgi import unless_disconnected
from kvshare.auth import WorkerAuth, cluster_secret
from kvshare.router.core.embed import CacheAwareRouter, Routed, Tenant
from kvshare.router.core.policy import NoEligibleWorker
from kvshare.router.gateway import stream_resume, timing, upstream
from kvshare.router.gateway.admin_routes import checked_body, json_object
from kvshare.router.gateway.admission import Admission, AdmissionConfig
from kvshare.router.gateway.errors import Errors
from kvshare.router.gateway.forward import forward_body, is_engine
from kvshare.router.gateway.limits import Limits
from kvshare.router.gateway.relay import StreamRelay
from kvshare.router.gateway.requests import ChatRequest, CompletionRequest
from kvshare.router.gateway.upstream import Answer, Failure, Outgoing, Relay, Slot

NO_WORKER_POLL_S = 0.1
"""How often a request waiting for a worker of its namespace asks the router again (the
index's worker list itself refreshes at :class:`~kvshare.router.core.workers_view.IndexWorkers`' pace)."""


class Gateway:
    """The gateway around ``router`` (see :func:`kvshare.router.gateway.app.create_app` for the
    arguments). Every error it answers is counted (:class:`~kvshare.router.gateway.errors.Errors`).
    The HTTP client to the workers exists while :meth:`lifespan` is entered."""

    def __init__(self, router: CacheAwareRouter, api_keys: Mapping[str, Tenant] | None = None,
                 upstream_timeout_s: float = 300.0, limits: Limits | None = None,
                 worker_auth: WorkerAuth | None = None, admission: AdmissionConfig | None = None,
                 no_worker_wait_s: float = 10.0) -> None:
        if not 0 <= no_worker_wait_s < float("inf"):
            raise ValueError(f"no_worker_wait_s must be finite seconds >= 0, got {no_worker_wait_s}")
        self.router = router
        self.metrics = router.metrics
        self.errors = Errors(router.metrics)
        self.keys = dict(api_keys or {})
        self.limits = limits or Limits()
        self.admission = Admission(admission)
        if worker_auth is None:  # the connected cluster's workers' token, if any (kvshare.auth)
            worker_auth = WorkerAuth.from_secret(cluster_secret())
        self.to_worker = worker_auth.header()
        self.upstream_timeout_s = upstream_timeout_s
        self.no_worker_wait_s = no_worker_wait_s
        self._http: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        """The app's lifespan: the HTTP client to the workers, closed at the end."""
        http = self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.upstream_timeout_s, connect=5.0))
        try:
            yield
        finally:
            await http.aclose()

    @property
    def http(self) -> httpx.AsyncClient:
        """The HTTP client to the workers; only while the app runs (its lifespan)."""
        if self._http is None:
            raise RuntimeError("the gateway's HTTP client exists only while the app runs "
                               "(enter its lifespan: uvicorn, or `with TestClient(app)`)")
        return self._http

    # -- the caller and its body -----------------------------------------------------------

    def tenant_of(self, request: Request) -> Tenant | JSONResponse:
        """The tenant of the request's API key, or the 401; everyone is the operator
        (an admin tenant) on an open gateway (no keys)."""
        if not self.keys:
            return Tenant(admin=True)
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        tenant = self.keys.get(key)
        if tenant is None:
            return self.errors.fail(401, "invalid or missing API key (Authorization: Bearer <key>)",
                             "authentication_error", "invalid_api_key")
        return tenant

    async def models_served(self) -> list[str]:
        """The model names this gateway serves: its namespace and its workers' models."""
        infos, _ = await self.router.workers.snapshot()
        names = [self.router.config.namespace]
        for info in infos:
            for name in (info.meta.get("model"), *info.namespaces):
                if isinstance(name, str) and name and name not in names:
                    names.append(name)
        return names

    async def read(self, request: Request, chat: bool) -> tuple[Tenant, dict[str, Any]] | JSONResponse:
        """The caller's tenant and its validated body (auth, limits, schema, model)."""
        tenant = self.tenant_of(request)
        if isinstance(tenant, JSONResponse):
            return tenant
        body = await json_object(request, self.errors.fail, self.limits)
        if isinstance(body, JSONResponse):
            return body
        if chat and "messages" not in body:
            return self.errors.fail(400, "'messages' is required for chat completions")
        if not chat and "prompt" not in body:
            return self.errors.fail(400, "'prompt' is required for completions")
        checked = checked_body(ChatRequest if chat else CompletionRequest, body, self.limits,
                               self.errors.fail)
        if isinstance(checked, JSONResponse):
            return checked
        model = body.get("model")
        if model is not None and model not in (served := await self.models_served()):
            return self.errors.fail(404, f"the model {model!r} does not exist here: this gateway serves "
                                  f"{served} (GET /v1/models)", "not_found_error",
                             "model_not_found")
        return tenant, body

    async def route_body(self, body: dict[str, Any], tenant: Tenant,
                         chat: bool) -> Routed | JSONResponse:
        """``body`` routed for ``tenant``; while no worker serves its namespace, asked again
        every :data:`NO_WORKER_POLL_S` for up to ``no_worker_wait_s`` (then a 503); a 400 for
        a prompt the router cannot take."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        until = time.monotonic() + self.no_worker_wait_s
        ids: list[int] | None = None  # tokenized once, when it has to wait for a worker
        while True:
            try:
                if ids is not None:
                    return await self.router.route(token_ids=ids, tenant=tenant)
                if chat:
                    return await self.router.route(messages=body["messages"], tenant=tenant)
                return await self.router.route(prompt=prompt, tenant=tenant)
            except NoEligibleWorker as exc:
                if time.monotonic() >= until:
                    waited = (f" (waited {self.no_worker_wait_s:g} s for one)"
                              if self.no_worker_wait_s else "")
                    return self.errors.fail(503, f"{exc}{waited}", "service_unavailable", "no_worker")
                if ids is None:  # (each retry would tokenize the prompt again)
                    ids = (self.router.tokenize(messages=body["messages"]) if chat
                           else self.router.tokenize(prompt=prompt))
                await asyncio.sleep(min(NO_WORKER_POLL_S, max(0.0, until - time.monotonic())))
            except (ValueError, TypeError) as exc:
                return self.errors.fail(400, str(exc))

    # -- completions -----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self.proxy(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.proxy(request, "/v1/chat/completions", chat=True)

    async def proxy(self, request: Request, path: str, chat: bool) -> Response:
        """Read, admit and forward one completion; its admission slot is released when the
        answer is complete (a stream's, when the stream ends)."""
        t_in = time.perf_counter()
        got = await self.read(request, chat)
        if isinstance(got, JSONResponse):
            return got
        tenant, body = got
        body_s = time.perf_counter() - t_in  # the breakdown's "parse" stage
        refusal = self.admission.enter(tenant.name, tenant.max_inflight)
        if refusal is not None:
            return self.errors.busy(refusal.message, "too_many_requests", refusal.retry_after_s)
        slot = Slot(lambda: self.admission.leave(tenant.name))
        try:
            answer = await self.forward(request, path, chat, tenant, body, slot, body_s)
        finally:
            if not slot.handed_over:
                slot.release()
        return answer

    async def forward(self, request: Request, path: str, chat: bool, tenant: Tenant,
                      body: dict[str, Any], slot: Slot, parse_s: float) -> Response:
        """Route ``body`` and send it (:func:`upstream.send`); 499 when the client went away,
        the gateway's error when no worker answered."""
        routed = await self.route_body(body, tenant, chat)
        if isinstance(routed, JSONResponse):
            return routed
        routed.timings["parse"] = parse_s
        seconds = body.get("deadline_s") or self.admission.config.default_deadline_s

        def body_for(r: Routed, deadline_s: float) -> dict[str, Any]:
            # the worker as routed: a snapshot taken now may have lost it (a lapsed lease)
            return forward_body(body, r, r.info, chat, deadline_s)

        out = Outgoing(path, self.to_worker, bool(body.get("stream")),
                       time.monotonic() + float(seconds), body_for)
        t_send = time.perf_counter()
        answered, outcome = await unless_disconnected(
            request, upstream.send(self.http, self.router, routed, out))
        if not answered or outcome is None:
            self.errors.gone()
            return Response(status_code=499)  # the client went away: the worker was told
        if isinstance(outcome, Failure):
            if outcome.status == 429:
                return self.errors.busy(outcome.message, outcome.code, outcome.retry_after_s or 1)
            return self.errors.fail(outcome.status, outcome.message, "upstream_error", outcome.code)
        outcome.routed.timings.setdefault("parse", parse_s)  # another worker's after a retry
        d = outcome.routed.decision
        headers = {"x-kvshare-worker": d.worker, "x-kvshare-reason": d.reason,
                   "x-kvshare-tries": str(outcome.tries)}
        first_s = time.perf_counter() - t_send  # to the whole body, or a stream's first chunk
        if outcome.rest is None:
            return self.whole(outcome, headers, t_send)
        return self.stream(outcome, out, body, headers, slot, first_s, t_send)

    def whole(self, answer: Answer, headers: dict[str, str], t_send: float) -> Response:
        """A non-streamed answer, as the worker sent it (with the breakdown when a 200)."""
        self.router.finished(answer.routed.request_id)
        raw, resp = answer.body, answer.response
        if resp.status_code == 200:
            raw = self.learn_prefill(raw, answer.routed, time.perf_counter() - t_send)
        ctype = resp.headers.get("content-type", "application/json")
        return Response(raw, resp.status_code, headers=headers, media_type=ctype)

    def learn_prefill(self, raw: bytes, routed: Routed, upstream_s: float) -> bytes:
        """Feed the worker's measured prefill (its ``kvshare`` stats) back to the cost model;
        returns the reply with the request's TTFT breakdown in it (:mod:`kvshare.router.gateway.timing`)."""
        try:
            data = json.loads(raw)
        except ValueError:
            return raw  # not JSON: passed on as it came
        if not isinstance(data, dict):
            return raw
        kv = data.get("kvshare")
        try:
            if isinstance(kv, dict):
                self.router.recent.finish(routed.request_id, kv)
                self.router.observe_prefill(int(kv.get("computed_tokens", 0)),
                                            int(kv.get("reused_tokens", 0)),
                                            float(kv.get("prefill_s", 0.0)))
        except (ValueError, TypeError, AttributeError):
            pass  # not a kvshare worker: nothing to learn
        timing.observe(self.metrics.ttft_stages, timing.json_reply(data, routed.timings, upstream_s))
        return json.dumps(data).encode()

    def stream(self, answer: Answer, out: Outgoing, body: dict[str, Any], headers: dict[str, str],
               slot: Slot, first_s: float, t_send: float) -> Response:
        """A streamed answer: the gateway's stages in ``x-kvshare-breakdown``, the events
        relayed by a :class:`StreamRelay`, which takes over ``slot``."""
        stages = timing.stream_stages(answer.routed.timings, first_s)
        headers["x-kvshare-breakdown"] = timing.header(stages)
        vllm = is_engine(answer.routed.info)
        if vllm:  # no worker stages will come: what the gateway saw is the whole breakdown
            timing.observe(self.metrics.ttft_stages, stages)
        relay = StreamRelay(self.router, self.http, out, answer, slot, stages=stages, vllm=vllm,
                            resumable=stream_resume.resumable(body, greedy_worker=not vllm),
                            t_send=t_send)
        return Relay(relay.events(), relay.close, media_type="text/event-stream", headers=headers)

    # -- the other endpoints ---------------------------------------------------------------

    async def route(self, request: Request) -> Response:
        """Decision only. Body: ``{"prompt": ...}`` or ``{"messages": [...]}``. The answer
        has the decision and ``candidates``: every eligible worker's estimate (``worker``,
        ``est_ttft_s``, ``queue_s``, ``reason``), chosen first, then best first (empty for a
        fallback without a ranking); near-ties (within the policy's tie) are rotated, so two
        routers may choose differently among them."""
        probe = await json_object(request, self.errors.fail, self.limits)
        if isinstance(probe, JSONResponse):
            return probe
        chat = "messages" in probe
        got = await self.read(request, chat)
        if isinstance(got, JSONResponse):
            return got
        tenant, body = got
        routed = await self.route_body(body, tenant, chat)
        if isinstance(routed, JSONResponse):
            return routed
        self.router.finished(routed.request_id)  # nothing was sent: not in flight
        estimates = routed.ranking.estimates() if routed.ranking is not None else []
        return JSONResponse({
            **routed.decision.to_dict(), "request_id": routed.request_id,
            "tenant": routed.tenant.name, "namespace": routed.namespace,
            "num_tokens": len(routed.token_ids), "num_blocks": len(routed.hashes),
            "index_s": routed.index_s, "fallback": routed.fallback,
            "candidates": [{"worker": e.worker, "est_ttft_s": e.est_ttft_s, "queue_s": e.queue_s,
                            "reason": e.reason} for e in estimates],
        })

    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvshare"}
            for name in await self.models_served()]})

    async def health(self) -> Response:
        """Liveness for load balancers (no key needed). An open gateway (no API keys: everyone
        is the operator) also lists its workers' endpoints, where ``kvshare bench`` reads their
        counters; a gateway with keys does not show them to unauthenticated callers."""
        infos, _ = await self.router.workers.snapshot()
        body: dict[str, Any] = {
            "status": "ok" if infos else "no_workers", "workers": len(infos),
            "index": self.router.index is not None, "policy": self.router.policy.name,
            "decisions": self.router.decisions, "fallbacks": self.router.fallbacks,
        }
        if not self.keys:
            body["endpoints"] = sorted({i.endpoint for i in infos if i.endpoint})
        return JSONResponse(body, status_code=200 if infos else 503)

    async def prom(self) -> Response:
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")
