"""A worker whose registration lapses while the gateway waits on it (its host cut off: the
connection stays open, nothing comes back) is given up at once, not at the request's
deadline: a request it never answered goes to another worker (router/gateway/upstream.py
``unless_lapsed``). A stream it stopped mid-way is not watched for a lapse (that broke freeing
the worker when a client hangs up); it ends at the request's deadline."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from engine_helpers import BLOCK, SMALL
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from http_helpers import Served, serve_app

from kvshare.engines.hf import EngineConfig, model_keys
from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
from kvshare.router.core.workers_view import StaticWorkers
from kvshare.router.gateway.app import create_app
from kvshare.types import NodeId, WorkerId
from kvshare.workers import WorkerInfo

NS = "lapse"
WORDS = ["one", " two", " three", " four"]
RELEASED = threading.Event()  # set at teardown: the hung answers end
HUNG = threading.Event()  # the cut worker stopped answering a request


async def hang() -> None:
    HUNG.set()
    while not RELEASED.is_set():
        await asyncio.sleep(0.05)


def worker_app(name: str, hang_after: int | None) -> FastAPI:
    """Answers completions with WORDS (streamed or whole); with ``hang_after`` it sends that
    many words and then nothing (a host whose link went down)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        if not body.get("stream"):
            if hang_after is not None:
                await hang()
            return JSONResponse({"object": "text_completion", "choices": [
                {"index": 0, "text": "".join(WORDS), "finish_reason": "length"}]})

        async def events() -> AsyncIterator[bytes]:
            for i, w in enumerate(WORDS):
                if hang_after is not None and i == hang_after:
                    await hang()
                done = "length" if i == len(WORDS) - 1 else None
                yield b"data: " + json.dumps({"id": name, "choices": [
                    {"index": 0, "text": w, "finish_reason": done}]}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    cut, ok = serve_app(worker_app("cut", hang_after=1)), serve_app(worker_app("ok", None))
    infos = {name: WorkerInfo(WorkerId(name), NodeId(name), (NS,), s.url)
             for name, s in (("cut", cut), ("ok", ok))}
    keys = model_keys(EngineConfig(overrides=dict(SMALL), block_tokens=BLOCK))
    workers = StaticWorkers([infos["cut"]])  # at first the cut worker is the only one
    router = CacheAwareRouter(None, workers, RouterConfig.from_model_keys(keys, namespace=NS),
                              keys.tokenizer)
    gw: Served = serve_app(create_app(router))
    try:
        yield {"url": gw.url, "workers": workers, "infos": infos}
    finally:
        RELEASED.set()
        for s in (gw, cut, ok):
            s.stop()


def lapse_later(env: dict[str, Any], after_s: float) -> None:
    """``after_s`` after the cut worker stopped answering, its lease lapses and the other
    worker is registered."""
    HUNG.clear()

    def lapse() -> None:
        HUNG.wait(timeout=30)
        time.sleep(after_s)
        env["workers"].workers = [env["infos"]["ok"]]
    threading.Thread(target=lapse, daemon=True).start()


def test_a_worker_whose_lease_lapses_while_awaited_is_replaced(env: dict[str, Any]) -> None:
    env["workers"].workers = [env["infos"]["cut"]]
    lapse_later(env, 0.5)
    t0 = time.monotonic()
    r = httpx.post(f"{env['url']}/v1/completions", timeout=30,
                   json={"model": NS, "prompt": "a lapse", "max_tokens": 4, "temperature": 0,
                         "deadline_s": 20})
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "".join(WORDS)
    assert r.headers["x-kvshare-worker"] == "ok" and r.headers["x-kvshare-tries"] == "2"
    assert took < 10, took  # given up within a lapse check, not at the 20 s deadline
