"""SGLang TTFT with HiCache's storage tier: cold, SGLang's own ``file`` backend on a hit, kvshare
from this node's pool and kvshare from another node's; same model, prompts and run.

Starts a local ``ray.cluster_utils.Cluster`` (head + 2 nodes), deploys a kvshare namespace
(``--block-tokens`` = SGLang's ``--page-size``), and three SGLang servers with HiCache and the
same flags but their storage tier: ``file`` (SGLang's built-in L3 on local disk: the peer) and
two with the kvshare backend, on node A and node B (``kvshare.actors.sglang_workers``, what
``kvshare sglang start`` runs). Prompts: a ``--prefix``-token prefix of random token ids,
one per measurement, plus a 16-token suffix, sent as ids to ``/generate`` with
``max_new_tokens=1`` (TTFT = the request's latency at the client), greedy. Per round:

- ``cold_s``: a new prompt on A, nothing cached anywhere (SGLang computes it all);
- ``file_s``: a prompt the ``file`` server served before, then pushed out of its device and host
  pools by ``--evict-tokens`` of other prompts: its prefix comes back from the file tier;
- ``kvshare_local_s``: the same on A: the prefix comes back from node A's pool (shm);
- ``kvshare_remote_s``: a prompt served by B (written through to node B's pool), sent to A,
  which never saw it: the prefix comes from node B's pool (NIXL or Ray's object store).

Before its hits are timed, each server's write-through of the prompts that evicted them has
ended (the pages its storage tier holds stopped growing for 1.5 s): a hit never runs beside its
own server's backlog, and ``drain_s`` (medians, per backend) is how long that backlog took
after the last evicting prompt was answered.

The ``file`` server runs at the niceness Ray gives the kvshare servers' worker actors
(``server_niceness``, 15 by default): started from this process it would otherwise run at 0
and take a larger share of a busy host's cores.

Every hit is checked: the answer's ``cached_tokens_details.storage`` must cover the prefix's full
pages and its output token must equal the cold computation's. Medians over ``--rounds``;
``vs_file = file_s / kvshare_local_s`` (target >= 1.0), ``remote_vs_local =
kvshare_remote_s / kvshare_local_s`` (target <= 1.3). On a machine without CUDA pass
``--cpu`` (and the test-only provisions folder, ``--provisions``, see docs/sglang.md). Run in
SGLang's environment (``.venv-sglang``). Last line: one JSON object.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # conftest.start_cluster: a local Ray cluster

import httpx  # noqa: E402

NS = "sglang-ttft"
SUFFIX = 16


def ids(n: int, seed: int) -> list[int]:
    """``n`` random token ids (deterministic per seed, never the special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(300, 1000) for _ in range(n)]


