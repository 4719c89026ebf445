"""The gateway over real HTTP: uvicorn on loopback, three real worker processes that speak
the OpenAI API and say who served, httpx and the official ``openai`` client."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from http_helpers import Served

from kvshare.actors.index.global_index import GlobalIndex
from kvshare.engines.server import free_port
from kvshare.events import BlockStored
from kvshare.router.core.embed import CacheAwareRouter, InProcessIndex, RouterConfig
from kvshare.router.core.workers_view import StaticWorkers
from kvshare.router.gateway.api_keys import parse_api_keys
from kvshare.router.gateway.app import create_app
from kvshare.tokenizer import ByteTokenizer
from kvshare.types import NodeId, Tier, WorkerId, node_location
from kvshare.workers import WorkerInfo

NS = "llm"
BT = 16
KEYS = {"key-acme": {"tenant": "acme", "salt": "a-salt"}, "key-globex": {"tenant": "globex"}}
PROMPT = "System: you answer questions about kvshare routing. " * 8  # 424 bytes -> 26 blocks

WORKER = textwrap.dedent('''
    import json, sys, time
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    import uvicorn

    name, port = sys.argv[1], int(sys.argv[2])
    app = FastAPI()

    async def handle(request: Request, chat: bool):
        body = await request.json()
        kv = body.get("kvshare") or {}
        text = f"served by {name} tokens={len(kv.get('token_ids', []))}"
        base = {"id": "x1", "created": int(time.time()), "model": body.get("model", "m")}
        if body.get("stream"):
            def gen():
                for piece in text.split(" "):
                    if chat:
                        ch = {"index": 0, "delta": {"content": piece + " "}, "finish_reason": None}
                        obj = "chat.completion.chunk"
                    else:
                        ch = {"index": 0, "text": piece + " ", "finish_reason": None, "logprobs": None}
                        obj = "text_completion"
                    yield "data: " + json.dumps({**base, "object": obj, "choices": [ch]}) + "\\n\\n"
                yield "data: [DONE]\\n\\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        if chat:
            choice = {"index": 0, "finish_reason": "stop",
                      "message": {"role": "assistant", "content": text}}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "finish_reason": "stop", "text": text, "logprobs": None}
            obj = "text_completion"
        usage = {"prompt_tokens": len(kv.get("token_ids", [])), "completion_tokens": 3,
                 "total_tokens": len(kv.get("token_ids", [])) + 3}
        return JSONResponse({**base, "object": obj, "choices": [choice], "usage": usage,
                             "kvshare_seen": kv, "worker": name})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, True)

    @app.get("/health")
    async def health():
        return {"status": "ok", "worker": name}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
''')


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not come up")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def worker_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    script = tmp_path_factory.mktemp("workers") / "worker.py"
    script.write_text(WORKER)
    ports = [free_port() for _ in range(3)]
    procs = [subprocess.Popen([sys.executable, str(script), f"w{i}", str(p)])
             for i, p in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for u in urls:
            wait_http(u + "/health")
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)


@pytest.fixture(scope="module")
def setup(worker_urls: list[str]) -> Iterator[tuple[Served, GlobalIndex, CacheAwareRouter]]:
    index = GlobalIndex()
    index.declare_namespace(NS)
    infos = [WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (NS,), u) for i, u in enumerate(worker_urls)]
    router = CacheAwareRouter(InProcessIndex(index), StaticWorkers(infos),
                              RouterConfig(namespace=NS, model_id="m", block_tokens=BT))
    gw = Served(create_app(router, parse_api_keys(KEYS)))
    yield gw, index, router
    gw.stop()


def client(gw: Served, key: str = "key-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=20)


def test_openai_client_completion_is_forwarded_with_tokens_and_hashes(setup: Any) -> None:
    gw, _, _ = setup
    resp = client(gw).completions.create(model=NS, prompt=PROMPT, max_tokens=4)
    assert resp.choices[0].text.startswith("served by w")
    seen = resp.model_extra["kvshare_seen"]  # type: ignore[index]
    assert seen["token_ids"] == list(PROMPT.encode()) and seen["namespace"] == NS
    assert len(seen["hashes_hex"]) == len(PROMPT) // BT and seen["tenant"] == "acme"
    assert seen["cache_salt"] == "a-salt"


def test_openai_client_streams_chat_through_the_gateway(setup: Any) -> None:
    gw, _, _ = setup
    stream = client(gw, "key-globex").chat.completions.create(
        model=NS, messages=[{"role": "user", "content": "hello there"}], stream=True, max_tokens=4)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text.startswith("served by w") and "tokens=" in text
    non_stream = client(gw).chat.completions.create(
        model=NS, messages=[{"role": "user", "content": "hello there"}])
    assert non_stream.choices[0].message.content.startswith("served by w")  # type: ignore[union-attr]


def test_cached_prefix_routes_to_its_worker_only_for_its_tenant(setup: Any) -> None:
    gw, index, router = setup
    acme_prompt = "Acme's long shared system prompt about routing policies. " * 8
    from kvshare.router.core.embed import Tenant

    hashes = router.hashes(list(acme_prompt.encode()), Tenant("acme", "a-salt"))
    index.apply([BlockStored(NS, node_location("n2"), Tier.HOST, h, 0, i + 1)
                 for i, h in enumerate(hashes)])
    with httpx.Client(base_url=gw.url, timeout=20) as http:
        r = http.post("/v1/completions", json={"model": NS, "prompt": acme_prompt},
                      headers={"Authorization": "Bearer key-acme"})
        assert r.status_code == 200 and r.json()["worker"] == "w2"
        assert r.headers["x-kvshare-reason"] == "cache_local"
        acme = http.post("/v1/route", json={"prompt": acme_prompt},
                         headers={"Authorization": "Bearer key-acme"}).json()
        globex = http.post("/v1/route", json={"prompt": acme_prompt},
                           headers={"Authorization": "Bearer key-globex"}).json()
    assert acme["worker"] == "w2" and acme["cached_blocks"] == len(hashes)
    cands = acme["candidates"]  # every worker's estimate, the chosen first, then best first
    assert cands[0]["worker"] == "w2" and cands[0]["reason"] == "cache_local"
    assert cands[0]["est_ttft_s"] == acme["est_ttft_s"] and len(cands) >= 2
    assert all(c["reason"] != "cache_local" for c in cands[1:])
    assert [c["est_ttft_s"] for c in cands[1:]] == sorted(c["est_ttft_s"] for c in cands[1:])
    assert globex["cached_blocks"] == 0 and globex["reason"] != "cache_local"
    assert acme["tenant"] == "acme" and globex["tenant"] == "globex"


def test_bad_requests_get_openai_style_4xx_errors(setup: Any) -> None:
    gw, _, _ = setup
    auth = {"Authorization": "Bearer key-acme"}
    cases = [
        ("/v1/completions", b"{not json", auth, 400),
        ("/v1/completions", json.dumps([1, 2]).encode(), auth, 400),
        ("/v1/completions", json.dumps({"prompt": 123}).encode(), auth, 400),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), auth, 400),
        ("/v1/chat/completions", json.dumps({"model": NS}).encode(), auth, 400),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "pirate", "content": "x"}]}).encode(), auth, 400),
        ("/v1/completions", json.dumps({"prompt": "x"}).encode(), {"Authorization": "Bearer nope"}, 401),
        ("/v1/completions", json.dumps({"prompt": "x"}).encode(), {}, 401),
    ]
    with httpx.Client(base_url=gw.url, timeout=20) as http:
        for path, body, headers, code in cases:
            r = http.post(path, content=body, headers={**headers, "content-type": "application/json"})
            assert r.status_code == code, (body, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] and "Traceback" not in r.text
        assert http.get("/nope").status_code == 404 and "error" in http.get("/nope").json()
    with pytest.raises(openai.AuthenticationError):
        client(gw, "wrong").completions.create(model=NS, prompt="hi")


def test_health_and_metrics(setup: Any) -> None:
    gw, _, _ = setup
    with httpx.Client(base_url=gw.url, timeout=20) as http:
        http.post("/v1/route", json={"prompt": PROMPT}, headers={"Authorization": "Bearer key-acme"})
        health = http.get("/health").json()
        text = http.get("/metrics").text
    assert health["status"] == "ok" and health["workers"] == 3 and health["decisions"] >= 1
    assert "endpoints" not in health  # a gateway with API keys does not show its workers
    assert 'kvshare_router_decisions_total{policy="cost",reason=' in text
    for name in ("kvshare_router_est_ttft_saved_seconds_total", "kvshare_router_index_latency_seconds_bucket",
                 "kvshare_router_fallbacks_total", "kvshare_gateway_errors_total"):
        assert name in text


def test_unreachable_worker_is_a_502_not_a_crash() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = CacheAwareRouter(None, StaticWorkers([WorkerInfo(WorkerId("d"), NodeId("n"), (NS,), dead)]),
                              RouterConfig(namespace=NS))
    gw = Served(create_app(router))
    try:
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hello"}, timeout=20)
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_unreachable"
        assert len(router.inflight) == 0
    finally:
        gw.stop()


def test_a_request_waits_for_a_worker_to_appear_then_a_503_names_the_wait(
        worker_urls: list[str]) -> None:
    """Workers still starting (or re-registering after a lapsed lease) hold a request for a
    bounded time instead of failing it, tokenizing its prompt once however long it waits;
    with none at the end, a 503 that says it waited."""

    class Counting(ByteTokenizer):
        calls = 0

        def encode(self, text: str) -> list[int]:
            Counting.calls += 1
            return super().encode(text)

    source = StaticWorkers([])
    router = CacheAwareRouter(None, source, RouterConfig(namespace=NS), tokenizer=Counting())
    gw = Served(create_app(router, no_worker_wait_s=20.0))
    late = threading.Timer(0.5, lambda: setattr(source, "workers", [
        WorkerInfo(WorkerId("late"), NodeId("n0"), (NS,), worker_urls[0])]))
    late.start()
    try:
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hello " * 30}, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvshare-worker"] == "late", r.text
        assert Counting.calls == 2  # the first try, then once for all the retries (5 or more)
    finally:
        late.cancel()
        gw.stop()
    gw = Served(create_app(CacheAwareRouter(None, StaticWorkers([]), RouterConfig(namespace=NS)),
                           no_worker_wait_s=0.3))
    try:
        r = httpx.post(gw.url + "/v1/completions", json={"prompt": "hello"}, timeout=20)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text
        assert "waited 0.3 s" in r.json()["error"]["message"] and NS in r.json()["error"]["message"]
    finally:
        gw.stop()
    with pytest.raises(ValueError, match="no_worker_wait_s"):
        create_app(router, no_worker_wait_s=-1)


def test_a_dead_worker_is_routed_around(worker_urls: list[str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    infos = [WorkerInfo(WorkerId("dead"), NodeId("n9"), (NS,), dead),
             WorkerInfo(WorkerId("live"), NodeId("n0"), (NS,), worker_urls[0])]
    router = CacheAwareRouter(None, StaticWorkers(infos), RouterConfig(namespace=NS))
    gw = Served(create_app(router))
    try:
        with httpx.Client(base_url=gw.url, timeout=20) as http:
            for i in range(4):  # every request succeeds; the dead one is tried at most once
                r = http.post("/v1/completions", json={"prompt": f"hello {i} " * 40})
                assert r.status_code == 200 and r.headers["x-kvshare-worker"] == "live", r.text
            text = http.get("/metrics").text
        assert 'kvshare_gateway_upstream_requests_total{status="unreachable",worker="dead"} 1.0' in text
        assert len(router.inflight) == 0
    finally:
        gw.stop()


def test_kvshare_gateway_command_serves_static_workers(worker_urls: list[str], tmp_path: Path) -> None:
    port = free_port()
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvshare.cli", "gateway", "--port", str(port), "--workers",
         ",".join(worker_urls), "--namespace", NS, "--api-keys", str(keys),
         "--bandwidth", "shm=20,nixl=8"],
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        out = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="key-acme",
                            max_retries=0).completions.create(model=NS, prompt=PROMPT)
        assert out.choices[0].text.startswith("served by w")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_gateway_drives_the_reference_worker_without_retokenizing() -> None:
    """Gateway -> real reference worker (random-init tiny Llama on CPU): the worker accepts
    the forwarded token ids and hashes (it rejects hashes that are not its own with 400)."""
    from kvshare.engines.hf import EngineConfig, HFEngine
    from kvshare.engines.server import WorkerServer
    from kvshare.engines.worker import ReferenceWorker

    cfg = EngineConfig(overrides={"num_hidden_layers": 1}, block_tokens=16)
    engine = HFEngine(cfg)
    server = WorkerServer(ReferenceWorker(engine, None),
                          WorkerInfo(WorkerId("ref0"), NodeId("n0"), (NS,)), model_name=NS)
    endpoint = server.start()
    router = CacheAwareRouter(
        None, StaticWorkers([WorkerInfo(WorkerId("ref0"), NodeId("n0"), (NS,), endpoint)]),
        RouterConfig.from_model_keys(engine.keys, namespace=NS), engine.keys.tokenizer)
    gw = Served(create_app(router, parse_api_keys(KEYS)))
    try:
        for key in ("key-acme", "key-globex"):  # two tenants, two salts: both accepted
            out = client(gw, key).completions.create(model=NS, prompt=PROMPT, max_tokens=3)
            assert out.usage is not None and out.usage.prompt_tokens == len(PROMPT.encode())
        assert router.prefill_samples == 2  # the worker's measured prefill reached the cost model
        chat = client(gw).chat.completions.create(
            model=NS, messages=[{"role": "user", "content": PROMPT}], max_tokens=2, stream=True)
        assert sum(1 for _ in chat) >= 1
    finally:
        gw.stop()
        server.stop()
