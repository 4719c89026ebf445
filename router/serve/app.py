"""kvshare on Ray Serve: the reference worker as a Serve deployment behind an OpenAI ingress.

:func:`build_app` builds the application (``examples/serve_app.py`` is the one a user runs:
``serve run examples.serve_app:app``). The one line that turns on kvshare routing is the
worker deployment's request router::

    request_router_config=RequestRouterConfig(
        request_router_class="kvshare.router.serve:KVShareRequestRouter")

``build_app(router="default")`` leaves Serve's power-of-two router in place (the baseline).
The ingress tokenizes once with the workers' tokenizer, hashes the prompt and forwards
``kvshare: {token_ids, namespace, hashes_hex}``; the router ranks replicas from those hashes
and the worker never re-tokenizes. A replica that dies mid-request is retried on another.
Each replica runs the library's worker runtime (:mod:`kvshare.engines.runtime`: admission and
hash check, load reports, finish reasons, cut policy), as the HTTP worker server does.
"""

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from kvshare.actors.deploy import deploy
from kvshare.client.sdk import KVShareClient
from kvshare.engines.hf import EngineConfig, HFEngine
from kvshare.engines.openai_api import (
    BadRequest,
    ParsedRequest,
    chunk_body,
    new_id,
    parse_request,
    response_body,
)
from kvshare.engines.runtime import LoadReporter, LoadTracker, WorkerRuntime, choose_cut
from kvshare.engines.worker import Completion, ReferenceWorker
from kvshare.hasher import Hasher
from kvshare.router.serve.request import (
    META_BLOCK_TOKENS,
    META_BYTES_PER_TOKEN,
    META_ROOT,
    META_SHARING,
    META_TOKENIZER,
    replica_worker_id,
)
from kvshare.tokenizer import tokenizer_from_spec, tokenizer_spec
from kvshare.types import BlockHash, NodeId
from kvshare.workers import WorkerInfo, WorkerRegistrar

log = logging.getLogger("ray.serve")

KVSHARE_ROUTER = "kvshare.router.serve:KVShareRequestRouter"
MIN_SPEED_SAMPLE_TOKENS = 256
"""Prefills shorter than this do not update the prefill speed a replica reports (the router
turns queued tokens into seconds with it; a 10-token prefill measures overhead, not speed)."""


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
        if sharing not in ("global", "local"):
            raise ValueError(f"sharing must be 'global' or 'local', got {sharing!r}")
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.engine = HFEngine(EngineConfig(**(engine or {})))
        self.namespace = namespace
        self.worker_id = replica_worker_id(serve.get_replica_context().replica_id)
        self.node = ray.get_runtime_context().get_node_id()
        self.client = self._connect(sharing, auto_deploy)
        self.worker = ReferenceWorker(self.engine, self.client)
        self.runtime = WorkerRuntime(self.worker, peer="ingress",
                                     load=LoadTracker(MIN_SPEED_SAMPLE_TOKENS))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvshare-engine")
        tok = self.engine.tokenizer
        self.info = WorkerInfo(
            self.worker_id, NodeId(self.node), (namespace,),
            layout_fingerprint=self.engine.layout.fingerprint(),
            meta={META_ROOT: self.engine.root.hex(),
                  META_BLOCK_TOKENS: str(self.engine.layout.block_tokens),
                  META_BYTES_PER_TOKEN: str(self.engine.layout.bytes_per_token),
                  META_TOKENIZER: json.dumps(tokenizer_spec(tok)), META_SHARING: sharing,
                  "serve_replica": serve.get_replica_context().replica_id.to_full_id_str()})
        self.reporter: LoadReporter | None = None
        if self.client is not None and isinstance(self.client.index, WorkerRegistrar):
            self.reporter = LoadReporter(self.client.index, self.info, self.runtime.load,
                                         report_interval_s)
            self.reporter.start()

    def _connect(self, sharing: str, auto_deploy: bool) -> KVShareClient | None:
        cut = choose_cut(self.engine, "local" if sharing == "local" else "cost")
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
                deploy(namespace=self.namespace, layout=self.engine.layout)
        return None

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

    def _parse(self, body: dict[str, Any], chat: bool) -> ParsedRequest:
        req = parse_request(body, chat=chat, namespace=self.namespace,
                            tokenizer=self.engine.tokenizer)
        return self.runtime.admit(req)

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

    async def generate(self, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
        """A non-streaming OpenAI response; ``kvshare`` says who served it and what it reused.
        Bad input returns ``{"error": ...}`` (the ingress maps it to HTTP 400)."""
        try:
            req = self._parse(body, chat)
        except ValueError as exc:
            return {"error": {"message": str(exc), "type": "invalid_request_error"}}
        c = await asyncio.get_running_loop().run_in_executor(self._executor, self.runtime.run, req)
        return response_body(req, new_id(chat), req.model or self.engine.identity,
                             self.runtime.text(c), c.tokens, self.runtime.finish_reason(c, req),
                             self._summary(c))

    async def generate_stream(self, body: dict[str, Any], chat: bool = False) -> AsyncIterator[str]:
        """Server-sent-event lines of a streaming OpenAI response."""
        try:
            req = self._parse(body, chat)
        except ValueError as exc:
            yield f"data: {json.dumps({'error': {'message': str(exc)}})}\n\n"
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()

        def on_delta(text: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, text)

        fut = loop.run_in_executor(self._executor, self.runtime.run, req, on_delta)
        fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(queue.put_nowait, None))
        rid, model = new_id(chat), req.model or self.engine.identity
        yield f"data: {json.dumps(chunk_body(req, rid, model, '', None, True))}\n\n"
        while (delta := await queue.get()) is not None:
            yield f"data: {json.dumps(chunk_body(req, rid, model, delta, None))}\n\n"
        c = await fut
        extra = {"kvshare": self._summary(c),
                 "usage": {"prompt_tokens": len(req.tokens), "completion_tokens": len(c.tokens),
                           "total_tokens": len(req.tokens) + len(c.tokens)}}
        last = chunk_body(req, rid, model, "", self.runtime.finish_reason(c, req), False, extra)
        yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"

    def __del__(self) -> None:
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.stop(unregister=False)


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

    ``router``: ``kvshare`` (:class:`kvshare.router.serve.request_router.KVShareRequestRouter`) or ``default``
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
