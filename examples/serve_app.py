"""kvshare on Ray Serve: the reference worker as a Serve deployment behind an OpenAI ingress.

Run it on a Ray cluster (``kvshare up`` first to size the pools; without it the first replica
deploys kvshare with defaults)::

    serve run examples.serve_app:app          # OpenAI API on http://127.0.0.1:8000/v1

or from Python: ``serve.run(build_app(num_replicas=4), route_prefix="/")``.

The one line that turns on kvshare routing is the worker deployment's request router::

    request_router_config=RequestRouterConfig(
        request_router_class="router.serve:KVShareRequestRouter")

``build_app(router="default")`` leaves Serve's power-of-two router in place (the baseline).
The ingress tokenizes once with the workers' tokenizer, hashes the prompt and forwards
``kvshare: {token_ids, namespace, hashes_hex}``; the router ranks replicas from those hashes
and the worker never re-tokenizes. A replica that dies mid-request is retried on another.
"""

import os

for _k, _v in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_USAGE_STATS_ENABLED", "0"),
               ("RAY_AUTH_MODE", "disabled"), ("NIXL_LOG_LEVEL", "WARN")):
    os.environ.setdefault(_k, _v)

import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
from collections.abc import AsyncIterator  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Any  # noqa: E402

import ray  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from ray import serve  # noqa: E402
from ray.exceptions import RayActorError  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402
from ray.serve.handle import DeploymentHandle  # noqa: E402

from kvshare.engines.openai_api import (  # noqa: E402
    BadRequest,
    ParsedRequest,
    TextStream,
    chunk_body,
    new_id,
    parse_request,
    response_body,
)
from kvshare.engines.tokenizer import tokenizer_from_spec, tokenizer_spec  # noqa: E402
from kvshare.engines.worker import Completion, ReferenceWorker  # noqa: E402
from kvshare.hasher import Hasher  # noqa: E402
from kvshare.types import BlockHash, NodeId  # noqa: E402
from kvshare.workers import WorkerInfo  # noqa: E402
from router.serve_request import (  # noqa: E402
    META_BLOCK_TOKENS,
    META_BYTES_PER_TOKEN,
    META_ROOT,
    META_SHARING,
    META_TOKENIZER,
    replica_worker_id,
)

log = logging.getLogger("ray.serve")

KVSHARE_ROUTER = "router.serve:KVShareRequestRouter"
MIN_SPEED_SAMPLE_TOKENS = 256
"""Prefills shorter than this do not update the prefill speed a replica reports (the router
turns queued tokens into seconds with it; a 10-token prefill measures overhead, not speed)."""


def local_only(prompt_tokens: int, sources: list[str] | Any) -> int:
    """A cut policy reusing only this node's blocks (a replica's own node cache)."""
    n = 0
    for s in sources:
        if not str(s).startswith("local_"):
            break
        n += 1
    return n


# No ``from __future__ import annotations`` here: FastAPI must see ``Request`` as a class
# on the ingress methods that Serve rebinds.


