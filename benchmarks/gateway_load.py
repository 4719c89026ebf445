"""A gateway's requests per second and added latency, against the same upstream reached directly.

One gateway process (``kvshare.router.gateway.app.create_app`` under uvicorn, real HTTP on 127.0.0.1,
the ``cost`` policy, an in-process index holding the shared system prompts' blocks,
:class:`~kvshare.router.core.workers_view.StaticWorkers`, the byte tokenizer) routes OpenAI completions to
``--workers`` upstream ports served by one small process that answers every request at once
(it reads the body and sends a fixed completion: no model). Clients in this process send
prompts of 8,192 tokens (text; every one new: a tail never seen before, after one of 16 shared
system prompts of 2k-6k tokens for most of them, none for the rest), ``--concurrency`` in
flight, for ``--seconds`` per leg.

Legs, alternated ``--rounds`` times in one run (medians reported):
- ``direct``: the same clients and prompts straight to the upstream ports (round robin): the
  baseline, what the upstream and the client cost without a gateway;
- ``gateway``: through the gateway.
Requests/s come from the concurrent legs; added latency (p50/p99, ms) is the gateway leg's
minus the direct leg's at one request in flight (``--sequential`` requests each), so it is
the gateway's own time per request, not queueing behind other clients.

The last line is one JSON object: ``requests_per_s``, ``added_p50_ms``, ``added_p99_ms``,
``vs_direct`` (gateway requests/s over direct requests/s), and the direct figures; also the
gateway process's CPU time per request in the concurrent legs (``gateway_cpu_ms_per_request``,
from /proc: what the gateway costs whatever else the machine runs) and the 1-minute load
average at the end (on a shared machine the wall-clock figures move with it).
``benchmarks/native_value.py`` reuses the legs to run gateways with and without C modules.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (this tree's modules, not an editable install's)

TOKENS = 8192
SYSTEMS = 16
NS = "default"
REPLY = json.dumps({
    "id": "cmpl-0", "object": "text_completion", "model": "model",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": TOKENS, "completion_tokens": 1, "total_tokens": TOKENS + 1},
}).encode()


# ---------------------------------------------------------------- child processes


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An OpenAI completions upstream that answers at once: reads the body, sends REPLY."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(REPLY)).encode())]})
    await send({"type": "http.response.body", "body": REPLY})


def _serve(app: Any, ports: int) -> None:
    """Serve ``app`` on ``ports`` free loopback ports; print them on one line, then run."""
    import uvicorn

    from kvshare.engines.server import listening_socket

    socks = [listening_socket("127.0.0.1", 0) for _ in range(ports)]
    for s in socks:  # (connections queue from now on, before uvicorn accepts them)
        s.listen(2048)
    print(" ".join(str(s.getsockname()[1]) for s in socks), flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=socks)


def _gateway_app(urls: list[str]) -> Any:
    """The gateway as ``kvshare gateway --workers ...`` builds it, plus an in-process index
    that holds the shared system prompts' blocks (as pools would have published them)."""
    from kvshare.actors.index.global_index import GlobalIndex
    from kvshare.auth import WorkerAuth
    from kvshare.events import BlockStored
    from kvshare.router.core.embed import CacheAwareRouter, InProcessIndex, RouterConfig, Tenant
    from kvshare.router.core.workers_view import StaticWorkers
    from kvshare.router.gateway.app import create_app
    from kvshare.types import NodeId, Tier, WorkerId, node_location
    from kvshare.workers import WorkerInfo

    infos = [WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (NS,), url)
             for i, url in enumerate(urls)]
    index = GlobalIndex()
    index.declare_namespace(NS)
    router = CacheAwareRouter(InProcessIndex(index), StaticWorkers(infos),
                              RouterConfig(namespace=NS, policy="cost"))
    rng = random.Random(7)
    for n, system in enumerate(system_prompts()):
        loc = node_location(f"n{rng.randrange(len(urls))}")
        hashes = router.hashes(router.tokenize(prompt=system), Tenant())
        index.apply([BlockStored(NS, loc, Tier.HOST, h, 0, n * TOKENS + k)
                     for k, h in enumerate(hashes)])
    return create_app(router, worker_auth=WorkerAuth.from_secret(None, env={}))


def _child(role: str, args: list[str]) -> None:
    if role == "upstream":
        _serve(upstream_app, int(args[0]))
    else:  # gateway: block the named C modules first (their import fails: the Python paths)
        blocked, urls = args[0], args[1:]
        for name in filter(None, blocked.split(",")):
            sys.modules[f"kvshare._native.{name}"] = None  # type: ignore[assignment]
        _serve(_gateway_app(urls), 1)


# ---------------------------------------------------------------- parent side


