"""`make demo`: kvshare end to end on vLLM workers, on an embedded local Ray with two emulated nodes.

1. builds the tiny Llama on disk (``kvshare.testing.tiny_model``: seeded random weights and a
   trained tokenizer; no model hub), starts a local Ray cluster (head + 2 nodes,
   ``ray.cluster_utils.Cluster``) and deploys kvshare (index + one pool actor per node);
2. starts one vLLM-CPU OpenAI server per node as a Ray actor pinned to it
   (``kvshare.actors.vllm_workers``, what ``kvshare vllm start --connector --dtype float32`` runs;
   float32 because vLLM-CPU emulates the model's bfloat16 on AVX2 CPUs): prefix caching on,
   its KV events feeding the index as the worker's gpu tier, and the kvshare KV connector
   loading from / saving to the pools;
3. starts the OpenAI-compatible gateway (cache-aware ``cost`` policy) on loopback;
4. drives 4 users x 4 turns of chat sharing two system prompts and documents through the
   gateway with the official ``openai`` client (``demo_common.drive``); before the last turn
   both servers drop their own prefix caches (as vLLM does under memory pressure), so that
   turn's prefixes come from the pools: this node's over ``shm``, the other's over ``nixl``;
5. prints prefill tokens saved and TTFT cold vs warm (from each response's
   ``usage.prompt_tokens_details.cached_tokens``), prompt tokens served per cache tier (vLLM's
   own cache, this node's pool, another node's: vLLM's ``prompt_tokens_cached_by_source``),
   KV bytes the connector moved per transport (``vllm:kvshare_loaded_bytes``) and the pools'
   hit rates; writes ``out/demo.png``, a screenshot of the live page, ``out/dashboard.png``,
   and each server's ``/metrics`` (``out/vllm-metrics-N.txt``).

Exits non-zero if no prefix was reused. About 2-3 minutes on 2 CPU cores.
``make demo-reference`` is the same job on the reference transformers workers.

``python examples/demo.py --hosts [--link 1gbit]`` (root) runs the same job on two emulated
hosts instead (:class:`kvshare.testing.hosts.EmulatedHosts`: each its own network namespace,
address, ``/dev/shm`` and hostname on a private bridge), host 1's link shaped to ``--link``:
the other node's blocks really cross a link, over NIXL/UCX TCP, and the pools' probes, the
cost model and the live page see that link's own figures.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import demo_common
from demo_common import drive, serve_gateway, timed
from engine_times import EngineTimes

NAMESPACE = "demo-vllm"
BLOCK = 256  # kvshare share block: 8 vLLM pages of 32 tokens
MODEL_DIR = os.path.join("out", "tiny-llama")
# The servers compute in float32, not the model's bfloat16: vLLM-CPU emulates bfloat16 on CPUs
# without AVX512-BF16 or AMX (AVX2 machines such as these), 2.7x slower prefill measured here.
# The pools' layout and the gateway's keys follow the same dtype (VllmKeys.from_model).
DTYPE = "float32"



def start_workers(model: str) -> list[dict[str, Any]]:
    import ray

    from kvshare.actors.vllm_workers import start_workers as start_vllm

    def name(n: dict[str, Any]) -> str:  # node_0.. (local cluster) or kvs-h0.. (hosts)
        return next((k for k in n["Resources"] if k.startswith(("node_", "kvs-h"))), "")

    nodes = sorted((name(n), n["NodeID"]) for n in ray.nodes() if n["Alive"] and name(n))
    infos = start_vllm(model, [n for _, n in nodes],
                       namespace=NAMESPACE, block_tokens=BLOCK, kv_cache_gb=1.0,
                       max_model_len=4096, connector=True, dtype=DTYPE)
    for info in infos:
        print(f"  {info['worker_id']} on node {info['node'][:8]}  {info['endpoint']}")
    return infos


def start_gateway(model: str) -> tuple[str, Any]:
    from kvshare.actors.admin import ClusterAdmin
    from kvshare.actors.deploy import get_index_client, measured_bandwidths, measured_links
    from kvshare.cost import Bandwidths
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import IndexWorkers
    from kvshare.router.gateway.app import create_app
    from kvshare.tokenizer import HFTokenizer
    from kvshare.vllm.server.worker import VllmKeys

    keys = VllmKeys.from_model(model, BLOCK, DTYPE)  # what the workers' blocks are keyed by
    index = get_index_client()
    measured = measured_bandwidths(wait_s=20.0)  # bytes/s the pools probed at start
    links = measured_links()  # and per link: what a pull from one node to another costs
    print("  measured bandwidths (GB/s): "
          + ", ".join(f"{k}={v / 1e9:.2f}" for k, v in sorted(measured.items())))
    for holder, reader, bps in links.pairs:
        print(f"  link {holder[:8]} -> {reader[:8]}: {bps / 1e9:.3f} GB/s")
    cfg = RouterConfig.from_model_keys(
        keys, namespace=NAMESPACE, policy="cost", prefill_tokens_per_s=4000.0,
        bandwidths=Bandwidths.from_measured(measured, Bandwidths(links=links)))
    router = CacheAwareRouter(index, IndexWorkers(index), cfg, HFTokenizer(model))
    return serve_gateway(create_app(router, admin=ClusterAdmin()))  # admin: the live page


def warm_up(infos: list[dict[str, Any]], model: str) -> None:
    """One short request straight to each server (not counted, no prefix shared with the
    workload): an engine's first forward pass pays one-off set-up a cold request must not."""
    import httpx

    for info in infos:
        r = httpx.post(f"{info['endpoint']}/v1/completions", timeout=300, json={
            "model": model, "prompt": f"warm up {info['worker_id']}", "max_tokens": 2})
        r.raise_for_status()


