"""OpenAI-compatible cache-aware gateway (FastAPI): route with CacheAwareRouter, proxy to workers.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` is
passed through as server-sent events), ``POST /v1/route`` (the decision only, for other
gateways), ``POST /v1/kvshare/lookup|pin|unpin|prefetch`` (admin, :mod:`kvshare.router.gateway.admin_routes`;
``--address`` only), ``GET /dashboard`` (the live page, :mod:`kvshare.router.web`), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text). ``kvshare gateway``: :mod:`kvshare.router.gateway.cli`.

The gateway tokenizes once and forwards the body plus ``kvshare: {token_ids, namespace,
hashes_hex, tenant[, cache_salt]}``, so the worker never re-tokenizes. API keys
(``Authorization: Bearer KEY``, :mod:`kvshare.router.gateway.api_keys`) map to tenants; a tenant's salt roots its block hashes, so one
tenant can never be routed by, or hit, another's blocks. With no keys configured every request
is tenant ``default``. Errors are OpenAI-style JSON (``{"error": {message, type, code}}``)
with 4xx codes for bad input, 401 for a bad key, 502/503 when no worker can answer; never a
traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvshare.asgi import unless_disconnected
from kvshare.auth import WorkerAuth, cluster_secret
from kvshare.router.core.embed import CacheAwareRouter, Routed, Tenant
from kvshare.router.core.policy import NoEligibleWorker
from kvshare.router.gateway import stream_resume, timing, upstream
from kvshare.router.gateway.admin_routes import add_admin_routes, checked_body, json_object
from kvshare.router.gateway.admission import Admission, AdmissionConfig
from kvshare.router.gateway.api_keys import (
    load_api_keys as load_api_keys,  # re-exported: the old home
)
from kvshare.router.gateway.api_keys import parse_api_keys as parse_api_keys
from kvshare.router.gateway.forward import forward_body, is_vllm
from kvshare.router.gateway.limits import BodyLimit, Limits
from kvshare.router.gateway.requests import (
    AdminRequest,
    ChatRequest,
    CompletionRequest,
    RouteRequest,
    document,
)
from kvshare.router.gateway.upstream import Failure, Outgoing, Relay, Slot
from kvshare.router.web import add_web_routes

log = logging.getLogger(__name__)
_FORWARD_HEADERS = ("content-type", "cache-control")
NO_WORKER_POLL_S = 0.1
"""How often a request waiting for a worker of its namespace asks the router again (the
index's worker list itself refreshes at :class:`~kvshare.router.core.workers_view.IndexWorkers`' pace)."""


def error(status: int, message: str, etype: str = "invalid_request_error", code: str | None = None,
          param: str | None = None) -> JSONResponse:
    """An OpenAI-style error response."""
    body = {"error": {"message": message, "type": etype, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def create_app(
    router: CacheAwareRouter,
    api_keys: Mapping[str, Tenant] | None = None,
    upstream_timeout_s: float = 300.0,
    admin: Any | None = None,
    limits: Limits | None = None,
    worker_auth: WorkerAuth | None = None,
    admission: AdmissionConfig | None = None,
    no_worker_wait_s: float = 10.0,
) -> FastAPI:
    """The gateway app around ``router``; ``api_keys`` empty = open (tenant ``default``);
    ``admin`` (an :class:`kvshare.actors.admin.ClusterAdmin`) serves ``/v1/kvshare/*`` (501 without);
    ``limits`` bound every request body (:mod:`kvshare.router.gateway.limits`, :mod:`kvshare.router.gateway.requests`);
    ``admission`` bounds requests in flight, in all and per tenant (:mod:`kvshare.router.gateway.admission`).
    A request that finds no worker serving its namespace waits up to ``no_worker_wait_s`` for
    one to appear (workers still starting, a lease that lapsed on a loaded host and is being
    renewed) before its 503, as Ray Serve holds requests while it has no replica."""
    if not 0 <= no_worker_wait_s < float("inf"):
        raise ValueError(f"no_worker_wait_s must be finite seconds >= 0, got {no_worker_wait_s}")
    keys = dict(api_keys or {})
    limits = limits or Limits()
    gate = Admission(admission)
    if worker_auth is None:  # the connected cluster's workers' token, if any (kvshare.auth)
        worker_auth = WorkerAuth.from_secret(cluster_secret())
    to_worker = worker_auth.header()
    state: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state["http"] = httpx.AsyncClient(timeout=httpx.Timeout(upstream_timeout_s, connect=5.0))
        try:
            yield
        finally:
            await state["http"].aclose()

    app = FastAPI(title="kvshare gateway", lifespan=lifespan)
    app.state.router = router
    app.state.admission = gate
    metrics = router.metrics

    def fail(status: int, message: str, etype: str = "invalid_request_error",
             code: str | None = None) -> JSONResponse:
        metrics.errors.labels(str(status)).inc()
        return error(status, message, etype, code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return fail(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        etype = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        answer = fail(exc.status_code, str(exc.detail), etype)
        answer.headers.update(exc.headers or {})  # 405 keeps its Allow
        return answer

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("gateway error")
        return fail(500, f"internal gateway error ({type(exc).__name__})", "server_error")

    def tenant_of(request: Request) -> Tenant | JSONResponse:
        if not keys:
            return Tenant(admin=True)  # an open gateway (no --api-keys): everyone is the operator
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        tenant = keys.get(key)
        if tenant is None:
            return fail(401, "invalid or missing API key (Authorization: Bearer <key>)",
                        "authentication_error", "invalid_api_key")
        return tenant

    async def models_served() -> list[str]:
        """The model names this gateway serves: its namespace and its workers' models."""
        infos, _ = await router.workers.snapshot()
        names = [router.config.namespace]
        for info in infos:
            for name in (info.meta.get("model"), *info.namespaces):
                if isinstance(name, str) and name and name not in names:
                    names.append(name)
        return names

    async def read(request: Request, chat: bool) -> tuple[Tenant, dict[str, Any]] | JSONResponse:
        """The caller's tenant and its validated body (auth, limits, schema, model)."""
        tenant = tenant_of(request)
        if isinstance(tenant, JSONResponse):
            return tenant
        body = await json_object(request, fail, limits)
        if isinstance(body, JSONResponse):
            return body
        if chat and "messages" not in body:
            return fail(400, "'messages' is required for chat completions")
        if not chat and "prompt" not in body:
            return fail(400, "'prompt' is required for completions")
        checked = checked_body(ChatRequest if chat else CompletionRequest, body, limits, fail)
        if isinstance(checked, JSONResponse):
            return checked
        model = body.get("model")
        if model is not None and model not in (served := await models_served()):
            return fail(404, f"the model {model!r} does not exist here: this gateway serves "
                             f"{served} (GET /v1/models)", "not_found_error", "model_not_found")
        return tenant, body

    async def route_body(body: dict[str, Any], tenant: Tenant, chat: bool) -> Routed | JSONResponse:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        until = time.monotonic() + no_worker_wait_s
        ids: list[int] | None = None  # tokenized once, when it has to wait for a worker
        while True:
            try:
                if ids is not None:
                    return await router.route(token_ids=ids, tenant=tenant)
                if chat:
                    return await router.route(messages=body["messages"], tenant=tenant)
                return await router.route(prompt=prompt, tenant=tenant)
            except NoEligibleWorker as exc:
                if time.monotonic() >= until:
                    waited = f" (waited {no_worker_wait_s:g} s for one)" if no_worker_wait_s else ""
                    return fail(503, f"{exc}{waited}", "service_unavailable", "no_worker")
                if ids is None:  # (each retry would tokenize the prompt again)
                    ids = (router.tokenize(messages=body["messages"]) if chat
                           else router.tokenize(prompt=prompt))
                await asyncio.sleep(min(NO_WORKER_POLL_S, max(0.0, until - time.monotonic())))
            except (ValueError, TypeError) as exc:
                return fail(400, str(exc))

    async def parse(request: Request, chat: bool) -> tuple[dict[str, Any], Routed] | JSONResponse:
        got = await read(request, chat)
        if isinstance(got, JSONResponse):
            return got
        tenant, body = got
        routed = await route_body(body, tenant, chat)
        return routed if isinstance(routed, JSONResponse) else (body, routed)

    def learn_prefill(raw: bytes, routed: Routed, upstream_s: float) -> bytes:
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
                router.recent.finish(routed.request_id, kv)
                router.observe_prefill(int(kv.get("computed_tokens", 0)),
                                       int(kv.get("reused_tokens", 0)),
                                       float(kv.get("prefill_s", 0.0)))
        except (ValueError, TypeError, AttributeError):
            pass  # not a kvshare worker: nothing to learn
        timing.observe(metrics.ttft_stages, timing.json_reply(data, routed.timings, upstream_s))
        return json.dumps(data).encode()

    async def proxy(request: Request, path: str, chat: bool) -> Response:
        t_in = time.perf_counter()
        got = await read(request, chat)
        if isinstance(got, JSONResponse):
            return got
        tenant, body = got
        body_s = time.perf_counter() - t_in  # the breakdown's "parse" stage
        refusal = gate.enter(tenant.name, tenant.max_inflight)
        if refusal is not None:
            return busy(refusal.message, "too_many_requests", refusal.retry_after_s)
        slot = Slot(lambda: gate.leave(tenant.name))
        try:
            answer = await forward(request, path, chat, tenant, body, slot, body_s)
        finally:
            if not slot.handed_over:
                slot.release()
        return answer

    def busy(message: str, code: str, retry_after_s: int) -> JSONResponse:
        answer = fail(429, message, "rate_limit_error", code)
        answer.headers["Retry-After"] = str(retry_after_s)
        return answer

    async def forward(request: Request, path: str, chat: bool, tenant: Tenant,
                      body: dict[str, Any], slot: Slot, parse_s: float) -> Response:
        routed = await route_body(body, tenant, chat)
        if isinstance(routed, JSONResponse):
            return routed
        routed.timings["parse"] = parse_s
        seconds = body.get("deadline_s") or gate.config.default_deadline_s
        stream = bool(body.get("stream"))

        def body_for(r: Routed, deadline_s: float) -> dict[str, Any]:
            # the worker as routed: a snapshot taken now may have lost it (a lapsed lease)
            return forward_body(body, r, r.info, chat, deadline_s)

        out = Outgoing(path, to_worker, stream, time.monotonic() + float(seconds), body_for)
        t_send = time.perf_counter()
        answered, outcome = await unless_disconnected(
            request, upstream.send(state["http"], router, routed, out))
        if not answered or outcome is None:
            metrics.errors.labels("499").inc()
            return Response(status_code=499)  # the client went away: the worker was told
        if isinstance(outcome, Failure):
            if outcome.status == 429:
                return busy(outcome.message, outcome.code, outcome.retry_after_s or 1)
            return fail(outcome.status, outcome.message, "upstream_error", outcome.code)
        routed = outcome.routed  # another worker's decision after a retry: same parse stage
        routed.timings.setdefault("parse", parse_s)
        d = routed.decision
        headers = {"x-kvshare-worker": d.worker, "x-kvshare-reason": d.reason,
                   "x-kvshare-tries": str(outcome.tries)}
        resp = outcome.response
        first_s = time.perf_counter() - t_send  # to the whole body, or a stream's first chunk
        if outcome.rest is None:
            router.finished(routed.request_id)
            raw = outcome.body
            if resp.status_code == 200:
                raw = learn_prefill(raw, routed, time.perf_counter() - t_send)
            ctype = resp.headers.get("content-type", "application/json")
            return Response(raw, resp.status_code, headers=headers, media_type=ctype)
        rest = outcome.rest
        live: Routed = routed  # the worker streaming now (another after a resume)
        stages = timing.stream_stages(live.timings, first_s)
        headers["x-kvshare-breakdown"] = timing.header(stages)
        vllm = is_vllm(routed.info)
        if vllm:  # no worker stages will come: what the gateway saw is the whole breakdown
            timing.observe(metrics.ttft_stages, stages)

        delivered = stream_resume.Delivered()
        resumable = stream_resume.resumable(body, greedy_worker=not vllm)
        skip: stream_resume.Skip | None = None  # filters the resumed stream

        async def resume(exc: httpx.HTTPError) -> bytes | None:
            """The worker died mid-stream: send the request to another one and return the
            first of its events past what the client has (None: it cannot be resumed)."""
            nonlocal live, resp, rest, skip
            dead = live.decision.worker
            metrics.upstream.labels(dead, "dropped_mid_stream").inc()
            await resp.aclose()
            router.finished(live.request_id)
            if not resumable or skip is not None:  # sampled, or already resumed once
                return None
            try:
                again = await router.route(token_ids=live.token_ids, tenant=live.tenant,
                                           exclude=[dead])
            except NoEligibleWorker:
                return None
            answer = await upstream.send(state["http"], router, again, out)
            if isinstance(answer, Failure):
                return None
            if answer.rest is None or answer.response.status_code != 200:
                await answer.response.aclose()
                router.finished(answer.routed.request_id)
                return None
            live, resp, rest = answer.routed, answer.response, answer.rest
            router.prefilled(live.request_id)
            metrics.upstream.labels(live.decision.worker, "resumed_mid_stream").inc()
            skip = stream_resume.Skip(delivered)
            log.info("stream of %s resumed on %s after %s died (%s)", live.request_id,
                     live.decision.worker, dead, type(exc).__name__)
            return skip.feed(answer.first)

        async def relay() -> AsyncIterator[bytes]:
            router.prefilled(live.request_id)
            # Complete events go on at once (an unfinished one waits for its end); from the
            # event carrying the worker's figures on, the stream is held back and sent at its
            # end with the TTFT breakdown in that event (router/timing.py). A worker dying
            # mid-stream is resumed on another (router/stream_resume.py) when it can be.
            buf, tail, upstream_s = b"", list[bytes](), 0.0
            chunk = outcome.first

            def sent(data: bytes) -> bytes:
                delivered.sent(data)
                return data

            while True:
                try:
                    if tail:
                        tail.append(chunk)
                    else:
                        buf += chunk
                        at = buf.find(b'"kvshare"')
                        cut = buf.rfind(b"\n\n", 0, at if at >= 0 else len(buf))
                        if cut >= 0:
                            events = buf[:cut + 2]
                            yield sent(timing.usage_events(events, stages) if vllm else events)
                            buf = buf[cut + 2:]
                        if at >= 0:
                            upstream_s = time.perf_counter() - t_send
                            tail, buf = [buf], b""
                    if time.monotonic() > out.deadline + upstream.DEADLINE_GRACE_S:
                        yield b"".join([buf, *tail]) + b"data: [DONE]\n\n"  # past the deadline
                        return
                    chunk = await rest.__anext__()
                    if skip is not None:
                        chunk = skip.feed(chunk)
                except StopAsyncIteration:
                    if skip is not None:  # a last event with no separator
                        if tail:
                            tail.append(skip.flush())
                        else:
                            buf += skip.flush()
                    if not tail:
                        yield timing.usage_events(buf, stages) if vllm else buf
                        return
                    end, breakdown = timing.stream_tail(b"".join(tail), live.timings,
                                                        upstream_s)
                    router.recent.finish_stream(live.request_id, end)
                    if breakdown is not None:
                        timing.observe(metrics.ttft_stages, breakdown)
                    yield end
                    return
                except (httpx.HTTPError, stream_resume.Diverged) as exc:
                    first = await resume(exc) if isinstance(exc, httpx.HTTPError) else None
                    if first is not None:  # what was not sent is sent again by the other worker
                        buf, tail, chunk = b"", [], first
                        continue
                    if isinstance(exc, stream_resume.Diverged):
                        log.warning("resumed stream of %s diverged: %s", live.request_id, exc)
                    event = {"error": {"message": f"worker {live.decision.worker} failed "
                                                  f"mid-stream ({type(exc).__name__})",
                                       "type": "upstream_error", "code": "worker_failed"}}
                    yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
                    return

        async def done() -> None:
            await resp.aclose()  # closing mid-stream tells the worker to stop generating
            router.finished(live.request_id)
            slot.release()

        slot.handed_over = True
        return Relay(relay(), done, media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions", chat=True)

    @app.post("/v1/route")
    async def route(request: Request) -> Response:
        """Decision only. Body: ``{"prompt": ...}`` or ``{"messages": [...]}``. The answer
        has the decision and ``candidates``: every eligible worker's estimate (``worker``,
        ``est_ttft_s``, ``queue_s``, ``reason``), chosen first, then best first (empty for a
        fallback without a ranking); near-ties (within the policy's tie) are rotated, so two
        routers may choose differently among them."""
        probe = await json_object(request, fail, limits)
        if isinstance(probe, JSONResponse):
            return probe
        parsed = await parse_with(request, probe)
        if isinstance(parsed, JSONResponse):
            return parsed
        _, routed = parsed
        router.finished(routed.request_id)  # nothing was sent: not in flight
        estimates = routed.ranking.estimates() if routed.ranking is not None else []
        return JSONResponse({
            **routed.decision.to_dict(), "request_id": routed.request_id,
            "tenant": routed.tenant.name, "namespace": routed.namespace,
            "num_tokens": len(routed.token_ids), "num_blocks": len(routed.hashes),
            "index_s": routed.index_s, "fallback": routed.fallback,
            "candidates": [{"worker": e.worker, "est_ttft_s": e.est_ttft_s, "queue_s": e.queue_s,
                            "reason": e.reason} for e in estimates],
        })

    async def parse_with(request: Request, probe: Any) -> tuple[dict[str, Any], Routed] | JSONResponse:
        chat = isinstance(probe, dict) and "messages" in probe
        return await parse(request, chat)

    add_admin_routes(app, router, tenant_of, fail, admin, limits)
    add_web_routes(app, router, tenant_of, admin)  # GET /dashboard: the live page (router/web)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes,
                       on_reject=lambda status: metrics.errors.labels(str(status)).inc())
    document(app, {("post", "/v1/completions"): CompletionRequest,
                   ("post", "/v1/chat/completions"): ChatRequest,
                   ("post", "/v1/route"): RouteRequest,
                   ("post", "/v1/kvshare/{op}"): AdminRequest})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvshare"}
            for name in await models_served()]})

    @app.get("/health")
    async def health() -> Response:
        infos, _ = await router.workers.snapshot()
        return JSONResponse({
            "status": "ok" if infos else "no_workers", "workers": len(infos),
            "index": router.index is not None, "policy": router.policy.name,
            "decisions": router.decisions, "fallbacks": router.fallbacks,
        }, status_code=200 if infos else 503)

    @app.get("/metrics")
    async def prom() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
