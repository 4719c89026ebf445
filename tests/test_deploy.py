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
                 "--namespace", "chat", "--bandwidth", "objstore=1.5")
    assert up.returncode == 0, up.stderr
    assert "chat" in up.stdout and "host" in up.stdout and "disk" in up.stdout  # the table

    st = kvshare("status", *addr, "--json")
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout.strip().splitlines()[-1])
    alive = [n for n in status["nodes"] if n["alive"]]
    assert len(alive) == 3 and all("pool" in n for n in alive)
    assert all(n["bandwidth_gbps"]["objstore"] == 1.5 for n in alive)  # config override
    tiers = alive[0]["pool"]["namespaces"]["chat"]["tiers"]
    assert tiers["host"]["capacity_bytes"] > 0 and tiers["disk"]["capacity_bytes"] > 0
    assert tiers["host"]["blocks"] == 0
    assert status["index"][0]["namespaces"]["chat"]["blocks"] == 0

    # the same from Python: a second namespace joins the running deployment
    import kvshare as kvs
    from kvshare.layout import KVLayout

    st2 = kvs.deploy(namespace="code", layout=KVLayout(2, 2, 16, "fp16", 16), host_gb=0.01,
                         ray_namespace=RAY_NS)
    pools = [n["pool"] for n in st2["nodes"] if n["alive"]]
    assert len(pools) == 3 and all(set(p["namespaces"]) == {"chat", "code"} for p in pools)

    down = kvshare("down", *addr)
    assert down.returncode == 0 and "actors removed" in down.stdout, down.stderr
    left = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == RAY_NS]
    assert left == []
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("kvshare-chat-")]