def generate(endpoint: str, prompt: list[int]) -> tuple[float, dict[str, Any]]:
    """Seconds to the first (only) token of ``prompt`` at ``endpoint``, and the answer."""
    t0 = time.perf_counter()
    r = httpx.post(f"{endpoint}/generate", timeout=600, json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return seconds, r.json()


def storage_tokens(answer: dict[str, Any]) -> int:
    return int((answer["meta_info"].get("cached_tokens_details") or {}).get("storage", 0))


def evict(endpoint: str, tokens: int, seed: int) -> None:
    """Push earlier prompts out of a server's device and host pools with other prompts."""
    for i in range(max(1, tokens // 1024)):
        generate(endpoint, ids(1024, seed * 1000 + i))


def niceness() -> int:
    """This process's scheduling niceness (in a Ray task: Ray's worker niceness)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def drained(count: Callable[[], int], quiet_s: float = 1.5, limit_s: float = 180.0) -> float:
    """Wait until ``count()`` (pages a server's storage tier has written) stops growing for
    ``quiet_s``; the seconds from the call to its last growth (its write-through backlog)."""
    t0 = last_change = time.monotonic()
    seen = count()
    while time.monotonic() - last_change < quiet_s and time.monotonic() - t0 < limit_s:
        time.sleep(0.25)
        now = count()
        if now != seen:
            seen, last_change = now, time.monotonic()
    return last_change - t0


def file_pages(folder: str) -> int:
    """Pages SGLang's ``file`` backend has written (one file each)."""
    return sum(len(files) for _, _, files in os.walk(folder))


def pool_stores(namespace: str) -> int:
    """Blocks stored so far into every node's kvshare pool of ``namespace``."""
    from kvshare.actors.deploy import status

    return sum(int(t.get("stores", 0)) for node in status("kvshare")["nodes"]
               for t in node.get("pool", {}).get("namespaces", {}).get(namespace, {})
               .get("tiers", {}).values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=2048, help="prefix tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=4096,
                    help="SGLang's device KV pool (tokens); the host pool is twice that")
    ap.add_argument("--evict-tokens", type=int, default=0,
                    help="other prompts' tokens sent to evict (default: 1.5x both pools)")
    ap.add_argument("--cpu", action="store_true", help="serve on the CPU")
    ap.add_argument("--provisions", default=str(ROOT / "tests/kvshare/sglang/cpu_provisions"),
                    help="folder put first on the servers' PYTHONPATH (the test-only CPU "
                         "provisions; '' for none)")
    ap.add_argument("--layers", type=int, default=8, help="tiny Llama layers")
    args = ap.parse_args()
    if args.prefix + SUFFIX > args.max_total_tokens:
        ap.error("--prefix plus the suffix must fit --max-total-tokens")
    evict_tokens = args.evict_tokens or int(1.5 * 3 * args.max_total_tokens)

    import ray
    from conftest import start_cluster, stop_cluster
    from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module

    from kvshare.actors.deploy import deploy, shutdown
    from kvshare.actors.sglang_workers import PREFIX as ACTORS
    from kvshare.actors.sglang_workers import start_workers
    from kvshare.actors.vllm_workers import stop_workers
    from kvshare.layout import KVLayout
    from kvshare.sglang.launch import SglangProcess, SglangSpec, only_models
    from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama

    _load_native_hash_module()  # built once here: servers starting together race on it
    tmp = tempfile.mkdtemp(prefix="kvs-sglang-ttft-")
    model = build_tiny_llama(os.path.join(tmp, "tiny"), TinyModelSpec(num_layers=args.layers))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (args.provisions, str(ROOT),
                                                     os.environ.get("PYTHONPATH", "")) if p),
           **only_models("llama")}
    flags = ("--hicache-storage-prefetch-policy", "wait_complete")
    common: dict[str, Any] = {"page_size": args.page_size, "cpu": args.cpu,
                              "max_total_tokens": args.max_total_tokens}
    for attempt in range(3):  # a raylet can miss Ray's fixed 30 s start deadline on a loaded host
        try:
            cluster = start_cluster(num_workers=2, object_store_mb=300)
            break
        except Exception:
            if attempt == 2:
                raise
            ray.shutdown()
            time.sleep(5)
    file_dir = os.path.join(tmp, "file-tier")
    peer = SglangProcess(SglangSpec(model, storage="file", extra_args=flags, events_dir=tmp,
                                    env={**env, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": file_dir},
                                    **common))
    t0 = time.monotonic()
    nice = 0
    try:
        peer.start()
        # the kvshare servers run under Ray's worker actors, at Ray's worker niceness (15):
        # the peer runs at the same, set before SGLang spawns its scheduler (children inherit)
        nice = int(ray.get(ray.remote(num_cpus=0)(niceness).remote()))
        assert peer.proc is not None
        os.setpriority(os.PRIO_PROCESS, peer.proc.pid, nice)
        layout = KVLayout.from_hf_config(os.path.join(model, "config.json"), dtype="bf16",
                                         block_tokens=args.page_size)
        deploy(namespace=NS, layout=layout, host_gb=1.0, ray_namespace="kvshare")
        nodes = sorted(n["NodeID"] for n in ray.nodes()
                       if n["Alive"] and any(k.startswith("node_") for k in n["Resources"]))
        a, b = start_workers(model, nodes, namespace=NS, extra_args=flags, env=env,
                             timeout_s=900, **common)
        peer.wait_ready(900)
        started_s = time.monotonic() - t0
        out = measure(args, peer.spec.endpoint, a["endpoint"], b["endpoint"], evict_tokens,
                      lambda: file_pages(file_dir), lambda: pool_stores(NS))
    finally:
        stop_workers("kvshare", ACTORS)
        shutdown("kvshare")
        stop_cluster(cluster)
        peer.stop()
    out.update({"prefix_tokens": args.prefix, "page_size": args.page_size,
                "layers": args.layers, "rounds": args.rounds, "servers_start_s": round(started_s, 1),
                "server_niceness": nice,
                "load_avg_1m": round(os.getloadavg()[0], 2)})
    print(json.dumps(out))
    return 0


def measure(args: argparse.Namespace, peer: str, a: str, b: str, evict_tokens: int,
            file_written: Callable[[], int], kvshare_written: Callable[[], int]) -> dict[str, Any]:
    full = args.prefix // args.page_size * args.page_size
    times: dict[str, list[float]] = {k: [] for k in ("cold_s", "file_s", "kvshare_local_s",
                                                     "kvshare_remote_s")}
    hits: dict[str, list[int]] = {k: [] for k in times}
    drain: dict[str, list[float]] = {"file": [], "kvshare": []}
    for r in range(args.rounds):
        prompts = {k: ids(args.prefix, 100 * r + i) + ids(SUFFIX, 7 + r)
                   for i, k in enumerate(times)}
        cold, first = {}, {}
        for key, server in (("cold_s", a), ("file_s", peer), ("kvshare_local_s", a),
                            ("kvshare_remote_s", b)):
            s, answer = generate(server, prompts[key])  # computed: nothing holds it yet
            cold[key], first[key] = s, answer["output_ids"]
        times["cold_s"].append(cold["cold_s"])
        # each server's write-through of what it computed ends before its hit is timed, so
        # neither backend's hit runs beside its own backlog (how long that took: drain_s)
        evict(peer, evict_tokens, 10 + r)
        drain["file"].append(drained(file_written))
        evict(a, evict_tokens, 20 + r)
        drain["kvshare"].append(drained(kvshare_written))
        for key, server in (("file_s", peer), ("kvshare_local_s", a), ("kvshare_remote_s", a)):
            s, answer = generate(server, prompts[key])
            hits[key].append(storage_tokens(answer))
            if answer["output_ids"] != first[key]:
                raise SystemExit(f"{key}: a hit answered {answer['output_ids']}, computed "
                                 f"{first[key]}")
            if storage_tokens(answer) < full:
                raise SystemExit(f"{key}: storage supplied {storage_tokens(answer)} of "
                                 f"{full} prefix tokens: {answer['meta_info']}")
            times[key].append(s)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in times.items()),
              file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**{k: round(v, 4) for k, v in med.items()},
            "vs_file": round(med["file_s"] / med["kvshare_local_s"], 3),
            "remote_vs_local": round(med["kvshare_remote_s"] / med["kvshare_local_s"], 3),
            "cold_vs_local": round(med["cold_s"] / med["kvshare_local_s"], 3),
            "drain_s": {k: round(statistics.median(v), 3) for k, v in drain.items()},
            "storage_hit_tokens": {k: v for k, v in hits.items() if v},
            "samples": {k: [round(x, 4) for x in v] for k, v in times.items()}}


if __name__ == "__main__":
    sys.exit(main())
