"""Recompute or load, by link rate: an 8k-token prefix held only in host A's pool, the request
arrives at host B's vLLM engine (root only: emulated hosts).

Two emulated hosts (:class:`kvshare.testing.hosts.EmulatedHosts`, UCX over TCP between them),
kvshare deployed, one vLLM-CPU engine per host with the KVShareConnector (the tiny Llama of
``kvshare.testing.tiny_model``: 8 layers, hidden 512, bf16, 8 KiB of KV per token, 16k
context; ``vllm.LLM`` in a Ray actor on its host). Host A's engine computes each prefix and
its connector stores it in A's pool. Host B's engine answers the same prefix + a 64-token
suffix (``max_tokens=1``) three ways, chosen per request (``kv_transfer_params``), so one
engine serves every leg of every rate:

- ``recompute_s``: ``{"kvshare": {"share": false}}``, as with no connector;
- ``load_s``: ``{"kvshare": {"cut": "all"}}``: load everything the cluster holds, as a cache
  without a cost model does;
- ``kvshare_s``: no flag: the connector's default cost cut.

For each rate of host A's link (tbf both ways; ``unshaped``: none) B's pool re-probes A and
B's connector re-reads the figures (per peer: the A -> B link). Every request has a prefix of
its own, freshly stored on A, so neither B's vLLM cache nor B's pool holds any of it; the legs
alternate their order between repeats. Medians of ``--repeats`` per point. Last line: JSON
with per rate the three medians (and every sample), the crossover rate (the lowest rate at
which the cost cut loaded, against the lowest at which loading beat recomputing) and
``worst_vs_best`` = max over rates of ``kvshare_s / min(recompute_s, load_s)`` (target <= 1.10).

    sudo .venv/bin/python benchmarks/link_sweep.py [--rates 100mbit,300mbit,1gbit,3gbit,unshaped]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NS = "sweep"
PREFIX = 8192
SUFFIX = 64
BLOCK = 256
RATES = "100mbit,300mbit,1gbit,3gbit,unshaped"
LEGS: dict[str, dict[str, Any] | None] = {
    "recompute": {"kvshare": {"share": False}},
    "load": {"kvshare": {"cut": "all"}},
    "kvshare": None,
}


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def engine(model: str, host: str, max_len: int) -> Any:
    import ray

    from kvshare.vllm.server.offline import ENGINE_ENV, OfflineEngine, kv_transfer_config

    actor = ray.remote(OfflineEngine).options(  # type: ignore[attr-defined]
        num_cpus=0, resources={host: 0.01},
        runtime_env={"env_vars": {**ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": "1",
                                  "OMP_NUM_THREADS": "2"}},
    ).remote(model, kv_transfer=kv_transfer_config(NS, block_tokens=BLOCK), dtype="bfloat16",
             max_model_len=max_len)
    return actor


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


def delta(after: dict[str, float], before: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after
            if k.startswith(prefix) and after[k] != before.get(k, 0.0)}


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default=RATES, help="tbf rates of host A's link, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="requests per leg and rate (median)")
    args = ap.parse_args()
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    labels = [r.strip() for r in args.rates.split(",") if r.strip()]
    import ray

    from kvshare.actors.deploy import deploy, shutdown
    from kvshare.layout import KVLayout
    from kvshare.testing.hosts import EmulatedHosts
    from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama
    from kvshare.transfer.probe import PROBE_NAMESPACE

    max_len = PREFIX + 2 * SUFFIX + 64
    model = build_tiny_llama(os.path.join(tempfile.gettempdir(), "kvshare-tiny-llama-bf16"),
                             TinyModelSpec(max_position_embeddings=max(16384, max_len)))
    layout = KVLayout.from_hf_config(f"{model}/config.json", dtype="bf16", block_tokens=BLOCK)
    rows: dict[str, dict[str, Any]] = {}
    t_start = time.monotonic()
    with EmulatedHosts(2, ray=True, shm_mb=1536, object_store_mb=300, start_timeout_s=600) as hs:
        hs.connect_ray("kvs-link-sweep")
        a, b = hs[0], hs[1]
        try:
            deploy(namespace=NS, layout=layout, host_gb=1.0)
            pools = pools_by_ip()
            node_a, pool_a = pools[a.ip]
            pool_b = pools[b.ip][1]
            on_a, on_b = engine(model, a.name, max_len), engine(model, b.name, max_len)
            ray.get([on_a.ready.remote(), on_b.ready.remote()], timeout=900)
            print(f"engines up in {time.monotonic() - t_start:.0f} s", flush=True)
            for i, e in enumerate((on_a, on_b, on_b)):  # warm-up: paths, pages, step speed
                ray.get(e.generate.remote([tokens(PREFIX, 1 + i)], 2), timeout=600)
            seed = 100
            for label in labels:
                hs.shape(a, None if label == "unshaped" else label)
                try:
                    ray.get(pool_b.transfer_measure.remote(PROBE_NAMESPACE, {node_a: pool_a}),
                            timeout=300)
                    per_node = ray.get(pool_b.transfer_bandwidths.remote())["per_node"]
                    seen = ray.get(on_b.refresh_bandwidths.remote(), timeout=60)[0]
                    row: dict[str, Any] = {
                        "probe_GBps": {k: round(v / 1e9, 3) for k, v in per_node.get(node_a, {}).items()},
                        "transport": seen["remote"],
                        "link_priced_GBps": {k: round(v / 1e9, 3)
                                             for k, v in seen["peer_bandwidths"].items()},
                        "prefill_tokens_per_s": round(seen["prefill_tokens_per_s"]),
                    }
                    for rep in range(args.repeats):
                        order = list(LEGS) if rep % 2 == 0 else list(reversed(LEGS))
                        for leg in order:
                            seed += 1
                            prefix = tokens(PREFIX, seed)
                            ray.get(on_a.generate.remote([prefix + tokens(SUFFIX, 7)], 1), timeout=600)
                            time.sleep(0.3)  # the index hears of A's blocks (bounded delay)
                            before = ray.get(on_b.counters.remote())
                            out = ray.get(on_b.generate.remote([prefix + tokens(SUFFIX, 8)], 1,
                                                               0, LEGS[leg]), timeout=900)[0]
                            after = ray.get(on_b.counters.remote())
                            row.setdefault(f"{leg}_all", []).append(round(out["seconds"], 3))
                            row.setdefault(f"{leg}_loaded", []).append(out["cached_tokens"])
                            moved = delta(after, before, "bytes_")
                            print(f"{label:9s} {leg:9s} {out['seconds']:6.2f} s, loaded "
                                  f"{out['cached_tokens']} tokens {moved}", flush=True)
                    for leg in LEGS:
                        row[f"{leg}_s"] = round(statistics.median(row[f"{leg}_all"]), 3)
                finally:
                    hs.shape(a, None)
                rows[label] = row
                print(f"{label:9s} recompute {row['recompute_s']:.2f} s, load {row['load_s']:.2f} "
                      f"s, kvshare {row['kvshare_s']:.2f} s (loaded {row['kvshare_loaded']}); "
                      f"probe {row['probe_GBps']} GB/s, priced {row['link_priced_GBps']}",
                      flush=True)
            for e in (on_a, on_b):
                ray.kill(e)
        finally:
            shutdown()
            ray.shutdown()
    loaded = [x for x in labels if statistics.median(rows[x]["kvshare_loaded"]) > 0]
    faster = [x for x in labels if rows[x]["load_s"] < rows[x]["recompute_s"]]
    worst = max(rows[x]["kvshare_s"] / min(rows[x]["recompute_s"], rows[x]["load_s"])
                for x in labels)
    out = {"engine": "vllm-cpu", "prefix_tokens": PREFIX,
           "prefix_MiB": round(PREFIX * layout.bytes_per_token / 2**20, 1),
           "repeats": args.repeats, "rates": rows,
           "crossover_predicted": loaded[0] if loaded else None,
           "crossover_measured": faster[0] if faster else None,
           "worst_vs_best": round(worst, 3), "load_avg_1m": round(os.getloadavg()[0], 1),
           "wall_s": round(time.monotonic() - t_start)}
    print(f"crossover: the cost cut loads from {out['crossover_predicted']}, loading beats "
          f"recomputing from {out['crossover_measured']}; worst_vs_best {worst:.2f} (target <= 1.10)",
          flush=True)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
