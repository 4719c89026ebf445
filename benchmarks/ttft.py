"""TTFT of the reference worker: nothing cached vs prefix on this node vs prefix on another node.

Starts a local ``ray.cluster_utils.Cluster`` (head + 2 nodes), deploys kvshare, and runs one
reference worker (default tiny Llama, fp32, random weights) on each node as a Ray actor.
For a 4,096- and an 8,192-token shared prefix plus a 64-token suffix it measures TTFT inside
the worker (lookup + load + prefill + first token):

- ``cold``: nothing cached (the baseline, measured in the same run);
- ``warm_local``: the prefix is in the worker's node host tier (shared memory);
- ``warm_remote``: the prefix is only in the other node's pool (NIXL over UCX; on one machine
  UCX uses ``cma``, the stand-in for RDMA).

Last line: one JSON object with ``cold_s``, ``warm_local_s``, ``warm_remote_s``,
``speedup_local`` and ``speedup_remote`` for the 8,192-token case (plus the 4,096 figures).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from typing import Any

import ray

from kvshare.actors.deploy import deploy
from kvshare.actors.local_cluster import local_cluster
from kvshare.engines.hf import EngineConfig, model_keys
from kvshare.engines.service import WorkerService

NS = "ttft-bench"
SUFFIX = 64
REPEATS = 3


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def wait_indexed(hashes_hex: list[str], timeout_s: float = 10.0) -> None:
    """Until the index lists every block (pools publish within ~50 ms)."""
    from kvshare.actors.deploy import get_index_client

    client = get_index_client()
    hashes = [bytes.fromhex(h) for h in hashes_hex]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.match(NS, hashes).combined_prefix == len(hashes):  # type: ignore[arg-type]
            return
        time.sleep(0.05)
    raise RuntimeError("blocks did not reach the index in time")


def main() -> int:
    cfg = EngineConfig(threads=2)
    keys = model_keys(cfg)
    with local_cluster(2, head_cpus=0, temp_prefix="kvs-ttft-") as cluster:
        deploy(cluster.address, namespace=NS, layout=keys.layout, host_gb=0.25)
        Worker = ray.remote(num_cpus=2)(WorkerService)
        w = [Worker.options(resources={f"node_{i}": 1}).remote(  # type: ignore[attr-defined]
                NS, cfg, worker_id=f"bench-{i}", serve_http=False) for i in range(2)]
        info = ray.get([x.ready.remote() for x in w], timeout=120)
        print(f"workers ready: {[i['worker_id'] + '@' + i['node'][:8] for i in info]}; "
              f"remote transport: {info[0]['nixl']}", flush=True)
        ray.get(w[0].generate.remote(tokens(300, 99), 1))  # warm-up (allocator, threads)
        results: dict[int, dict[str, Any]] = {}
        for n in (4096, 8192):
            local_prefix, remote_prefix = tokens(n, n), tokens(n, n + 1)
            cold = []
            r = ray.get(w[0].generate.remote(local_prefix + tokens(SUFFIX, 1), 1))
            cold.append(r["ttft_s"])
            r = ray.get(w[1].generate.remote(remote_prefix + tokens(SUFFIX, 2), 1))
            cold.append(r["ttft_s"])
            wait_indexed([h.hex() for h in keys.hashes(local_prefix)])
            wait_indexed([h.hex() for h in keys.hashes(remote_prefix)])
            local, remote, load_local, load_remote = [], [], [], []
            for k in range(REPEATS):
                r = ray.get(w[0].generate.remote(local_prefix + tokens(SUFFIX, 10 + k), 1))
                assert r["reused_tokens"] == n, r
                local.append(r["ttft_s"])
                load_local.append(r["load_s"])
                r = ray.get(w[0].generate.remote(remote_prefix + tokens(SUFFIX, 20 + k), 1))
                assert r["reused_tokens"] == n and not r["bytes_by_transport"].get("shm"), r
                remote.append(r["ttft_s"])
                load_remote.append(r["load_s"])
                transport = ",".join(r["bytes_by_transport"])
            res = {"cold_s": statistics.median(cold), "warm_local_s": statistics.median(local),
                   "warm_remote_s": statistics.median(remote), "remote_transport": transport}
            res["speedup_local"] = res["cold_s"] / res["warm_local_s"]
            res["speedup_remote"] = res["cold_s"] / res["warm_remote_s"]
            results[n] = res
            print(f"prefix {n:5d} + {SUFFIX}: cold {res['cold_s']:.3f}s  warm_local "
                  f"{res['warm_local_s']:.3f}s ({res['speedup_local']:.1f}x)  warm_remote "
                  f"{res['warm_remote_s']:.3f}s ({res['speedup_remote']:.1f}x, {transport}); KV load "
                  f"{statistics.median(load_local) * 1e3:.0f} ms local, "
                  f"{statistics.median(load_remote) * 1e3:.0f} ms remote "
                  f"({n * keys.layout.bytes_per_token / 2**20:.0f} MiB)",
                  flush=True)
        stats = ray.get(w[0].stats.remote())
        print(f"worker 0 counters: {json.dumps(stats['worker'])}", flush=True)
    big, small = results[8192], results[4096]
    out = {k: round(v, 4) if isinstance(v, float) else v for k, v in big.items()}
    out.update({f"{k}_4096": round(v, 4) for k, v in small.items() if isinstance(v, float)})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
