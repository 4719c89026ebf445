"""OpenAI-compatible HTTP server around a :class:`~kvshare.engines.worker.ReferenceWorker`.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` too),
``GET /v1/models``, ``GET /health``, ``GET /v1/kvshare/stats`` (counters and current load as
JSON) and ``GET /metrics`` (Prometheus text). Requests run one at a time on the engine thread
of a bounded, tenant-fair queue (:mod:`kvshare.engines.scheduler`: 429 when full); the event
loop only parses, queues and streams. A client that disconnects (streaming or not) cancels
its request: generation stops at the next token and the engine takes the next request.

:class:`WorkerServer` runs the app with uvicorn on a background thread, registers the worker
with the index (:class:`~kvshare.workers.WorkerInfo`) and reports its load
(:class:`~kvshare.workers.WorkerLoad`) every ``report_interval_s`` (<= 100 ms).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvshare.addresses import port_on
from kvshare.asgi import unless_disconnected
from kvshare.auth import WorkerAuth
from kvshare.breakdown import WORKER_STAGES, breakdown_of
from kvshare.engines.metrics import WorkerCollector, worker_registry
from kvshare.engines.openai_api import (
    BadRequest,
    chunk_body,
    new_id,
    parse_request,
    response_body,
)
from kvshare.engines.runtime import LoadReporter, LoadTracker, WorkerRuntime
from kvshare.engines.scheduler import FairQueue, Job, Overloaded
from kvshare.engines.worker import Completion, ReferenceWorker
from kvshare.workers import WorkerInfo, WorkerRegistrar

log = logging.getLogger(__name__)


def _kv_summary(c: Completion, job: Job, received: float) -> dict[str, Any]:
    """The answer's ``kvshare`` figures, with its TTFT breakdown (:mod:`kvshare.breakdown`);
    ``received``: ``time.perf_counter()`` when the request arrived. ``worker_s``: from then to
    now, the answer's end (the gateway's ``network`` stage is its upstream time less this)."""
    s = c.stats
    s.queue_s = job.queue_s
    return {"reused_tokens": s.reused_tokens, "computed_tokens": s.computed_tokens,
            "loaded_blocks": s.loaded_blocks, "planned_blocks": s.planned_blocks,
            "ttft_s": s.ttft_s, "load_s": s.load_s, "prefill_s": s.prefill_s,
            "bytes_by_transport": s.bytes_by_transport, "bytes_by_tier": s.bytes_by_tier,
            "tokens_by_source": s.tokens_by_source,
            "misses": s.misses, "plan": s.plan, "ended": c.ended, "queue_s": job.queue_s,
            "ahead": job.ahead, "store_wait_s": s.store_wait_s, "breakdown": breakdown_of(s),
            "worker_s": time.perf_counter() - received}


def _account(counters: Any, summary: dict[str, Any]) -> None:
    """Sum the answer's worker stages per stage, for /metrics (:class:`WorkerCollector`)."""
    for stage in WORKER_STAGES:
        counters.add(f"ttft_stage_s_{stage}", summary["breakdown"][stage])


