"""The index that comes back: killed for good (``ray.kill``, no restart) under gateway load.

A real two-node cluster (``kvshare.actors.deploy.deploy``: index, watcher, a pool per node), two real HTTP
workers registered in the index the way the reference worker does it, and the real gateway
(``IndexWorkers`` + ``IndexClient.connect``) on loopback. While requests flow, the index shard
is killed for good. The gateway must keep answering (load-only routing, no 5xx, /health ok),
the watcher must start a new shard, and the pools' blocks and the workers must be back in it
within 10 s.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from http_helpers import StubWorker, serve_app

pytestmark = pytest.mark.cluster

RAY_NS = "kvs-test-recovery"


def hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(f"recovery/{i}".encode()).digest() for i in range(n)]


@pytest.fixture(scope="module")
def env(ray_cluster: Any) -> Iterator[dict[str, Any]]:
    import ray

    from kvshare.actors.config import NamespaceSpec
    from kvshare.actors.deploy import deploy, get_pool, shutdown
    from kvshare.actors.index.client import IndexClient
    from kvshare.layout import KVLayout
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import IndexWorkers
    from kvshare.router.gateway.app import create_app
    from kvshare.tiers.base import block_checksum

    layout = KVLayout(2, 2, 16, "fp32", 16)
    spec = NamespaceSpec("m", layout, host_bytes=32 * layout.bytes_per_block)
    deploy(namespaces=[spec], ray_namespace=RAY_NS, worker_ttl_s=30.0)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and "node_0" in n["Resources"]]
    data = np.random.default_rng(0).integers(0, 255, (8, layout.bytes_per_block), dtype=np.uint8)
    hs = hashes(8)
    sums = [block_checksum(d) for d in data]
    stored = ray.get(get_pool(nodes[0], RAY_NS).transfer_write_blocks.remote("m", hs, data, sums))
    assert stored == [""] * 8  # stored
    workers = [StubWorker(f"w{i}", IndexClient.connect(RAY_NS), "m", nodes[0]) for i in range(2)]
    index = IndexClient.connect(RAY_NS, timeout_s=2.0)
    router = CacheAwareRouter(index, IndexWorkers(index, refresh_s=0.2),
                              RouterConfig(namespace="m", block_tokens=16, index_timeout_s=1.0))
    gateway = serve_app(create_app(router))
    try:
        yield {"gateway": gateway.url, "hashes": hs, "node": nodes[0], "workers": workers,
               "client": IndexClient.connect(RAY_NS, timeout_s=2.0)}
    finally:
        gateway.stop()
        for w in workers:
            w.stop()
        shutdown(RAY_NS)


def test_index_killed_for_good_under_load_comes_back_without_a_5xx(env: dict[str, Any]) -> None:
    import ray

    from kvshare.actors.config import index_name

    client, hs, url = env["client"], env["hashes"], env["gateway"]
    loc = f"node:{env['node']}"

    def indexed() -> int:
        return int(client.match("m", hs).prefix_for(loc))

    def workers_listed() -> int:
        try:
            return len(client.workers())
        except Exception:
            return 0

    deadline = time.monotonic() + 30
    while (indexed() != 8 or workers_listed() != 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert indexed() == 8 and workers_listed() == 2

    statuses: list[int] = []
    health: list[int] = []
    bad: list[str] = []  # bodies of answers other than 200
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=30.0) as http:
            i = 0
            while not stop.is_set():
                r = http.post(f"{url}/v1/completions",
                              json={"model": "m", "prompt": f"question {i % 5} " * 8, "max_tokens": 2})
                statuses.append(r.status_code)
                if r.status_code != 200:
                    bad.append(r.text[:300])
                if i % 4 == 0:
                    h = http.get(f"{url}/health")
                    health.append(h.status_code)
                    if h.status_code != 200:
                        bad.append(h.text[:300])
                i += 1

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        sent_before = len(statuses)
        ray.kill(ray.get_actor(index_name(0), namespace=RAY_NS), no_restart=True)
        t_kill = time.monotonic()
        back = None
        while time.monotonic() - t_kill < 20:
            if indexed() == 8 and workers_listed() == 2:
                back = time.monotonic() - t_kill
                break
            time.sleep(0.05)
        time.sleep(1.0)  # some load on the new shard too
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    print(f"requests before kill {sent_before}, total {len(statuses)}, recovered in {back} s, "
          f"statuses {sorted(set(statuses))}, health {sorted(set(health))}")
    assert back is not None and back <= 10.0, f"index entries not back within 10 s ({back})"
    assert len(statuses) > sent_before, "no request was answered after the kill"
    assert set(statuses) == {200} and set(health) == {200}, bad[:5]
    watcher = ray.get_actor("kvshare-watcher", namespace=RAY_NS)
    assert ray.get(watcher.status.remote())["index_recreated"] == 1
    # routing uses the new shard's entries again (not a fallback)
    r = httpx.post(f"{url}/v1/route", json={"prompt": "question 1 " * 8}, timeout=30)
    assert r.status_code == 200 and r.json()["fallback"] == "", r.text
