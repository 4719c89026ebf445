"""Warm TTFT end to end: through the gateway over HTTP vs inside the worker, same prompt, same run.

Starts a local ``ray.cluster_utils.Cluster`` (head + 2 nodes), deploys kvshare, one reference
worker (tiny Llama, fp32, random weights, byte tokenizer) per node serving HTTP, and the
gateway (``cost`` policy, uvicorn on loopback). A ``--prefix``-token prefix (default 4,096) plus
a 64-token suffix, sent as text (printable ASCII: one byte token per character, so the gateway's
tokenizer gives exactly the ids the in-process leg uses):

- ``gateway_cold_s``: a new prefix through the gateway, nothing cached (the official
  ``openai`` client, streamed, one token as in the in-process leg; TTFT = the first chunk
  carrying a choice at the client. The random-weight byte model often generates a token with
  no text of its own (a special, or a byte of an unfinished UTF-8 character): the worker then
  sends its first chunk at the end, right after that token, so with ``max_tokens=1`` the chunk
  still marks the first token, where waiting for visible text would wait for later tokens);
- ``back_to_back_reuse``: the moment that answer ends, the same prefix with another suffix:
  the fraction of the prefix's full blocks the worker reused (read-after-write);
- ``gateway_warm_s``: the cached prefix with a new suffix, through the gateway;
- ``inprocess_warm_s``: the same prompts on the same worker without HTTP, TTFT measured inside
  the worker (lookup + load + prefill + first token, as ``benchmarks/ttft.py``), interleaved
  with the gateway's;
- ``overhead_ratio`` = ``gateway_warm_s / inprocess_warm_s`` (target <= 1.5);
- ``gateway_warm_ids_s`` / ``overhead_ratio_token_ids``: the same warm requests with the prompt
  as a list of token ids. ``client_prep_ms`` is what the ``openai`` client spends before its
  request leaves (an httpx request hook): for a token-id prompt that is openai-python's
  ``maybe_transform`` walking every id (~10-20 us each), the client's cost, not the gateway's.

It prints the gateway requests' TTFT breakdown (:mod:`kvshare.breakdown`, cold vs warm
medians) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # before benchmarks/router.py

import httpx
import ray

from kvshare.actors.deploy import deploy, get_index_client, measured_bandwidths
from kvshare.actors.local_cluster import local_cluster
from kvshare.breakdown import WORKER_STAGES, medians, summary, total
from kvshare.cost import Bandwidths
from kvshare.engines.hf import EngineConfig, model_keys
from kvshare.engines.service import WorkerService
from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
from kvshare.router.core.workers_view import IndexWorkers
from kvshare.router.gateway.app import create_app

NS = "e2e-bench"
SUFFIX = 64


def tokens(n: int, seed: int) -> list[int]:
    """``n`` printable ASCII byte tokens (the byte tokenizer's ids of the same text)."""
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def text(ids: list[int]) -> str:
    return bytes(ids).decode("ascii")


class Client:
    """The official ``openai`` client with an httpx hook noting when each request leaves."""

    def __init__(self, url: str) -> None:
        from openai import OpenAI

        self.sent = 0.0
        http = httpx.Client(timeout=300, event_hooks={"request": [self._sent]})
        self.openai = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300,
                             http_client=http)

    def _sent(self, _request: httpx.Request) -> None:
        self.sent = time.perf_counter()

    def streamed(self, prompt: str | list[int]) -> tuple[float, float, dict[str, Any]]:
        """(TTFT at the client, the client's time before its request left, the answer's
        ``kvshare`` object, with the gateway's ``x-kvshare-breakdown`` header as
        ``stream_stages``) of one streamed completion."""
        t0 = time.perf_counter()
        first: float | None = None
        kv: dict[str, Any] = {}
        raw = self.openai.completions.with_raw_response.create(model=NS, prompt=prompt,
                                                               max_tokens=1, stream=True)
        stages = json.loads(raw.headers.get("x-kvshare-breakdown", "{}"))
        for chunk in raw.parse():
            if first is None and chunk.choices:
                first = time.perf_counter() - t0
            kv = (chunk.model_extra or {}).get("kvshare") or kv
        kv = {**kv, "stream_stages": stages}
        return (first if first is not None else time.perf_counter() - t0), self.sent - t0, kv


def start_gateway(keys: Any) -> tuple[str, Any]:
    import uvicorn

    index = get_index_client()
    cfg = RouterConfig.from_model_keys(
        keys, namespace=NS, policy="cost",
        bandwidths=Bandwidths.from_measured(measured_bandwidths(wait_s=20.0)))
    router = CacheAwareRouter(index, IndexWorkers(index), cfg, keys.tokenizer)
    server = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", port=0,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}", server