def evict_before(turn: int, infos: list[dict[str, Any]]) -> Callable[[int], None]:
    """Before ``turn``, every server drops its own prefix cache (``/reset_prefix_cache``), as
    vLLM does under memory pressure: from then on prefixes come from the pools (this node's
    over ``shm``, another node's over ``nixl``) through the connector."""
    from kvshare.vllm.server.launch import reset_prefix_cache

    def hook(t: int) -> None:
        if t != turn:
            return
        for info in infos:
            if not reset_prefix_cache(info["endpoint"], timeout_s=5.0):
                print(f"  (could not reset {info['worker_id']}'s prefix cache)")
        print(f"  -- before turn {turn}: both vLLM servers drop their own prefix caches", flush=True)

    return hook


def vllm_counters(endpoints: list[str], dump_dir: str) -> dict[str, float]:
    """The servers' ``vllm:`` counters summed; per ``source`` / ``transport`` label. Each
    server's whole ``/metrics`` text is saved under ``dump_dir``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for i, url in enumerate(endpoints):
        page = httpx.get(f"{url}/metrics", timeout=30).text
        with open(os.path.join(dump_dir, f"vllm-metrics-{i}.txt"), "w") as f:
            f.write(page)
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if not sample.name.startswith("vllm:") or math.isnan(sample.value):
                    continue
                label = sample.labels.get("source") or sample.labels.get("transport")
                key = f"{sample.name}:{label}" if label else sample.name
                out[key] = out.get(key, 0.0) + sample.value
    return out


def report(turns: list[demo_common.Turn], counters: dict[str, float],
           pool_status: dict[str, Any], path: str, engine: EngineTimes) -> bool:
    print("\n== kvshare demo (vLLM workers) ==")
    demo_common.ttft_table(turns)
    print(engine.table())
    prompt = counters.get("vllm:prompt_tokens_total", 0.0)
    by = "vllm:prompt_tokens_cached_by_source_total:"
    print(f"prompt tokens by where their KV came from (vLLM counters, {prompt:,.0f} in all)")
    rows = [("vLLM's own prefix cache", counters.get(by + "device", 0.0)),
            ("this node's pool", counters.get(by + "host", 0.0) + counters.get(by + "disk", 0.0)),
            ("another node's pool", counters.get(by + "p2p", 0.0))]
    # the connector's hits vLLM did not attribute to a tier (its own total minus the above)
    external = counters.get("vllm:external_prefix_cache_hits_total", 0.0)
    rows.append(("connector, tier unknown", max(counters.get(by + "external_unspecified", 0.0),
                                                 external - rows[1][1] - rows[2][1])))
    cached = sum(n for _, n in rows)
    rows.append(("computed (prefill)", max(0.0, prompt - cached)))
    for name, n in rows:
        print(f"  {name:26s} {n:8,.0f}  {n / max(prompt, 1):6.1%}")
    print("KV bytes the connector moved")
    loaded = sorted((k.rsplit(":", 1)[1], v) for k, v in counters.items()
                    if k.startswith("vllm:kvshare_loaded_bytes_total:"))
    for transport, n in loaded:
        print(f"  loaded over {transport:9s} {n / 2**20:10.1f} MiB")
    if not loaded:
        print("  loaded                 0.0 MiB")
    print(f"  stored to the pools    {counters.get('vllm:kvshare_stored_bytes_total', 0.0) / 2**20:10.1f} MiB")
    registry = (pool_status.get("index") or [{}])[0]  # shard 0 keeps the workers' leases
    print(f"worker leases: {registry.get('workers_expired', '?')} lapsed; "
          f"{registry.get('lease_stalls', '?')} index pauses bridged (a starved host; longest "
          f"{registry.get('longest_lease_stall_s', 0.0):.1f} s)")
    return demo_common.finish_report(turns, pool_status, path,
                                     "kvshare demo (vLLM workers): time to first token per request")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="kvshare end to end on vLLM-CPU workers")
    ap.add_argument("--hosts", action="store_true",
                    help="two emulated hosts with a shaped link instead of one (root only)")
    ap.add_argument("--link", default="1gbit",
                    help="with --hosts: host 1's link rate (tc tbf, e.g. 300mbit, 1gbit)")
    args = ap.parse_args(argv)
    if args.hosts:
        from kvshare.testing.hosts import root_missing_reason

        if (why := root_missing_reason()) is not None:
            print(f"error: --hosts: {why}; run `make demo` for the one-host demo",
                  file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.WARNING)
    from kvshare.actors.deploy import deploy, status
    from kvshare.actors.vllm_workers import stop_workers
    from kvshare.testing.tiny_model import build_tiny_llama
    from kvshare.vllm.server.worker import VllmKeys

    t0 = time.monotonic()
    model = timed(f"tiny Llama (24M parameters, bf16 weights, served in {DTYPE}) ready",
                  lambda: os.path.abspath(build_tiny_llama(MODEL_DIR)))
    if args.hosts:
        print("starting 2 emulated hosts with a Ray node each ...", flush=True)
        where = demo_common.hosts_cluster(args.link)
    else:
        print("starting a local Ray cluster with 2 emulated nodes ...", flush=True)
        where = demo_common.cluster()
    with where as cluster:
        try:
            layout = VllmKeys.from_model(model, BLOCK, DTYPE).layout  # 4 MiB per 256-token block
            address = cluster.ray_address if args.hosts else cluster.address
            deploy(address, namespace=NAMESPACE, layout=layout, host_gb=0.25,
                   disk_gb=0.5, disk_dir=tempfile.mkdtemp(prefix="kvshare-demo-disk-"))
            print("kvshare deployed; starting a vLLM-CPU worker per node (connector on) ...",
                  flush=True)
            infos = timed("vLLM workers up", lambda: start_workers(model))
            base_url, server = start_gateway(model)
            print(f"gateway at {base_url}; driving {demo_common.USERS} users x "
                  f"{demo_common.TURNS} turns ...", flush=True)
            warm_up(infos, model)
            engine = EngineTimes([i["endpoint"] for i in infos])
            engine.start()
            turns = drive(base_url, NAMESPACE, usage=True,  # the gateway serves its namespace
                          before_turn=evict_before(demo_common.TURNS - 1, infos),
                          after_wave=engine.after_wave)
            time.sleep(1.0)  # vLLM's stat loggers publish the last step's counters
            counters = vllm_counters([i["endpoint"] for i in infos], "out")
            ok = report(turns, counters, status(), os.path.join("out", "demo.png"), engine)
            return demo_common.wrap_up(ok, base_url, server, os.path.join("out", "dashboard.png"),
                                       t0)
        finally:
            stop_workers()  # before the deployment goes (the cluster's exit stops it)


if __name__ == "__main__":
    sys.exit(main())