class KVShareWorker:
    """One replica: the reference transformers engine + the kvshare SDK (Serve deployment).

    At start it registers with the kvshare index as worker :func:`replica_worker_id` on its
    Ray node, publishing how it hashes prompts (root, block size, tokenizer) so the router
    hashes exactly what it stores, and then reports its load every ``report_interval_s``.
    ``sharing``: ``global`` loads cached blocks from any node, ``local`` only from its own.
    """

    def __init__(self, engine: dict[str, Any] | None = None, namespace: str = "default",
                 sharing: str = "global", auto_deploy: bool = True,
                 report_interval_s: float = 0.1) -> None:
        from kvshare.engines.hf import EngineConfig, HFEngine

        if sharing not in ("global", "local"):
            raise ValueError(f"sharing must be 'global' or 'local', got {sharing!r}")
        self.engine = HFEngine(EngineConfig(**(engine or {})))
        self.namespace = namespace
        self.worker_id = replica_worker_id(serve.get_replica_context().replica_id)
        self.node = ray.get_runtime_context().get_node_id()
        self.client = self._connect(sharing, auto_deploy)
        self.worker = ReferenceWorker(self.engine, self.client)
        from kvshare.engines.server import LoadTracker

        self.load = LoadTracker()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvshare-engine")
        self._stop = threading.Event()
        self._interval = report_interval_s
        tok = self.engine.tokenizer
        self.info = WorkerInfo(
            self.worker_id, NodeId(self.node), (namespace,),
            layout_fingerprint=self.engine.layout.fingerprint(),
            meta={META_ROOT: self.engine.root.hex(),
                  META_BLOCK_TOKENS: str(self.engine.layout.block_tokens),
                  META_BYTES_PER_TOKEN: str(self.engine.layout.bytes_per_token),
                  META_TOKENIZER: json.dumps(tokenizer_spec(tok)), META_SHARING: sharing,
                  "serve_replica": serve.get_replica_context().replica_id.to_full_id_str()})
        if self.client is not None:
            threading.Thread(target=self._report_loop, name="kvshare-load", daemon=True).start()

    def _connect(self, sharing: str, auto_deploy: bool) -> Any:
        from kvshare.client import KVShareClient, load_everything

        if sharing == "local":
            cut: Any = local_only
        else:  # the cost model's cut point, fitted to this engine's own prefill timings
            from kvshare.engines.cost_cut import CostCut, calibrate

            cut = CostCut.try_create(self.engine.layout, samples=calibrate(self.engine))
            cut = cut if cut is not None else load_everything
        remote = "auto" if sharing == "global" else "objstore"  # local: no NIXL agent needed
        for attempt in range(2):
            try:
                return KVShareClient.connect(self.namespace, self.engine.layout, self.engine.hasher,
                                             worker_id=self.worker_id, cut_policy=cut,
                                             remote=remote)
            except ValueError as exc:  # no index actor: kvshare is not deployed
                if attempt or not auto_deploy:
                    log.warning("kvshare not deployed (%s): serving without a shared cache", exc)
                    return None
                from actors.deploy import deploy

                deploy(namespace=self.namespace, layout=self.engine.layout)
        return None

    def _report_loop(self) -> None:
        index = self.client.index
        registered = False
        while not self._stop.wait(self._interval if registered else 0.0):
            try:
                if not registered:
                    index.register_worker(self.info)
                    registered = True
                if index.report_load(self.load.snapshot(self.worker_id)) is False:
                    registered = False  # the index forgot us (restart, expiry)
            except Exception as exc:  # the index is advisory: keep serving, retry
                registered = False
                log.debug("kvshare load report failed: %s", exc)
                self._stop.wait(self._interval)

    def describe(self) -> dict[str, Any]:
        """How the ingress must tokenize and hash for this deployment."""
        return {"namespace": self.namespace, "root_hex": self.engine.root.hex(),
                "block_tokens": self.engine.layout.block_tokens,
                "tokenizer": tokenizer_spec(self.engine.tokenizer),
                "model": self.engine.identity, "worker_id": self.worker_id, "node": self.node,
                "replica": serve.get_replica_context().replica_id.to_full_id_str()}

    def stats(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "node": self.node,
                "counters": self.worker.counters.snapshot(),
                "client": self.client.counters if self.client is not None else {}}

    def _run(self, req: ParsedRequest, on_token: Any = None) -> Completion:
        done = [False]

        def on_prefill(s: Any) -> None:
            done[0] = True
            speed = self.load.prefill_tokens_per_s
            self.load.prefilled(len(req.tokens), s.computed_tokens, s.prefill_s)
            if s.computed_tokens < MIN_SPEED_SAMPLE_TOKENS:  # fixed costs dominate: no sample
                self.load.prefill_tokens_per_s = speed

        try:
            eos = self.engine.tokenizer.eos_id
            stops = (eos,) if req.stop_eos and eos >= 0 else ()
            return self.worker.generate(req.tokens, req.max_tokens, hashes=req.hashes,
                                        stop_ids=stops, on_token=on_token, on_prefill=on_prefill)
        finally:
            if not done[0]:
                self.load.prefilled(len(req.tokens), 0, 0.0)
            self.load.done()

    def _parse(self, body: dict[str, Any], chat: bool) -> ParsedRequest:
        req = parse_request(body, chat=chat, namespace=self.namespace,
                            tokenizer=self.engine.tokenizer)
        self.engine.check_tokens(req.tokens)
        if req.hashes is not None and list(req.hashes) != self.engine.hashes(req.tokens)[: len(req.hashes)]:
            raise BadRequest("kvshare.hashes_hex do not match this worker's hashes: the ingress "
                             "and the worker disagree on the model, layout or tenant salt")
        self.load.admit(len(req.tokens))
        return req

    def _summary(self, c: Completion) -> dict[str, Any]:
        s = c.stats
        per_block = self.engine.layout.bytes_per_block
        local = s.bytes_by_transport.get("shm", 0) // per_block * self.engine.layout.block_tokens
        return {"worker_id": self.worker_id, "node": self.node,
                "prompt_tokens": s.prompt_tokens, "reused_tokens": s.reused_tokens,
                "local_reused_tokens": min(local, s.reused_tokens),
                "computed_tokens": s.computed_tokens, "ttft_s": s.ttft_s, "load_s": s.load_s,
                "prefill_s": s.prefill_s, "bytes_by_transport": s.bytes_by_transport,
                "misses": s.misses}

    def _text(self, c: Completion) -> str:
        eos = self.engine.tokenizer.eos_id
        return self.engine.tokenizer.decode([t for t in c.tokens if t != eos])

    def _finish(self, c: Completion, req: ParsedRequest) -> str:
        eos = self.engine.tokenizer.eos_id
        return "stop" if c.tokens and c.tokens[-1] == eos and req.stop_eos else "length"

    async def generate(self, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
        """A non-streaming OpenAI response; ``kvshare`` says who served it and what it reused.
        Bad input returns ``{"error": ...}`` (the ingress maps it to HTTP 400)."""
        try:
            req = self._parse(body, chat)
        except ValueError as exc:
            return {"error": {"message": str(exc), "type": "invalid_request_error"}}
        c = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, req)
        return response_body(req, new_id(chat), req.model or self.engine.identity, self._text(c),
                             c.tokens, self._finish(c, req), self._summary(c))

    async def generate_stream(self, body: dict[str, Any], chat: bool = False) -> AsyncIterator[str]:
        """Server-sent-event lines of a streaming OpenAI response."""
        try:
            req = self._parse(body, chat)
        except ValueError as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc)}})}\n\n"
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        fut = loop.run_in_executor(self._executor, self._run, req,
                                   lambda t: loop.call_soon_threadsafe(queue.put_nowait, t))
        fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(queue.put_nowait, None))
        rid, model, eos = new_id(chat), req.model or self.engine.identity, self.engine.tokenizer.eos_id
        stream = TextStream(self.engine.tokenizer)
        yield f"data: {json.dumps(chunk_body(req, rid, model, '', None, True))}\n\n"
        while (t := await queue.get()) is not None:
            delta = stream.push(t) if t != eos else ""
            if delta:
                yield f"data: {json.dumps(chunk_body(req, rid, model, delta, None))}\n\n"
        c = await fut
        extra = {"kvshare": self._summary(c),
                 "usage": {"prompt_tokens": len(req.tokens), "completion_tokens": len(c.tokens),
                           "total_tokens": len(req.tokens) + len(c.tokens)}}
        last = chunk_body(req, rid, model, stream.flush(), self._finish(c, req), False, extra)
        yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"

    def __del__(self) -> None:
        self._stop.set()


