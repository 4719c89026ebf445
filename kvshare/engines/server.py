"""OpenAI-compatible HTTP server around a :class:`~kvshare.engines.worker.ReferenceWorker`.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream`` too),
``GET /v1/models``, ``GET /health``, ``GET /v1/kvshare/stats`` (counters and current load as
JSON) and ``GET /metrics`` (Prometheus text). Requests run one at a time on a worker thread;
the event loop only parses, queues and streams.

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
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvshare.auth import WorkerAuth
from kvshare.engines.metrics import WorkerCollector, worker_registry
from kvshare.engines.openai_api import (
    BadRequest,
    ParsedRequest,
    TextStream,
    chunk_body,
    new_id,
    parse_request,
    response_body,
)
from kvshare.engines.worker import Completion, ReferenceWorker, RequestStats
from kvshare.workers import WorkerInfo, WorkerLoad

log = logging.getLogger(__name__)


class WorkerRegistrar(Protocol):
    """Where a worker registers and reports load (the index client implements it)."""

    def register_worker(self, info: WorkerInfo) -> Any: ...

    def report_load(self, load: WorkerLoad) -> Any: ...


class LoadTracker:
    """Prompt tokens admitted but not yet prefilled, and requests in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queued_prefill_tokens = 0
        self.running = 0
        self.prefill_tokens_per_s = 0.0

    def admit(self, tokens: int) -> None:
        with self._lock:
            self.queued_prefill_tokens += tokens
            self.running += 1

    def prefilled(self, tokens: int, computed: int, seconds: float) -> None:
        with self._lock:
            self.queued_prefill_tokens -= tokens
            if computed > 0 and seconds > 0:
                speed = computed / seconds
                old = self.prefill_tokens_per_s
                self.prefill_tokens_per_s = speed if old == 0 else 0.8 * old + 0.2 * speed

    def done(self) -> None:
        with self._lock:
            self.running -= 1

    def snapshot(self, worker_id: str) -> WorkerLoad:
        from kvshare.types import WorkerId

        with self._lock:
            return WorkerLoad(WorkerId(worker_id), max(0, self.queued_prefill_tokens),
                              self.running, self.prefill_tokens_per_s, time.time())


def _kv_summary(c: Completion) -> dict[str, Any]:
    s = c.stats
    return {"reused_tokens": s.reused_tokens, "computed_tokens": s.computed_tokens,
            "loaded_blocks": s.loaded_blocks, "planned_blocks": s.planned_blocks,
            "ttft_s": s.ttft_s, "load_s": s.load_s, "prefill_s": s.prefill_s,
            "bytes_by_transport": s.bytes_by_transport, "bytes_by_tier": s.bytes_by_tier,
            "misses": s.misses, "plan": s.plan}