def gateway_process(address: str, cfg: EngineConfig) -> tuple[str, subprocess.Popen[bytes]]:
    """``kvshare gateway`` in its own process, as an operator runs it (no GIL shared with the
    client or the Ray driver)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvshare.cli", "gateway", "--address", address, "--namespace", NS,
         "--engine-config", json.dumps(dataclasses.asdict(cfg)), "--port", str(port)], env=env)
    return f"http://127.0.0.1:{port}", proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=4096, help="prefix tokens")
    ap.add_argument("--repeats", type=int, default=5, help="warm requests per path")
    ap.add_argument("--gateway-process", action="store_true",
                    help="run the gateway as its own process (kvshare gateway --address) instead "
                    "of a thread of this one")
    args = ap.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)
    cfg = EngineConfig(threads=2)
    keys = model_keys(cfg)
    with local_cluster(2, head_cpus=0, temp_prefix="kvs-e2e-") as cluster:
        deploy(cluster.address, namespace=NS, layout=keys.layout, host_gb=0.25)
        Worker = ray.remote(num_cpus=1)(WorkerService)
        workers = {f"w{i}": Worker.options(resources={f"node_{i}": 1}).remote(  # type: ignore[attr-defined]
            NS, cfg, worker_id=f"w{i}", model_name=NS) for i in range(2)}
        ray.get([w.ready.remote() for w in workers.values()], timeout=180)
        if args.gateway_process:
            url, proc = gateway_process(cluster.address, cfg)
        else:
            url, server = start_gateway(keys)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health").json().get("workers", 0) >= 2:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        client = Client(url)
        client.streamed(text(tokens(300, 99)))  # warm-up (allocator, threads, HTTP connections)
        block = keys.layout.block_tokens
        full = args.prefix // block * block
        cold, reuse, cold_bd = [], [], []
        for k in range(2):  # a new prefix, then the next turn the moment its answer ends
            prefix = tokens(args.prefix, 1000 + k)
            ttft, _, kv = client.streamed(text(prefix + tokens(SUFFIX, 1)))
            cold.append(ttft)
            cold_bd.append(kv.get("breakdown", {}))
            _, _, kv = client.streamed(text(prefix + tokens(SUFFIX, 2)))
            reuse.append(int(kv.get("reused_tokens", 0)) / full)
            print(f"cold {ttft:.3f}s; back-to-back turn reused {kv.get('reused_tokens')} of "
                  f"{full} prefix tokens ({kv.get('plan', {}).get('reason')})", flush=True)
        holder = httpx.post(url + "/v1/route", json={"prompt": prefix + tokens(SUFFIX, 3)},
                            timeout=30).json()["worker"]
        gw, gw_ids, prep, prep_ids, inproc, warm_bd, beyond = [], [], [], [], [], [], []
        first_gap: list[float] = []
        for k in range(args.repeats):  # interleaved: text, token ids, in-process; new suffixes
            ttft, before, kv = client.streamed(text(prefix + tokens(SUFFIX, 10 + k)))
            assert kv.get("reused_tokens", 0) >= full * 0.95, kv
            gw.append(ttft)
            prep.append(before)
            warm_bd.append(kv.get("breakdown", {}))
            beyond.append(ttft - before - total(warm_bd[-1]))
            worker = sum(float(warm_bd[-1].get(k, 0.0)) for k in WORKER_STAGES)
            first_gap.append(float(kv["stream_stages"].get("upstream", 0.0)) - worker)
            ttft, before, kv = client.streamed(prefix + tokens(SUFFIX, 30 + k))
            assert kv.get("reused_tokens", 0) >= full * 0.95, kv
            gw_ids.append(ttft)
            prep_ids.append(before)
            r = ray.get(workers[holder].generate.remote(prefix + tokens(SUFFIX, 20 + k), 1))
            assert r["reused_tokens"] >= full * 0.95, r
            inproc.append(r["ttft_s"])
        print(summary({"cold": cold_bd, "warm": warm_bd}), flush=True)
        if args.gateway_process:
            proc.terminate()
            proc.wait(timeout=30)
        else:
            server.should_exit = True
    out = {
        "prefix_tokens": args.prefix, "gateway": "process" if args.gateway_process else "thread",
        "inprocess_warm_s": round(statistics.median(inproc), 4),
        "gateway_warm_s": round(statistics.median(gw), 4),
        "gateway_cold_s": round(statistics.median(cold), 4),
        "overhead_ratio": round(statistics.median(gw) / statistics.median(inproc), 3),
        "gateway_warm_ids_s": round(statistics.median(gw_ids), 4),
        "overhead_ratio_token_ids": round(statistics.median(gw_ids) / statistics.median(inproc), 3),
        "client_prep_ms": round(statistics.median(prep) * 1e3, 2),
        "client_prep_ids_ms": round(statistics.median(prep_ids) * 1e3, 2),
        "back_to_back_reuse": round(min(reuse), 4),
        "warm_breakdown_ms": {k: round(v * 1e3, 2) for k, v in medians(warm_bd).items()},
        # the client's TTFT less its own preparation and the stages: the first token's way
        # from the engine to the client (worker event loop, relay, client parsing)
        "warm_beyond_stages_ms": round(statistics.median(beyond) * 1e3, 2),
        # the gateway's wait for the first chunk less the worker's stages: the request's and
        # the first token's way between gateway and worker (worker event loop included)
        "warm_first_chunk_gap_ms": round(statistics.median(first_gap) * 1e3, 2),
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