def create_app(
    worker: ReferenceWorker, *, namespace: str, model_name: str, worker_id: str = "worker",
    load: LoadTracker | None = None, auth: WorkerAuth | None = None, max_pending: int = 32,
) -> Any:
    """The FastAPI app serving ``worker``; with ``auth`` tokens (:mod:`kvshare.auth`) the
    completion endpoints and the stats answer 401 without ``Authorization: Bearer <token>``.
    At most ``max_pending`` requests wait or run (:class:`~kvshare.engines.scheduler.FairQueue`);
    more get 429 with ``Retry-After``."""
    auth = auth or WorkerAuth()
    app = FastAPI(title=f"kvshare reference worker {worker_id}")
    runtime = WorkerRuntime(worker, load=load, peer="gateway")
    queue = FairQueue(runtime, max_pending)
    tracker = runtime.load
    tok = worker.engine.tokenizer

    def refused(request: Request) -> JSONResponse | None:
        if auth.allows(request.headers.get("authorization")):
            return None
        return JSONResponse({"error": {
            "message": "this worker serves requests routed by the kvshare gateway only: send "
                       "Authorization: Bearer <worker token> (KVSHARE_WORKER_TOKENS)",
            "type": "authentication_error", "code": "invalid_worker_token"}}, status_code=401)

    async def handle(request: Request, chat: bool) -> Any:
        received = time.perf_counter()
        if (no := refused(request)) is not None:
            return no
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "body is not JSON"}}, status_code=400)
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[str | None] = asyncio.Queue()

        def on_delta(text: str) -> None:  # on the engine thread
            loop.call_soon_threadsafe(deltas.put_nowait, text)

        try:
            req = parse_request(body, chat=chat, namespace=namespace, tokenizer=tok)
            job = queue.submit(req, on_delta if req.stream else None)
        except Overloaded as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "overloaded",
                                           "code": "worker_busy"}}, status_code=429,
                                headers={"Retry-After": str(exc.retry_after_s)})
        except (BadRequest, ValueError) as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request"}},
                                status_code=400)
        req = job.req
        submitted = time.perf_counter()
        rid = new_id(chat)
        result = asyncio.wrap_future(job.future)

        def summary(c: Completion) -> dict[str, Any]:
            c.stats.receive_s = submitted - received  # read, parsed, admitted
            out = _kv_summary(c, job, received)
            _account(worker.counters, out)
            return out

        if not req.stream:
            answered, c = await unless_disconnected(request, asyncio.shield(result))
            if not answered or c is None:
                job.cancel()  # the client is gone: free the engine at the next token
                return Response(status_code=499)
            return response_body(req, rid, model_name, runtime.text(c), c.tokens,
                                 runtime.finish_reason(c, req), summary(c))
        result.add_done_callback(lambda _f: deltas.put_nowait(None))

        async def events() -> AsyncIterator[str]:
            first = True  # sent with the first text, so nothing is streamed before a token is
            try:
                while (delta := await deltas.get()) is not None:
                    yield f"data: {json.dumps(chunk_body(req, rid, model_name, delta, None, first))}\n\n"
                    first = False
                try:
                    c = await result
                except Exception as exc:  # the engine failed: report it in-band
                    yield f"data: {json.dumps({'error': {'message': str(exc)}})}\n\n"
                    return
                extra = {"kvshare": summary(c),
                         "usage": {"prompt_tokens": len(req.tokens),
                                   "completion_tokens": len(c.tokens),
                                   "total_tokens": len(req.tokens) + len(c.tokens)}}
                last = chunk_body(req, rid, model_name, "", runtime.finish_reason(c, req), first,
                                  extra)
                yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.cancel()  # a no-op once it finished; else the client went away mid-stream

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "owned_by": "kvshare", "namespace": namespace}]}

    @app.get("/health")
    async def health() -> Any:
        return {"ok": True, "worker_id": worker_id}

    @app.get("/v1/kvshare/stats")
    async def stats(request: Request) -> Any:
        if (no := refused(request)) is not None:
            return no
        return {"worker_id": worker_id, "namespace": namespace,
                "counters": worker.counters.snapshot(), "client": runtime.client_counters(),
                "load": tracker.as_dict(),
                "queue": {"pending": queue.pending, "max_pending": queue.max_pending,
                          "refused": queue.refused}}

    registry = worker_registry(WorkerCollector(worker_id, worker.counters.snapshot, runtime.client_counters))

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.state.queue = queue
    app.state.load = tracker
    return app


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (:func:`kvshare.addresses.port_on`)."""
    return port_on(host)


def listening_socket(host: str, port: int) -> socket.socket:
    """Bind ``host:port`` (port 0: any free one) for an HTTP server to serve on (uvicorn's
    ``Server.run(sockets=[...])``).

    Holding the bound socket until the server runs is what stops another process taking the
    port in between (as it can after :func:`free_port`). Raises OSError naming the address if
    it is taken.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"HTTP server cannot bind {host}:{port} ({exc.strerror}); "
                                 "pass a free port, or 0 for any") from exc
    sock.set_inheritable(True)
    return sock


class WorkerServer:
    """Serve one worker over HTTP on a background thread; register and report load.

    ``registrar`` (the index client) may be None (standalone). Report failures are logged
    and retried on the next tick: an index that is down never stops serving.
    """

    def __init__(
        self, worker: ReferenceWorker, info: WorkerInfo, *, model_name: str,
        registrar: WorkerRegistrar | None = None, host: str = "127.0.0.1", port: int = 0,
        report_interval_s: float = 0.1, auth: WorkerAuth | None = None, max_pending: int = 32,
    ) -> None:
        import uvicorn

        self._socket = listening_socket(host, port)
        self.port = int(self._socket.getsockname()[1])
        self.endpoint = f"http://{host}:{self.port}"
        self.info = WorkerInfo(info.worker_id, info.node, info.namespaces, self.endpoint,
                               info.tp, info.layout_fingerprint, dict(info.meta))
        self.worker = worker
        self.load = LoadTracker()
        self.reporter = LoadReporter(registrar, self.info, self.load, report_interval_s)
        self.app = create_app(worker, namespace=info.namespaces[0], model_name=model_name,
                              worker_id=str(info.worker_id), load=self.load, auth=auth,
                              max_pending=max_pending)
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level="warning",
                                access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="kvshare-http", daemon=True)

    @property
    def report_errors(self) -> int:
        """Load reports that failed (the index was down or slow)."""
        return self.reporter.errors

    def start(self, timeout_s: float = 60.0) -> str:
        """Start serving; returns the endpoint once it accepts connections.

        The port is already bound (in ``__init__``), so this waits only for the event loop;
        ``timeout_s`` is generous because a loaded machine can take seconds to schedule it.
        """
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"worker HTTP server on {self.endpoint} exited while starting "
                                   "(its error is in the log above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker HTTP server did not start on {self.endpoint} "
                                   f"within {timeout_s:g} s")
            time.sleep(0.01)
        self.reporter.start()
        return self.endpoint

    def stop(self) -> None:
        """Stop serving and reporting; unregister from the index (best effort)."""
        self.reporter.stop()
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._socket.close()
        self.app.state.queue.close()
