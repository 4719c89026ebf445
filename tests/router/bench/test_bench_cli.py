"""``kvshare bench`` end to end over real HTTP against a stub vLLM server (streaming, usage,
``/metrics`` with vLLM's per-source counters); the live vLLM stack's test is in
``tests/kvshare/vllm/test_vllm_cluster.py``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from http_helpers import Served

from kvshare.cli import main

BLOCK = 16


def stub_vllm(metrics_delay_s: float = 0.0) -> tuple[FastAPI, dict[str, Any]]:
    """Streams ``max_tokens`` one-token chunks; counts a prompt's leading 16-token blocks seen
    before as ``device`` hits, like a prefix cache that never evicts. ``/metrics`` reads the
    counters ``metrics_delay_s`` after it is asked (a busy server's slow scrape)."""
    app = FastAPI()
    state: dict[str, Any] = {"seen": set(), "prompt": 0, "device": 0, "requests": 0}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "stub", "max_model_len": 4096}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        assert all(isinstance(t, int) and 100 <= t < 1024 for t in prompt)
        state["requests"] += 1
        hit = 0
        for i in range(0, len(prompt) - len(prompt) % BLOCK, BLOCK):
            if tuple(prompt[:i + BLOCK]) not in state["seen"]:
                break
            hit += BLOCK
        for i in range(0, len(prompt) - len(prompt) % BLOCK, BLOCK):
            state["seen"].add(tuple(prompt[:i + BLOCK]))
        state["prompt"] += len(prompt)
        state["device"] += hit

        async def events() -> Any:
            for _ in range(n):
                await asyncio.sleep(0.005)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        state["requests"] += 1
        state["messages"] = body["messages"]

        async def events() -> Any:
            for _ in range(body["max_tokens"]):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'x'}}]})}\n\n"
            usage = {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        await asyncio.sleep(metrics_delay_s)
        return PlainTextResponse(
            f'vllm:prompt_tokens_total{{engine="0"}} {state["prompt"]}.0\n'
            f'vllm:prompt_tokens_cached_by_source_total{{engine="0",source="device"}} {state["device"]}.0\n')

    return app, state


def trace(tmp_path: Path) -> Path:
    p = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 64, "output_length": 4, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 100, "input_length": 64, "output_length": 4, "hash_ids": [1, 2, 3, 5]},
            {"timestamp": 200, "input_length": 32, "output_length": 4, "hash_ids": [6, 7]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_bench_against_a_stub_reports_ttft_throughput_hits_and_ratios(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (app_a, a), (app_b, b) = stub_vllm(), stub_vllm()
    sa, sb = Served(app_a), Served(app_b)
    png = tmp_path / "bench.png"
    try:
        rc = main(["bench", "--url", sa.url, "--compare", sb.url, "--trace", str(trace(tmp_path)),
                   "--block-tokens", str(BLOCK), "--vocab", "1024", "--speed", "2", "--json",
                   "--plot", str(png), "--metrics-interval", "0.05"])
    finally:
        sa.stop()
        sb.stop()
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(out.strip().splitlines()[-1])
    assert a["requests"] == b["requests"] == 3  # the same workload, twice
    for run in doc["runs"]:
        assert run["kind"] == "vllm" and run["requests"] == {"sent": 3, "completed": 3, "failed": 0,
                                                             "skipped": 0}
        assert set(run["ttft_s"]) == {"p50", "p90", "p99", "mean"} and run["itl_s"]["p50"] > 0
        assert run["tpot_s"]["p50"] >= 0.004  # the stub's 5 ms a token
        assert run["output_tokens"] == 12 and run["prompt_tokens"] == 160
        assert run["hit_rate_by_tier"]["engine"] == pytest.approx(48 / 160)  # 3 blocks of row 2
        assert run["hit_rate"] == pytest.approx(48 / 160)
    assert doc["ratios"]["hit_rate"] == 1.0 and doc["ratios"]["ttft_p50"] > 0
    assert "TTFT p99 (ms)" in out and "second / first" in out and "engine" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_trace_sends_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    app, state = stub_vllm()
    served = Served(app)
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 16, "hash_ids": [1]}\n'
                 '{"timestamp": 5, "input_length": 40, "hash_ids": [1]}\n')
    try:
        rc = main(["bench", "--url", served.url, "--trace", str(p), "--block-tokens", "16"])
    finally:
        served.stop()
    err = capsys.readouterr().err
    assert rc == 2 and state["requests"] == 0
    assert "line 2: 1 hash ids but input_length 40" in err and "nothing sent" in err


def test_an_unreachable_url_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvshare.engines.server import listening_socket

    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    rc = main(["bench", "--url", f"http://127.0.0.1:{port}", "--trace", str(trace(tmp_path)),
               "--block-tokens", str(BLOCK)])
    assert rc == 2 and f"127.0.0.1:{port}/v1/models" in capsys.readouterr().err


def test_a_chat_log_is_sent_to_chat_completions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    app, state = stub_vllm()
    served = Served(app)
    log = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "What does a prefix cache keep?"}]
    log.write_text("".join(json.dumps({"messages": msgs, "timestamp": 100.0 + t / 10,
                                       "max_tokens": 3}) + "\n" for t in range(3)))
    try:
        rc = main(["bench", "--url", served.url, "--trace", str(log), "--json"])
    finally:
        served.stop()
    run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]
    assert rc == 0 and state["requests"] == 3 and state["messages"] == msgs
    assert run["requests"]["completed"] == 3 and run["output_tokens"] == 9
    assert run["prompt_tokens"] == 21 and run["ttft_s"]["p99"] > 0


def test_the_tier_baseline_is_read_before_the_first_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A scrape slower than the first request's admission (CI's busy machine) must not count
    that request in the baseline: the hit rate is the run's, 48 of 160 tokens, not 48 of 96."""
    app, state = stub_vllm(metrics_delay_s=0.3)
    served = Served(app)
    try:
        rc = main(["bench", "--url", served.url, "--trace", str(trace(tmp_path)),
                   "--block-tokens", str(BLOCK), "--vocab", "1024", "--speed", "2", "--json",
                   "--metrics-interval", "0.05"])
    finally:
        served.stop()
    out = capsys.readouterr().out
    assert rc == 0, out
    run = json.loads(out.strip().splitlines()[-1])["runs"][0]
    assert state["requests"] == 3
    assert run["hit_rate_by_tier"]["engine"] == pytest.approx(48 / 160), run