api = FastAPI(title="kvshare on Ray Serve")


@serve.ingress(api)
class OpenAIIngress:
    """OpenAI-compatible HTTP front (``/v1/completions``, ``/v1/chat/completions``,
    ``/v1/models``, ``/health``). Tokenizes and hashes once, then calls
    the worker deployment's handle, whose request router sees the ``kvshare`` fields."""

    def __init__(self, worker: DeploymentHandle[Any], retries: int = 3) -> None:
        self.worker = worker
        self.retries = retries
        self._desc: dict[str, Any] | None = None
        self._tok: Any = None

    async def _describe(self) -> dict[str, Any]:
        if self._desc is None:
            self._desc = await self.worker.describe.remote()
            self._tok = tokenizer_from_spec(self._desc["tokenizer"])
        return self._desc

    async def _routed(self, body: Any, chat: bool) -> dict[str, Any]:
        d = await self._describe()
        req = parse_request(body, chat=chat, namespace=d["namespace"], tokenizer=self._tok)
        root = BlockHash(bytes.fromhex(d["root_hex"]))
        hashes = Hasher.from_root(root, int(d["block_tokens"])).hashes(req.tokens)
        return {**body, "kvshare": {"token_ids": req.tokens, "namespace": d["namespace"],
                                    "hashes_hex": [h.hex() for h in hashes]}}

    async def _handle(self, request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
            routed = await self._routed(body, chat)
        except (json.JSONDecodeError, BadRequest, ValueError) as exc:
            msg = "body is not JSON" if isinstance(exc, json.JSONDecodeError) else str(exc)
            return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}},
                                status_code=400)
        if routed.get("stream"):
            return StreamingResponse(self._stream(routed, chat), media_type="text/event-stream")
        for attempt in range(self.retries + 1):
            try:
                out: dict[str, Any] = await self.worker.generate.remote(routed, chat=chat)
                break
            except RayActorError:  # the replica died mid-request: another one answers
                if attempt == self.retries:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))
        if "error" in out:
            return JSONResponse(out, status_code=400)
        return out

    async def _stream(self, routed: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        handle = self.worker.options(stream=True)
        for attempt in range(self.retries + 1):
            sent = False
            try:
                gen: Any = handle.generate_stream.remote(routed, chat=chat)
                async for line in gen:
                    sent = True
                    yield line
                return
            except RayActorError:  # retry only if nothing reached the client yet
                if sent or attempt == self.retries:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._handle(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._handle(request, chat=True)

    @api.get("/v1/models")
    async def models(self) -> Any:
        d = await self._describe()
        return {"object": "list", "data": [{"id": d["model"], "object": "model",
                                            "owned_by": "kvshare", "namespace": d["namespace"]}]}

    @api.get("/health")
    async def health(self) -> Any:
        return {"ok": True}


def build_app(
    *,
    num_replicas: int = 2,
    router: str = "kvshare",
    engine: dict[str, Any] | None = None,
    namespace: str = "default",
    sharing: str = "global",
    router_kwargs: dict[str, Any] | None = None,
    max_replicas_per_node: int | None = 1,
    replica_cpus: float = 1.0,
    max_ongoing_requests: int = 4,
    auto_deploy: bool = True,
    name: str = "KVShareWorker",
) -> Any:
    """The Serve application: ``num_replicas`` reference workers behind the OpenAI ingress.

    ``router``: ``kvshare`` (:class:`router.serve.KVShareRequestRouter`) or ``default``
    (Serve's power of two). ``engine``: :class:`kvshare.engines.hf.EngineConfig` fields.
    """
    if router not in ("kvshare", "default"):
        raise ValueError(f"router must be 'kvshare' or 'default', got {router!r}")
    if num_replicas < 1:
        raise ValueError("num_replicas must be >= 1")
    options: dict[str, Any] = {
        "name": name, "num_replicas": num_replicas, "max_ongoing_requests": max_ongoing_requests,
        "ray_actor_options": {"num_cpus": replica_cpus},
    }
    if max_replicas_per_node:
        options["max_replicas_per_node"] = max_replicas_per_node
    if router == "kvshare":  # the one config line a Serve user changes
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=KVSHARE_ROUTER,  # type: ignore[arg-type]
            request_router_kwargs=router_kwargs or {})
    worker = serve.deployment(KVShareWorker).options(**options)  # type: ignore[attr-defined]
    ingress = serve.deployment(OpenAIIngress).options(  # type: ignore[attr-defined]
        name=f"{name}Ingress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(worker.bind(engine=engine, namespace=namespace, sharing=sharing,
                                    auto_deploy=auto_deploy))


app = build_app()
"""``serve run examples.serve_app:app``: two kvshare-routed replicas of the tiny model."""