def create_app(
    worker: ReferenceWorker, *, namespace: str, model_name: str, worker_id: str = "worker",
    load: LoadTracker | None = None, auth: WorkerAuth | None = None,
) -> Any:
    """The FastAPI app serving ``worker``; with ``auth`` tokens (:mod:`kvshare.auth`) the
    completion endpoints and the stats answer 401 without ``Authorization: Bearer <token>``."""
    auth = auth or WorkerAuth()
    app = FastAPI(title=f"kvshare reference worker {worker_id}")
    executor = ThreadPoolExecutor(1, thread_name_prefix="kvshare-engine")
    tracker = load or LoadTracker()
    tok = worker.engine.tokenizer
    eos = getattr(tok, "eos_id", -1)

    def run(req: ParsedRequest, on_token: Callable[[int], None] | None) -> Completion:
        prefilled = [False]

        def on_prefill(s: RequestStats) -> None:
            prefilled[0] = True
            tracker.prefilled(len(req.tokens), s.computed_tokens, s.prefill_s)

        try:
            stops = (eos,) if req.stop_eos and eos >= 0 else ()
            return worker.generate(req.tokens, req.max_tokens, hashes=req.hashes, salt=req.salt,
                                   stop_ids=stops, on_token=on_token, on_prefill=on_prefill)
        finally:
            if not prefilled[0]:
                tracker.prefilled(len(req.tokens), 0, 0.0)
            tracker.done()

    def admit(req: ParsedRequest) -> None:
        if req.hashes is not None:
            mine = worker.engine.hashes(req.tokens, req.salt)
            if list(req.hashes) != mine[: len(req.hashes)] or len(req.hashes) > len(mine):
                raise BadRequest(
                    "kvshare.hashes_hex do not match this worker's hashes of token_ids: the "
                    "gateway and the worker disagree on the model, layout or tenant salt"
                )
        worker.engine.check_tokens(req.tokens)
        tracker.admit(len(req.tokens))

    def client_counters() -> dict[str, float]:
        counters = getattr(worker.client, "counters", None)
        return dict(counters) if isinstance(counters, dict) else {}

    def finish_reason(c: Completion, req: ParsedRequest) -> str:
        return "stop" if c.tokens and c.tokens[-1] == eos and req.stop_eos else "length"

    def refused(request: Request) -> JSONResponse | None:
        if auth.allows(request.headers.get("authorization")):
            return None
        return JSONResponse({"error": {
            "message": "this worker serves requests routed by the kvshare gateway only: send "
                       "Authorization: Bearer <worker token> (KVSHARE_WORKER_TOKENS)",
            "type": "authentication_error", "code": "invalid_worker_token"}}, status_code=401)

    async def handle(request: Request, chat: bool) -> Any:
        if (no := refused(request)) is not None:
            return no
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "body is not JSON"}}, status_code=400)
        try:
            req = parse_request(body, chat=chat, namespace=namespace, tokenizer=tok)
            admit(req)
        except (BadRequest, ValueError) as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request"}},
                                status_code=400)
        rid = new_id(chat)
        loop = asyncio.get_running_loop()
        if not req.stream:
            c = await loop.run_in_executor(executor, run, req, None)
            text = tok.decode([t for t in c.tokens if t != eos])
            return response_body(req, rid, model_name, text, c.tokens, finish_reason(c, req),
                                 _kv_summary(c))
        queue: asyncio.Queue[int | None] = asyncio.Queue()

        def on_token(t: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, t)

        fut = loop.run_in_executor(executor, run, req, on_token)
        fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(queue.put_nowait, None))

        async def events() -> AsyncIterator[str]:
            stream = TextStream(tok)
            first = True
            if req.chat:
                yield f"data: {json.dumps(chunk_body(req, rid, model_name, '', None, True))}\n\n"
                first = False
            while (t := await queue.get()) is not None:
                delta = stream.push(t) if t != eos else ""
                if delta or first:
                    yield f"data: {json.dumps(chunk_body(req, rid, model_name, delta, None, first))}\n\n"
                    first = False
            try:
                c = await fut
            except Exception as exc:  # the engine failed: report it in-band
                yield f"data: {json.dumps({'error': {'message': str(exc)}})}\n\n"
                return
            tail = stream.flush()
            extra = {"kvshare": _kv_summary(c),
                     "usage": {"prompt_tokens": len(req.tokens),
                               "completion_tokens": len(c.tokens),
                               "total_tokens": len(req.tokens) + len(c.tokens)}}
            yield f"data: {json.dumps(chunk_body(req, rid, model_name, tail, finish_reason(c, req), False, extra))}\n\n"
            yield "data: [DONE]\n\n"

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
        ld = tracker.snapshot(worker_id)
        return {"worker_id": worker_id, "namespace": namespace,
                "counters": worker.counters.snapshot(), "client": client_counters(),
                "load": {"queued_prefill_tokens": ld.queued_prefill_tokens,
                         "running": ld.running, "prefill_tokens_per_s": ld.prefill_tokens_per_s}}

    registry = worker_registry(WorkerCollector(worker_id, worker.counters.snapshot, client_counters))

    @app.get("/metrics")
    async def metrics() -> Any:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.state.executor = executor
    app.state.load = tracker
    return app


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class WorkerServer:
    """Serve one worker over HTTP on a background thread; register and report load.

    ``registrar`` (the index client) may be None (standalone). Report failures are logged
    and retried on the next tick: an index that is down never stops serving.
    """

    def __init__(
        self, worker: ReferenceWorker, info: WorkerInfo, *, model_name: str,
        registrar: WorkerRegistrar | None = None, host: str = "127.0.0.1", port: int = 0,
        report_interval_s: float = 0.1, auth: WorkerAuth | None = None,
    ) -> None:
        import uvicorn

        if report_interval_s > 0.1:
            raise ValueError("report_interval_s must be <= 0.1 s (the worker lease renews on it)")
        self.port = port or free_port(host)
        self.endpoint = f"http://{host}:{self.port}"
        self.info = WorkerInfo(info.worker_id, info.node, info.namespaces, self.endpoint,
                               info.tp, info.layout_fingerprint, dict(info.meta))
        self.worker = worker
        self.load = LoadTracker()
        self.app = create_app(worker, namespace=info.namespaces[0], model_name=model_name,
                              worker_id=str(info.worker_id), load=self.load, auth=auth)
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level="warning",
                                access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="kvshare-http", daemon=True)
        self.registrar = registrar
        self.report_interval_s = report_interval_s
        self.report_errors = 0
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="kvshare-load",
                                          daemon=True)

    def start(self, timeout_s: float = 10.0) -> str:
        """Start serving; returns the endpoint once it accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"worker HTTP server did not start on {self.endpoint}")
            time.sleep(0.01)
        self._reporter.start()
        return self.endpoint

    def _report_loop(self) -> None:
        registered = False
        if self.registrar is None:
            return  # standalone: nothing to report (a loop here burnt a core while idle)
        while not self._stop.wait(self.report_interval_s if registered else 0):
            try:
                if not registered:
                    self.registrar.register_worker(self.info)
                    registered = True
                ok = self.registrar.report_load(self.load.snapshot(str(self.info.worker_id)))
                if ok is False:  # the index forgot us (restart, expiry): register again
                    registered = False
            except Exception as exc:
                self.report_errors += 1
                registered = False
                log.debug("load report failed: %s", exc)
                self._stop.wait(self.report_interval_s)

    def stop(self) -> None:
        """Stop serving and reporting; unregister from the index (best effort)."""
        self._stop.set()
        if self._reporter.is_alive():
            self._reporter.join(timeout=2)
        unregister = getattr(self.registrar, "unregister_worker", None)
        if callable(unregister):
            try:
                unregister(self.info.worker_id)
            except Exception as exc:
                log.debug("unregister failed: %s", exc)
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self.app.state.executor.shutdown(wait=False)