class Child:
    """A child process of this script (``--role``) that prints its ports on its first line."""

    def __init__(self, role: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--role", role, *args],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {role} process exited before it listened")
        self.urls = [f"http://127.0.0.1:{p}" for p in line.split()]

    def cpu_s(self) -> float:
        """CPU seconds the process has used (user + system, /proc)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def upstream(workers: int) -> Child:
    return Child("upstream", str(workers))


def gateway(upstream_urls: Sequence[str], blocked: Sequence[str] = ()) -> Child:
    """A gateway process over ``upstream_urls``; ``blocked``: C modules it runs without
    (``_chain``, ``_statemap``: their Python twins instead)."""
    return Child("gateway", ",".join(blocked) or ",", *upstream_urls)


def system_prompts() -> list[str]:
    rng = random.Random(1)
    return [_text(rng, rng.choice((2048, 4096, 6144))) for _ in range(SYSTEMS)]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ,.", k=n))


def bodies(n: int, seed: int) -> list[bytes]:
    """``n`` completion bodies of TOKENS byte tokens each: 3 in 4 after a shared system
    prompt, the rest distinct from their first token; every tail new."""
    rng = random.Random(seed)
    systems = system_prompts()
    out = []
    for i in range(n):
        head = rng.choice(systems) if i % 4 else ""
        prompt = head + _text(rng, TOKENS - len(head))
        out.append(json.dumps({"prompt": prompt, "max_tokens": 1}).encode())
    return out


@dataclass
class Leg:
    requests_per_s: float
    latencies_s: list[float]
    errors: int

    def ms(self, q: float) -> float:
        xs = sorted(self.latencies_s)
        return 1000 * xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


async def leg(urls: Sequence[str], body_list: Sequence[bytes], concurrency: int,
              seconds: float = 0.0, count: int = 0) -> Leg:
    """``concurrency`` clients posting ``body_list`` (in turn) to ``urls`` (round robin) for
    ``seconds``, or ``count`` requests in all."""
    import aiohttp

    lat: list[float] = []
    errors = 0
    sent = 0
    headers = {"content-type": "application/json"}
    conn = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def warm(url: str) -> None:  # connections open before the clock starts
            async with session.post(f"{url}/v1/completions", data=body_list[0],
                                    headers=headers) as r:
                await r.read()

        await asyncio.gather(*(warm(u) for u in urls))
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def client() -> None:
            nonlocal sent, errors
            while (time.perf_counter() < deadline) if seconds else sent < count:
                i = sent
                sent += 1
                t = time.perf_counter()
                async with session.post(f"{urls[i % len(urls)]}/v1/completions",
                                        data=body_list[i % len(body_list)],
                                        headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return Leg(len(lat) / wall, lat, errors)


def run_leg(urls: Sequence[str], body_list: Sequence[bytes], concurrency: int,
            seconds: float = 0.0, count: int = 0) -> Leg:
    got = asyncio.run(leg(urls, body_list, concurrency, seconds, count))
    if got.errors:
        raise RuntimeError(f"{got.errors} requests to {urls[0]} failed")
    return got


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("upstream", "gateway"), help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=5.0, help="per concurrent leg (default 5)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    ap.add_argument("--sequential", type=int, default=200,
                    help="requests per one-in-flight latency leg (default 200)")
    ap.add_argument("--rounds", type=int, default=2, help="direct/gateway alternations (default 2)")
    ap.add_argument("--workers", type=int, default=4, help="upstream ports (default 4)")
    args, rest = ap.parse_known_args()
    if args.role:
        _child(args.role, rest)
        return
    body_list = bodies(2000, seed=2)
    up = upstream(args.workers)
    gw = gateway(up.urls)
    try:
        direct: dict[str, list[float]] = {"rps": [], "p50": [], "p99": []}
        via: dict[str, list[float]] = {"rps": [], "p50": [], "p99": [], "cpu_ms": []}
        run_leg(gw.urls, body_list, 4, count=200)  # warm-up: both sides' first requests
        for _ in range(args.rounds):
            for urls, into in ((up.urls, direct), (gw.urls, via)):
                one = run_leg(urls, body_list, 1, count=args.sequential)
                cpu0 = gw.cpu_s()
                many = run_leg(urls, body_list, args.concurrency, seconds=args.seconds)
                if into is via:
                    into["cpu_ms"].append(1000 * (gw.cpu_s() - cpu0) / len(many.latencies_s))
                into["p50"].append(one.ms(50))
                into["p99"].append(one.ms(99))
                into["rps"].append(many.requests_per_s)
    finally:
        gw.stop()
        up.stop()
    d = {k: _median(v) for k, v in direct.items()}
    g = {k: _median(v) for k, v in via.items()}
    print(f"prompts {TOKENS} tokens (byte tokenizer), {args.workers} upstream ports answering at "
          f"once, {args.concurrency} in flight, {args.seconds:g} s per leg, median of "
          f"{args.rounds} alternated rounds; os.cpu_count()={os.cpu_count()}")
    print(f"direct to upstream: {d['rps']:8.0f} req/s   p50 {d['p50']:6.2f} ms  "
          f"p99 {d['p99']:6.2f} ms (one in flight)")
    print(f"through gateway:    {g['rps']:8.0f} req/s   p50 {g['p50']:6.2f} ms  "
          f"p99 {g['p99']:6.2f} ms (one in flight)")
    load = os.getloadavg()[0]
    print(f"gateway / direct: {g['rps'] / d['rps']:.3f}x requests/s; added p50 "
          f"{g['p50'] - d['p50']:.2f} ms, p99 {g['p99'] - d['p99']:.2f} ms; gateway CPU "
          f"{g['cpu_ms']:.2f} ms a request; load average {load:.1f}")
    print(json.dumps({
        "requests_per_s": round(g["rps"], 1),
        "added_p50_ms": round(g["p50"] - d["p50"], 3),
        "added_p99_ms": round(g["p99"] - d["p99"], 3),
        "vs_direct": round(g["rps"] / d["rps"], 4),
        "direct_requests_per_s": round(d["rps"], 1),
        "direct_p50_ms": round(d["p50"], 3), "direct_p99_ms": round(d["p99"], 3),
        "gateway_p50_ms": round(g["p50"], 3), "gateway_p99_ms": round(g["p99"], 3),
        "gateway_cpu_ms_per_request": round(g["cpu_ms"], 3), "load_avg_1m": round(load, 2),
        "tokens": TOKENS, "concurrency": args.concurrency, "seconds": args.seconds,
        "rounds": args.rounds, "workers": args.workers,
    }))


if __name__ == "__main__":
    main()
