"""The open-loop sender: every request at its arrival time scaled by ``speed``, streamed.

As in vLLM's serving benchmark: a request's TTFT is from sending it until the first streamed
chunk with choices; inter-token latencies are the gaps between later such chunks (one chunk,
one gap; a proxy that relays several chunks in one read shows near-zero gaps), and TPOT
per request is (last chunk - first chunk) / (output tokens - 1), which batching does not
skew. Token counts are the server's ``usage`` (asked for with
``stream_options.include_usage``); ``ignore_eos`` makes the output as long as the trace's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvshare.router.bench.workload import BenchRequest, Workload


@dataclass
class RequestResult:
    """One request's measurements; ``error`` is None when it completed."""

    row: int
    sent_s: float  # from the run's start
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    decode_s: float = 0.0  # first chunk to last
    done_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    worker: str = ""  # the gateway's x-kvshare-worker
    gateway: bool = False  # the answer carried the gateway's usage extension
    sources: dict[str, int] | None = None  # a kvshare worker's reused tokens by source


@dataclass(frozen=True)
class Limits:
    speed: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None  # no request is sent after this; in-flight ones finish
    timeout_s: float = 300.0


@dataclass
class RunResult:
    url: str
    model: str
    results: list[RequestResult]
    wall_s: float
    skipped: int = 0  # not sent: past --duration


async def served_model(http: httpx.AsyncClient, url: str) -> tuple[str, int | None]:
    """The first model ``url`` serves and its ``max_model_len`` (None when not said)."""
    r = await http.get(f"{url}/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model; pass --model")
    first = data[0]
    n = first.get("max_model_len")
    return str(first["id"]), int(n) if isinstance(n, int) else None


async def send(http: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
               t0: float) -> RequestResult:
    chat = bool(req.messages)
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0,
                            "ignore_eos": True}
    if chat:
        body["messages"] = list(req.messages)
    else:
        body["prompt"] = list(req.prompt)
    start = time.perf_counter()
    res = RequestResult(req.row, start - t0)
    last = start
    try:
        async with http.stream("POST", f"{url}/v1/{'chat/completions' if chat else 'completions'}",
                               json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {r.status_code}: {text}"
                return res
            res.worker = r.headers.get("x-kvshare-worker", "")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in event:  # an error the server streamed after its 200
                    res.error = f"streamed error: {str(event['error'])[:300]}"
                    return res
                if event.get("choices"):
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.decode_s = now - start - res.ttft_s
                usage = event.get("usage")
                if isinstance(usage, dict):
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                if "kvshare" in event:
                    res.gateway = True
                    by_source = (event["kvshare"] or {}).get("tokens_by_source")
                    if isinstance(by_source, dict):
                        res.sources = {str(k): int(v) for k, v in by_source.items()}
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.done_s = time.perf_counter() - t0
    if res.ttft_s is None:
        res.error = "no token streamed"
    return res


async def replay(url: str, model: str, workload: Workload, limits: Limits,
                 progress: Callable[[int, int, int, float], None] | None = None) -> RunResult:
    """Send ``workload`` to ``url``; ``progress(sent, done, failed, elapsed_s)`` about once a
    second."""
    sem = asyncio.Semaphore(limits.max_concurrency) if limits.max_concurrency else None
    results: list[RequestResult] = []
    counts = {"sent": 0}
    http = httpx.AsyncClient(timeout=httpx.Timeout(limits.timeout_s, connect=30.0),
                             limits=httpx.Limits(max_connections=limits.max_concurrency or 1000))
    t0 = time.perf_counter()

    async def one(req: BenchRequest) -> None:
        if sem is not None:
            async with sem:
                results.append(await send(http, url, model, req, t0))
        else:
            results.append(await send(http, url, model, req, t0))

    async def report() -> None:
        while True:
            await asyncio.sleep(1.0)
            if progress is not None:
                failed = sum(r.error is not None for r in results)
                progress(counts["sent"], len(results), failed, time.perf_counter() - t0)

    reporter = asyncio.create_task(report())
    tasks: list[asyncio.Task[None]] = []
    skipped = 0
    try:
        for req in workload.requests:
            at = req.arrival_s / limits.speed
            if limits.duration_s is not None and at > limits.duration_s:
                skipped = len(workload.requests) - len(tasks)
                break
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            counts["sent"] += 1
            tasks.append(asyncio.create_task(one(req)))
        await asyncio.gather(*tasks)
    finally:
        reporter.cancel()
        await http.aclose()
    if progress is not None:
        progress(counts["sent"], len(results), sum(r.error is not None for r in results),
                 time.perf_counter() - t0)
    results.sort(key=lambda r: r.sent_s)
    return RunResult(url, model, results, time.perf_counter() - t0, skipped)
