"""Recompute or load, by link rate: an 8k-token prefix held only in host A's pool, the request
arrives at host B (root only: emulated hosts).

Two emulated hosts (:class:`kvshare.testing.hosts.EmulatedHosts`, UCX over TCP between them),
kvshare deployed, the reference transformers worker (``kvshare.engines``: the built-in tiny
Llama, fp32, 4 layers, 8 KiB of KV per token; used instead of vLLM to stay feasible on 2
cores). Host A's worker computes the prefix and stores it in A's pool. On host B three workers
answer the same prefix + a 64-token suffix: ``recompute`` (no cache), ``load`` (cut policy
``all``: loads everything it finds) and ``kvshare`` (the default ``cost`` cut). For each rate
of host A's link (tbf; ``None`` unshaped) B's pool re-probes A and the kvshare worker re-reads
the figures; every worker gets a prefix of its own, freshly stored on A, so nothing of it is on
B. Last line: JSON with per rate ``recompute_s``, ``load_s``, ``kvshare_s`` (TTFT inside the
worker), the crossover rate (the lowest rate at which the kvshare worker loaded, against the
lowest at which loading beat recomputing) and ``worst_vs_best`` = max over rates of
``kvshare_s / min(recompute_s, load_s)`` (target <= 1.10).

    sudo .venv/bin/python benchmarks/link_sweep.py
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvshare.engines.service import WorkerService

NS = "sweep"
PREFIX = 8192
SUFFIX = 64
RATES: list[str | None] = ["100mbit", "300mbit", "1gbit", "3gbit", None]


class SweepWorker(WorkerService):
    """A reference worker that re-reads its node's bandwidths when asked (after a re-probe)."""

    def refresh_bandwidths(self) -> dict[str, float]:
        if self.client is None:
            return {}
        self.client.choose_remote()
        return dict(self.client.bandwidths)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def pools_by_ip() -> dict[str, tuple[str, Any]]:
    """Node pool actors keyed by their node's IP: (Ray node id, actor)."""
    import ray

    from kvshare.discovery import RAY_NAMESPACE, pool_name

    out = {}
    for node in ray.nodes():
        if node["Alive"]:
            try:
                out[node["NodeManagerAddress"]] = (node["NodeID"], ray.get_actor(
                    pool_name(node["NodeID"]), namespace=RAY_NAMESPACE))
            except ValueError:
                pass
    return out


def main() -> dict[str, Any]:
    import ray

    from kvshare.actors.deploy import deploy, shutdown
    from kvshare.engines.hf import EngineConfig, model_keys
    from kvshare.testing.hosts import EmulatedHosts
    from kvshare.transfer.probe import PROBE_NAMESPACE

    cfg = EngineConfig()
    keys = model_keys(cfg)
    prefix_mib = PREFIX * keys.layout.bytes_per_token / 2**20
    rows: dict[str, dict[str, Any]] = {}
    with EmulatedHosts(2, ray=True, shm_mb=1536, object_store_mb=200) as hs:
        hs.connect_ray("kvs-link-sweep")
        a, b = hs[0], hs[1]
        try:
            deploy(namespace=NS, layout=keys.layout, host_gb=1.0)
            pools = pools_by_ip()
            node_a, pool_a = pools[a.ip]
            pool_b = pools[b.ip][1]
            worker = ray.remote(num_cpus=0)(SweepWorker)
            on_a = worker.options(resources={a.name: 0.01}).remote(NS, cfg, worker_id="a", serve_http=False)
            on_b = {name: worker.options(resources={b.name: 0.01}).remote(
                NS, cfg, worker_id=f"b-{name}", serve_http=False, connect=connect, cut_policy=cut)
                for name, connect, cut in (("recompute", False, "cost"), ("load", True, "all"),
                                           ("kvshare", True, "cost"))}
            ray.get([on_a.ready.remote(), *(w.ready.remote() for w in on_b.values())], timeout=600)
            ray.get(on_b["recompute"].generate.remote(tokens(300, 1), 1), timeout=120)  # warm-up
            seed = 100
            for rate in RATES:
                label = rate or "unshaped"
                hs.shape(a, rate)
                try:
                    ray.get(pool_b.transfer_measure.remote(PROBE_NAMESPACE, {node_a: pool_a}),
                            timeout=300)
                    per_node = ray.get(pool_b.transfer_bandwidths.remote())["per_node"]
                    measured = per_node.get(node_a, {})
                    bw = ray.get(on_b["kvshare"].refresh_bandwidths.remote(), timeout=60)
                    row: dict[str, Any] = {"probe_nixl_GBps": round(measured.get("nixl", 0) / 1e9, 3),
                                           "cost_model_GBps": {k: round(v / 1e9, 3) for k, v in bw.items()}}
                    for name, w in on_b.items():
                        seed += 1
                        prefix = tokens(PREFIX, seed)
                        ray.get(on_a.generate.remote(prefix + tokens(SUFFIX, 7), 1), timeout=300)
                        time.sleep(0.3)  # the index hears of A's blocks (bounded delay)
                        r = ray.get(w.generate.remote(prefix + tokens(SUFFIX, 8), 1), timeout=600)
                        row[f"{name}_s"] = round(r["ttft_s"], 3)
                        row[f"{name}_reused"] = r["reused_tokens"]
                finally:
                    hs.shape(a, None)
                rows[label] = row
                print(f"{label:9s} recompute {row['recompute_s']:.2f} s, load {row['load_s']:.2f} s "
                      f"(reused {row['load_reused']}), kvshare {row['kvshare_s']:.2f} s (reused "
                      f"{row['kvshare_reused']}); probe {row['probe_nixl_GBps']} GB/s", flush=True)
            ray.get([w.stop.remote() for w in (on_a, *on_b.values())], timeout=60)
        finally:
            shutdown()
            ray.shutdown()
    labels = [r or "unshaped" for r in RATES]
    loaded = [x for x in labels if rows[x]["kvshare_reused"] > 0]
    faster = [x for x in labels if rows[x]["load_s"] < rows[x]["recompute_s"]]
    worst = max(rows[x]["kvshare_s"] / min(rows[x]["recompute_s"], rows[x]["load_s"]) for x in labels)
    out = {"prefix_tokens": PREFIX, "prefix_MiB": round(prefix_mib, 1), "rates": rows,
           "crossover_predicted": loaded[0] if loaded else None,
           "crossover_measured": faster[0] if faster else None,
           "worst_vs_best": round(worst, 3)}
    print(f"crossover: the cost cut loads from {out['crossover_predicted']}, loading beats "
          f"recomputing from {out['crossover_measured']}; worst_vs_best {worst:.2f} (target <= 1.10)",
          flush=True)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
