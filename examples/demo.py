"""`make demo`: kvshare end to end on an embedded local Ray with two emulated nodes.

1. starts a local Ray cluster (head + 2 nodes, ``ray.cluster_utils.Cluster``) and deploys
   kvshare (index + one pool actor per node);
2. starts one reference transformers worker (tiny Llama, random weights) on each node;
3. starts the OpenAI-compatible gateway (cache-aware ``cost`` policy) on loopback;
4. drives a multi-user, multi-turn chat workload with shared system prompts and documents
   through the gateway with the official ``openai`` client (two users at a time);
5. prints per-tier hit rates, bytes moved per transport, TTFT cold vs warm and prefill tokens
   saved, and writes ``out/demo.png`` and a screenshot of the live page, ``out/dashboard.png``.

Exits non-zero if no prefix was reused. Runs in a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvshare.ray_env import use_local_ray_defaults

NAMESPACE = "demo"
USERS = 4
TURNS = 4
MAX_TOKENS = 8
SYSTEM_CHARS = 1800
DOC_CHARS = 2200

log = logging.getLogger("kvshare.demo")


@dataclass
class Turn:
    user: int
    turn: int
    worker: str = ""
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    words = ["cache", "tensor", "ray", "node", "prefix", "block", "query", "route", "layer",
             "token", "model", "share", "pool", "index", "remote", "disk", "host", "gpu"]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(words))
    return " ".join(out)[:n]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_cluster() -> Any:
    import ray
    from ray.cluster_utils import Cluster

    os.makedirs("/tmp/ray", exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 256 * 2**20,
        "temp_dir": tempfile.mkdtemp(prefix="kvshare-demo-ray-"),
    })
    for i in range(2):
        cluster.add_node(num_cpus=2, object_store_memory=256 * 2**20, resources={f"node_{i}": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="kvshare-demo", log_to_driver=False)
    return cluster


def start_workers(engine_cfg: Any) -> dict[str, Any]:
    import ray

    from kvshare.engines.service import WorkerService

    worker_cls = ray.remote(num_cpus=1)(WorkerService)
    workers = {
        f"worker-{i}": worker_cls.options(resources={f"node_{i}": 0.1}).remote(  # type: ignore[attr-defined]
            NAMESPACE, engine_cfg, worker_id=f"worker-{i}", model_name="tiny-llama")
        for i in range(2)
    }
    for name, w in workers.items():
        info = ray.get(w.ready.remote(), timeout=180)
        print(f"  {name} on node {info['node'][:8]}  {info['endpoint']}  remote={info['nixl']}")
    return workers


def start_gateway(engine_cfg: Any) -> tuple[str, Any]:
    import uvicorn

    from actors.deploy import get_index_client, measured_bandwidths
    from kvshare.cost import Bandwidths
    from kvshare.engines.hf import model_keys
    from router.embed import CacheAwareRouter, RouterConfig
    from router.gateway import create_app
    from router.workers_view import IndexWorkers

    keys = model_keys(engine_cfg)
    index = get_index_client()
    measured = measured_bandwidths(wait_s=20.0)  # bytes/s the pools probed at start
    print("  measured bandwidths (GB/s): "
          + ", ".join(f"{k}={v / 1e9:.2f}" for k, v in sorted(measured.items())))
    cfg = RouterConfig.from_model_keys(keys, namespace=NAMESPACE, policy="cost",
                                       prefill_tokens_per_s=4000.0,
                                       bandwidths=Bandwidths.from_measured(measured))
    router = CacheAwareRouter(index, IndexWorkers(index), cfg, keys.tokenizer)
    port = _free_port()
    from actors.admin import ClusterAdmin

    app = create_app(router, admin=ClusterAdmin())  # admin: the live page shows the cluster
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}/v1", server


def run_turn(client: Any, t: Turn, messages: list[dict[str, str]]) -> str:
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    extra: dict[str, Any] = {}
    stream = client.chat.completions.create(model="tiny-llama", messages=messages,
                                            max_tokens=MAX_TOKENS, stream=True)
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            if first is None:
                first = time.perf_counter() - start
            text.append(chunk.choices[0].delta.content or "")
        kv = (chunk.model_extra or {}).get("kvshare")
        if kv:
            extra = kv
    t.ttft_s = first if first is not None else time.perf_counter() - start
    t.reused_tokens = int(extra.get("reused_tokens", 0))
    t.prompt_tokens = t.reused_tokens + int(extra.get("computed_tokens", 0))
    t.bytes_by_transport = dict(extra.get("bytes_by_transport", {}))
    t.bytes_by_tier = dict(extra.get("bytes_by_tier", {}))
    t.worker = str(extra.get("worker", ""))
    return "".join(text)


def drive(base_url: str) -> list[Turn]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="demo", max_retries=0, timeout=300)
    systems = [_text(100 + i, SYSTEM_CHARS) for i in range(2)]
    docs = [_text(200 + i, DOC_CHARS) for i in range(2)]
    history: dict[int, list[dict[str, str]]] = {
        u: [{"role": "system", "content": systems[u % 2] + "\n\nDocument:\n" + docs[u % 2]}]
        for u in range(USERS)
    }
    done: list[Turn] = []
    total = USERS * TURNS

    def one(u: int, turn: int) -> Turn:
        history[u].append({"role": "user", "content": f"user {u} turn {turn}: " + _text(
            1000 * u + turn, 120)})
        t = Turn(u, turn)
        answer = run_turn(client, t, history[u])
        history[u].append({"role": "assistant", "content": answer})
        return t

    # Turn 0 seeds the two system prompts two users at a time; later turns run every user at
    # once, so load spreads requests over both nodes and some prefixes are pulled remotely.
    waves = [(0, list(range(b, min(b + 2, USERS)))) for b in range(0, USERS, 2)]
    waves += [(turn, list(range(USERS))) for turn in range(1, TURNS)]
    with ThreadPoolExecutor(USERS) as pool:
        for turn, users in waves:
            for f in [pool.submit(one, u, turn) for u in users]:
                t = f.result()
                done.append(t)
                print(f"  [{len(done):2d}/{total}] user {t.user} turn {t.turn}: "
                      f"{t.prompt_tokens:5d} prompt tokens, {t.reused_tokens:5d} reused, "
                      f"TTFT {t.ttft_s * 1000:7.1f} ms", flush=True)
    return done


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def report(turns: list[Turn], pool_status: dict[str, Any], path: str) -> bool:
    cold = [t.ttft_s for t in turns if t.reused_tokens == 0]
    warm = [t.ttft_s for t in turns if t.reused_tokens > 0]
    prompt = sum(t.prompt_tokens for t in turns)
    reused = sum(t.reused_tokens for t in turns)
    transports: Counter[str] = Counter()
    tiers_moved: Counter[str] = Counter()
    for t in turns:
        transports.update(t.bytes_by_transport)
        tiers_moved.update(t.bytes_by_tier)
    print("\n== kvshare demo ==")
    print(f"requests                 {len(turns)} ({len(cold)} cold, {len(warm)} warm)")
    print(f"prefill tokens saved     {reused:,} of {prompt:,} ({reused / max(prompt, 1):.1%})")
    print(f"TTFT cold   p50 / p90    {_pct(cold, .5) * 1e3:8.1f} / {_pct(cold, .9) * 1e3:8.1f} ms")
    print(f"TTFT warm   p50 / p90    {_pct(warm, .5) * 1e3:8.1f} / {_pct(warm, .9) * 1e3:8.1f} ms")
    if cold and warm:
        print(f"TTFT speed-up (p50)      {statistics.median(cold) / statistics.median(warm):.1f}x")
    print("bytes moved per transport")
    for name, n in sorted(transports.items()):
        print(f"  {name:12s} {n / 2**20:10.1f} MiB")
    print("pool tiers (all nodes)   hits   misses  hit rate   blocks")
    totals: dict[str, Counter[str]] = {}
    for node in pool_status.get("nodes", []):
        for ns in node.get("pool", {}).get("namespaces", {}).values():
            for tier, st in ns.get("tiers", {}).items():
                totals.setdefault(tier, Counter()).update(
                    {k: st.get(k, 0) for k in ("hits", "misses", "blocks")})
    for tier, c in totals.items():
        rate = c["hits"] / max(1, c["hits"] + c["misses"])
        print(f"  {tier:8s}              {c['hits']:6d} {c['misses']:8d}  {rate:7.1%} {c['blocks']:8d}")
    _plot(turns, path)
    print(f"chart: {path}")
    return reused > 0


def _plot(turns: list[Turn], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(turns))
    colors = ["tab:red" if t.reused_tokens == 0 else "tab:green" for t in turns]
    ax.bar(xs, [t.ttft_s * 1e3 for t in turns], color=colors)
    ax.set_xlabel("request (red = cold, green = prefix reused through kvshare)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("kvshare demo: time to first token per request")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def page_screenshot(url: str, path: str) -> None:
    """The gateway's live page in headless Chromium (``make browser``), saved as a PNG."""
    from router.web import browser

    if browser.missing():
        print(f"no screenshot of {url}: {browser.missing()}")
        return
    time.sleep(1.5)  # one more refresh of the page's cluster status after the last request
    browser.screenshot(url, path, wait_for_css="[data-hit-rate]")
    print(f"live page: {url} (screenshot {path})")


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    import ray

    from actors.deploy import deploy, shutdown
    from kvshare.engines.hf import EngineConfig, model_keys

    t0 = time.monotonic()
    engine_cfg = EngineConfig(threads=1)
    print("starting a local Ray cluster with 2 emulated nodes ...", flush=True)
    cluster = start_cluster()
    try:
        layout = model_keys(engine_cfg).layout
        deploy(cluster.address, namespace=NAMESPACE, layout=layout, host_gb=0.06,
               disk_gb=0.5, disk_dir=tempfile.mkdtemp(prefix="kvshare-demo-disk-"))
        print("kvshare deployed; starting 2 reference workers ...", flush=True)
        workers = start_workers(engine_cfg)
        base_url, server = start_gateway(engine_cfg)
        print(f"gateway at {base_url}; driving {USERS} users x {TURNS} turns ...", flush=True)
        turns = drive(base_url)
        from actors.deploy import status

        ok = report(turns, status(), os.path.join("out", "demo.png"))
        page_screenshot(base_url.removesuffix("/v1") + "/dashboard", os.path.join("out", "dashboard.png"))
        server.should_exit = True
        for w in workers.values():
            ray.get(w.stop.remote(), timeout=30)
        print(f"done in {time.monotonic() - t0:.0f} s")
        if not ok:
            print("error: no prefix was reused", file=sys.stderr)
        return 0 if ok else 1
    finally:
        shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    use_local_ray_defaults()
    sys.exit(main())
