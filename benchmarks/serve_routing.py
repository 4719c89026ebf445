"""Ray Serve: kvshare's request router against Serve's default router, same workload, same run.

A local Ray cluster (head + 4 nodes), kvshare deployed on it, and two Serve applications from
``router/serve_app.build_app`` whose worker deployments are identical (4 reference-worker
replicas of the default tiny Llama cut to 2 layers, one per node, each reusing only its own
node's cache, i.e. ``sharing="local"``): one with Serve's default power-of-two router, one with
``kvshare.router.serve:KVShareRequestRouter`` (the one config line). Each app has its own kvshare
namespace, so neither warms the other's cache.

Workload (identical for both): 4 users x 6 turns of chat over 2 shared system prompts; each
user pastes a long document in the first turn and asks a short question in every turn (the
assistant's previous answers stay in the conversation); requests go
one at a time through the OpenAI ingress with ``max_tokens=1``, so the client-side latency is
the time to first token (routing included). Prefix hit rate = prompt tokens the serving replica
reused from its own node's cache / prompt tokens.

Last line: one JSON object with ``default_hit_rate``, ``kvshare_hit_rate``,
``default_ttft_p50_s``, ``kvshare_ttft_p50_s``, ``ttft_ratio`` (= default / kvshare).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvshare.engines.hf import default_model_config
from kvshare.layout import KVLayout

# Run as a script, benchmarks/ is first on sys.path and benchmarks/router.py would shadow the
# repo's router package that main() imports: put the repo root first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 128
OVERRIDES = {"num_hidden_layers": 2}  # the default tiny Llama, 2 of its 4 layers: ~1 min run
ENGINE = {"block_tokens": BLOCK, "threads": 1, "overrides": OVERRIDES}
LAYOUT = KVLayout.from_hf_config({**default_model_config(), **OVERRIDES}, dtype="fp32",
                                 block_tokens=BLOCK)


def text(seed: int, n: int) -> str:
    """Deterministic filler text of ``n`` characters (one byte-token each)."""
    words = ["kv", "cache", "ray", "serve", "block", "prefix", "node", "route", "token", "pool"]
    out: list[str] = []
    x = seed * 7919 + 17
    while sum(len(w) + 1 for w in out) < n:
        x = (x * 1103515245 + 12345) % 2**31
        out.append(words[x % len(words)] + str(x % 97))
    return " ".join(out)[:n]


def run_workload(url: str, users: int, turns: int, doc_chars: int, turn_chars: int,
                 system_chars: int, answer_chars: int) -> dict[str, Any]:
    systems = [text(900 + i, system_chars) for i in range(2)]
    docs = [text(1000 + u, doc_chars) for u in range(users)]
    history: list[list[dict[str, str]]] = [[] for _ in range(users)]
    ttft: list[float] = []
    reused = total = 0
    with httpx.Client(timeout=300) as http:
        for t in range(turns):
            for u in range(users):
                content = (docs[u] + "\n" if t == 0 else "") + text(2000 + 50 * u + t, turn_chars)
                history[u].append({"role": "user", "content": content})
                msgs = [{"role": "system", "content": systems[u % 2]}] + history[u]
                t0 = time.perf_counter()
                r = http.post(f"{url}/v1/chat/completions",
                              json={"messages": msgs, "max_tokens": 1, "temperature": 0})
                ttft.append(time.perf_counter() - t0)
                r.raise_for_status()
                kv = r.json()["kvshare"]
                reused += kv["local_reused_tokens"]
                total += kv["prompt_tokens"]
                history[u].append({"role": "assistant", "content": text(3000 + 50 * u + t, answer_chars)})
                time.sleep(0.1)  # this turn's blocks reach the index (publish interval 50 ms)
    return {"hit_rate": reused / total, "ttft_p50_s": statistics.median(ttft),
            "ttft_mean_s": statistics.fmean(ttft), "requests": len(ttft)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-chars", type=int, default=1000)
    ap.add_argument("--doc-chars", type=int, default=3000)
    ap.add_argument("--turn-chars", type=int, default=150)
    ap.add_argument("--answer-chars", type=int, default=80)
    args = ap.parse_args()
    if args.users < 4 or args.turns < 6:
        print("note: the issue's workload is at least 4 users x 6 turns", file=sys.stderr)
    t_start = time.perf_counter()
    from ray import serve
    from ray.serve.api import RunTarget

    from kvshare.actors.deploy import deploy
    from kvshare.actors.local_cluster import local_cluster
    from kvshare.engines.server import free_port
    from kvshare.router.serve.app import build_app

    with local_cluster(args.nodes, head_store_mib=200, node_store_mib=200,
                       ray_namespace="kvshare-bench", temp_prefix="kvs-serve-bench-"):
        try:
            deploy(namespaces={"bench-default": LAYOUT, "bench-kvshare": LAYOUT}, host_gb=0.25)
            port = free_port()
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
            common = {"engine": ENGINE, "sharing": "local", "num_replicas": args.nodes,
                      "replica_cpus": 1.0}
            serve.run_many([
                RunTarget(build_app(router="default", namespace="bench-default", **common),
                          "default", "/default"),
                RunTarget(build_app(router="kvshare", namespace="bench-kvshare", **common),
                          "kvshare", "/kvshare"),
            ])
            print(f"cluster + kvshare + 2 Serve apps up in {time.perf_counter() - t_start:.1f}s",
                  file=sys.stderr)
            base = f"http://127.0.0.1:{port}"
            w = (args.users, args.turns, args.doc_chars, args.turn_chars, args.system_chars,
                 args.answer_chars)
            default = run_workload(f"{base}/default", *w)
            kv = run_workload(f"{base}/kvshare", *w)
            for app in ("default", "kvshare"):
                seen = {}
                handle = serve.get_deployment_handle("KVShareWorker", app)
                for _ in range(3 * args.nodes):
                    st = handle.stats.remote().result()
                    seen[st["worker_id"]] = st["client"]
                print(app, "SDK counters per replica:", json.dumps(seen), file=sys.stderr)
        finally:
            serve.shutdown()  # type: ignore[no-untyped-call]
    routers = {"default": default, "kvshare": kv}
    print(f"{'router':10} {'hit rate':>9} {'TTFT p50':>9} {'TTFT mean':>10}")
    for name, r in routers.items():
        print(f"{name:10} {r['hit_rate']:9.3f} {r['ttft_p50_s']:8.3f}s {r['ttft_mean_s']:9.3f}s")
    print(f"({args.users} users x {args.turns} turns, {args.nodes} replicas on {args.nodes} nodes, "
          f"total {time.perf_counter() - t_start:.0f}s)")
    figures = {f"{name}_{k}": round(r[k], 4) for k in ("hit_rate", "ttft_p50_s")
               for name, r in routers.items()}  # default_hit_rate, kvshare_hit_rate, ...
    print(json.dumps({**figures, "ttft_ratio": round(default["ttft_p50_s"] / kv["ttft_p50_s"], 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
