"""Limits on every gateway input, over real HTTP (uvicorn on loopback, a stub worker behind).

Every refusal is an OpenAI-style 4xx naming what to fix, and a refused request never reaches
a worker. The figures printed at the end (bad inputs by kind and status) go in the issue note.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from http_helpers import serve_app, stub_app

from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
from kvshare.router.core.workers_view import StaticWorkers
from kvshare.router.gateway.app import create_app
from kvshare.router.gateway.limits import Limits
from kvshare.types import NodeId, WorkerId
from kvshare.workers import WorkerInfo

LIMITS = Limits(max_body_bytes=64 * 1024, max_depth=16, max_tokens=4096)
PROMPT = "kvshare limits test prompt " * 4
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/route", "/v1/kvshare/lookup")


@pytest.fixture(scope="module")
def gw() -> Iterator[dict[str, Any]]:
    worker = serve_app(stub_app("w0"))
    router = CacheAwareRouter(None, StaticWorkers([WorkerInfo(
        WorkerId("w0"), NodeId("n0"), ("m",), worker.url)]), RouterConfig(namespace="m", block_tokens=16))
    gateway = serve_app(create_app(router, limits=LIMITS))
    try:
        yield {"url": gateway.url, "router": router}
    finally:
        gateway.stop()
        worker.stop()


def post(url: str, body: Any) -> httpx.Response:
    """POST ``body`` as JSON, NaN and Infinity written as Python's json writes them."""
    return httpx.post(url, content=json.dumps(body), timeout=30,
                      headers={"content-type": "application/json"})


def body_for(path: str, **extra: Any) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": PROMPT}], **extra}
    return {"prompt": PROMPT, **extra}


def test_good_requests_still_pass(gw: dict[str, Any]) -> None:
    url = gw["url"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/route"):
        r = httpx.post(url + path, json=body_for(path, max_tokens=16, temperature=0.5,
                                                  top_p=1, stop=["\n"], stream=False), timeout=30)
        assert r.status_code == 200, (path, r.text)
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("max_tokens too large", {"max_tokens": 10**30}, "limit of 4096"),
    ("max_tokens not an int", {"max_tokens": 1.5}, "max_tokens"),
    ("max_tokens zero", {"max_tokens": 0}, "max_tokens"),
    ("temperature NaN", {"temperature": float("nan")}, "NaN"),
    ("temperature Infinity", {"temperature": float("inf")}, "Infinity"),
    ("temperature out of range", {"temperature": 7}, "temperature"),
    ("top_p out of range", {"top_p": 1.5}, "top_p"),
    ("top_k not an int", {"top_k": "many"}, "top_k"),
    ("stream not a bool", {"stream": "yes"}, "stream"),
    ("n too large", {"n": 1000}, "'n'"),
    ("stop too many", {"stop": ["x"] * 100}, "stop"),
]


def test_bad_numbers_kinds_and_lengths_are_400_naming_the_field(gw: dict[str, Any]) -> None:
    url, router = gw["url"], gw["router"]
    before = router.decisions
    seen: dict[str, int] = {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        for kind, extra, words in BAD:
            r = post(url + path, body_for(path, **extra))
            seen[kind] = r.status_code
            assert r.status_code == 400, (path, kind, r.text)
            assert words in r.json()["error"]["message"], (path, kind, r.text)
    for path, body, words in [
        ("/v1/completions", {"prompt": {"text": "x"}}, "'prompt'"),
        ("/v1/completions", {"prompt": [-1, 2]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
        ("/v1/kvshare/lookup", {"prompt": PROMPT, "ttl_s": float("inf")}, "Infinity"),
    ]:
        r = post(url + path, body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (path, r.text)
    assert router.decisions == before, "a refused request was routed"
    print("bad inputs by kind -> status:", json.dumps(seen))


def test_body_size_and_nesting_limits_on_every_endpoint(gw: dict[str, Any]) -> None:
    url = gw["url"]
    huge = json.dumps({"prompt": "x" * (LIMITS.max_body_bytes + 1)})
    deep = '{"prompt": "x", "extra": ' + "[" * 1000 + "]" * 1000 + "}"
    deep_dict = '{"prompt": ' + '{"a": ' * 20 + "1" + "}" * 20 + "}"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(LIMITS.max_body_bytes // 4096 + 2):
            yield b"x" * 4096
        yield b'"}'

    for path in ENDPOINTS:
        r = httpx.post(url + path, content=huge, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"], (path, r.text)
        r = httpx.post(url + path, content=chunks(), timeout=30)
        assert r.status_code == 413, (path, r.status_code, r.text)
        for raw in (deep, deep_dict):
            r = httpx.post(url + path, content=raw, timeout=30)
            assert r.status_code == 400 and "nested" in r.json()["error"]["message"], (path, r.text)
        r = httpx.post(url + path, content=b"{not json", timeout=30)
        assert r.status_code == 400 and "valid JSON" in r.json()["error"]["message"], (path, r.text)
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # still serving


def test_405_says_which_methods_are_allowed(gw: dict[str, Any]) -> None:
    r = httpx.get(gw["url"] + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.headers.get("allow") == "POST", (r.headers, r.text)
    r = httpx.post(gw["url"] + "/health", timeout=30)
    assert r.status_code == 405 and "GET" in r.headers.get("allow", ""), r.headers


def test_openapi_describes_every_request_body(gw: dict[str, Any]) -> None:
    spec = httpx.get(gw["url"] + "/openapi.json", timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/route", "/v1/kvshare/{op}"):
        body = spec["paths"][path]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[1]
        assert name in spec["components"]["schemas"], (path, name)
    chat = spec["components"]["schemas"]["ChatRequest"]
    assert "messages" in chat["required"] and "temperature" in chat["properties"]
