"""``kvshare up`` / ``status`` / ``down`` against a running local Ray cluster, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.cluster

KVSHARE = os.path.join(os.path.dirname(sys.executable), "kvshare")
RAY_NS = "kvs-test-cli"


def kvshare(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVSHARE, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


def test_up_status_down(ray_cluster: Any, tmp_path: Any) -> None:
    import ray

    addr = ["--address", ray_cluster.address, "--ray-namespace", RAY_NS]
    refused = kvshare("up", *addr, "--host-gb", "100000")
    assert refused.returncode == 2 and "lower --host-gb" in refused.stderr
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == RAY_NS]

    up = kvshare("up", *addr, "--host-gb", "0.02", "--disk-dir", str(tmp_path), "--disk-gb", "0.02",
                 "--namespace", "chat", "--bandwidth", "objstore=1.5", "--probe-every", "2")
    assert up.returncode == 0, up.stderr
    assert "chat" in up.stdout and "host" in up.stdout and "disk" in up.stdout  # the table

    st = kvshare("status", *addr, "--json")
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout.strip().splitlines()[-1])
    alive = [n for n in status["nodes"] if n["alive"]]
    assert len(alive) == 3 and all("pool" in n for n in alive)
    assert all(n["bandwidth_bytes_per_s"]["objstore"] == 1.5e9 for n in alive)  # config override
    tiers = alive[0]["pool"]["namespaces"]["chat"]["tiers"]
    assert tiers["host"]["capacity_bytes"] > 0 and tiers["disk"]["capacity_bytes"] > 0
    assert tiers["host"]["blocks"] == 0
    assert status["index"][0]["namespaces"]["chat"]["blocks"] == 0

    scrape_metrics(addr, alive[0]["node_id"], tiers["host"]["capacity_bytes"])
    probes_repeat(alive[0]["node_id"])

    # the same from Python: a second namespace joins the running deployment
    from kvshare.actors.deploy import deploy
    from kvshare.layout import KVLayout

    st2 = deploy(namespace="code", layout=KVLayout(2, 2, 16, "fp16", 16), host_gb=0.01,
                 ray_namespace=RAY_NS)
    pools = [n["pool"] for n in st2["nodes"] if n["alive"]]
    assert len(pools) == 3 and all(set(p["namespaces"]) == {"chat", "code"} for p in pools)

    down = kvshare("down", *addr)
    assert down.returncode == 0 and "actors removed" in down.stdout, down.stderr
    left = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == RAY_NS]
    assert left == []
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("kvshare-chat-")]


def scrape_metrics(addr: list[str], node: str, host_capacity: int) -> None:
    """``kvshare metrics`` serves the pools' and index's figures as Prometheus text over HTTP:
    a block written on ``node`` shows up in its tier gauges, its hit counter and the index."""
    import hashlib
    import time

    import httpx
    import numpy as np
    import ray
    from prometheus_client.parser import text_string_to_metric_families

    from kvshare.tiers.base import block_checksum

    proc = subprocess.Popen([KVSHARE, "metrics", *addr, "--port", "0", "--host", "127.0.0.1"],
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        while line and "/metrics" not in line:
            line = proc.stderr.readline()
        url = line.split()[3]

        def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            text = httpx.get(url, timeout=30).text
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for fam in text_string_to_metric_families(text) for s in fam.samples}

        def one(m: dict[Any, float], name: str, **labels: str) -> float:
            return m[(name, tuple(sorted(labels.items())))]

        before = scrape()
        host = {"node": node, "namespace": "chat", "tier": "host"}
        assert one(before, "kvshare_status_up") == 1 and one(before, "kvshare_index_up") == 1
        assert one(before, "kvshare_pool_up", node=node) == 1
        assert one(before, "kvshare_pool_capacity_bytes", **host) == host_capacity
        assert one(before, "kvshare_pool_blocks", **host) == 0
        assert one(before, "kvshare_transfer_bandwidth_bytes_per_second", node=node, transport="objstore") == 1.5e9
        assert one(before, "kvshare_index_blocks", shard="0", namespace="chat") == 0

        pool = ray.get_actor(f"kvshare-pool-{node}", namespace=RAY_NS)
        block_bytes = ray.get(pool.stats.remote())["namespaces"]["chat"]["block_bytes"]
        h = hashlib.sha256(b"metrics-test").digest()
        one_block = np.ones((1, block_bytes), np.uint8)
        sums = [block_checksum(one_block[0])]
        assert ray.get(pool.transfer_write_blocks.remote("chat", [h], one_block, sums)) == [""]
        assert ray.get(pool.transfer_read_blocks.remote("chat", [h])).reasons == ("",)
        deadline = time.monotonic() + 10
        after = scrape()
        while one(after, "kvshare_index_blocks", shard="0", namespace="chat") != 1:
            assert time.monotonic() < deadline, "the index never showed the written block"
            time.sleep(0.2)
            after = scrape()
        assert one(after, "kvshare_pool_blocks", **host) == 1
        assert one(after, "kvshare_pool_used_bytes", **host) == block_bytes
        assert one(after, "kvshare_pool_stores_total", **host) == 1
        assert one(after, "kvshare_pool_hits_total", **host) >= 1
        assert one(after, "kvshare_index_applied_total", shard="0") >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def probes_repeat(node: str) -> None:
    """With ``--probe-every 2`` a node's bandwidths are measured again and again, not only at
    start (so the cost model follows bandwidth that changes under load)."""
    import time

    import ray

    pool = ray.get_actor(f"kvshare-pool-{node}", namespace=RAY_NS)

    def measured_at() -> float:
        return float(ray.get(pool.transfer_bandwidths.remote(), timeout=30)["measured_at"])

    deadline = time.monotonic() + 60
    first = measured_at()
    while first == 0:  # the first probe round is still running
        assert time.monotonic() < deadline, "no probe ever finished"
        time.sleep(0.2)
        first = measured_at()
    while measured_at() <= first:
        assert time.monotonic() < deadline, "the bandwidth probe never ran again"
        time.sleep(0.2)
