"""``kvshare sim`` and ``kvshare gateway`` (registered through the ``kvshare.commands``
entry-point group: ``router.cli:register``)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any


def _tokens(text: str) -> int:
    value = int(float(text))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 tokens, got {text}")
    return value


def register(subparsers: Any) -> None:
    """Add ``sim`` and ``gateway`` to the ``kvshare`` command."""
    from router.policy import DEFAULT_POLICY, POLICIES

    sim = subparsers.add_parser(
        "sim", help="replay a Mooncake-format trace through the routing policies",
        description="Replay a trace on a modelled cluster (defaults: 10 workers, 3M tokens of "
        "host cache each, 512-token blocks, Llama-2-70B KV, 100 Gbit/s; see router/cluster.py).",
    )
    sim.add_argument("trace", help="Mooncake-format JSONL trace")
    sim.add_argument("--policy", default="all", choices=[*sorted(POLICIES), "all"],
                     help=f"one policy or all (default all; routers default to {DEFAULT_POLICY})")
    sim.add_argument("--sharing", default="global", choices=["local", "global"],
                     help="local: reuse only the own node's blocks; global: any node's")
    sim.add_argument("--workers", type=int, default=10)
    sim.add_argument("--host-tokens", type=_tokens, default=3_000_000, help="per node")
    sim.add_argument("--disk-tokens", type=_tokens, default=0, help="per node")
    sim.add_argument("--block-tokens", type=int, default=512)
    sim.add_argument("--model", default="Llama-2-70b-hf", help="bundled config name or path")
    sim.add_argument("--net-gbps", type=float, default=100.0, help="between nodes, Gbit/s")
    sim.add_argument("--limit", type=int, default=None, help="first N requests only")
    sim.add_argument("--json", action="store_true", help="print one JSON object last")
    sim.add_argument("--plot", default=None, help="write a PNG: hit rate vs capacity, TTFT")
    sim.add_argument("--parquet", default=None, help="write per-request results as Parquet")
    sim.add_argument("--no-progress", action="store_true")
    sim.set_defaults(func=_sim)

    gw = subparsers.add_parser("gateway", help="OpenAI-compatible cache-aware gateway")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--workers", default="", help="comma-separated worker base URLs")
    gw.add_argument("--address", default=None,
                    help="Ray cluster address: discover workers registered in the kvshare index")
    gw.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES))
    gw.add_argument("--index-replica", action="store_true",
                    help="with --address: keep a replica of the index in the gateway, fed by the "
                    "index's change stream, so routing makes no index call per request")
    gw.add_argument("--namespace", default="default", help="model namespace of the workers")
    gw.add_argument("--api-keys", default=None,
                    help="JSON file {api_key: {tenant, salt}}; without it any key is tenant 'default'")
    gw.add_argument("--block-tokens", type=int, default=256)
    gw.add_argument("--model-id", default="model", help="model identity the workers hash with")
    gw.add_argument("--layout-fingerprint", default="", help="KVLayout.fingerprint() of the workers")
    gw.add_argument("--engine-config", default=None,
                    help="JSON of kvshare.engines.hf.EngineConfig fields (e.g. '{}'): tokenize and "
                    "hash exactly like the reference workers (identity, layout, tokenizer)")
    gw.add_argument("--bandwidth", default="",
                    help="GB/s per transport for the cost model, e.g. shm=20,nixl=8,disk=3 (the "
                    "same syntax as KVSHARE_BANDWIDTH_GBPS); with --address these override what "
                    "the cluster's pools measured at start")
    gw.add_argument("--prefill-tokens-per-s", type=float, default=5000.0,
                    help="initial prefill speed; refitted from the workers' measured timings")
    gw.set_defaults(func=_gateway)


def _sim(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from router.cluster import ClusterConfig
    from router.policy import POLICIES
    from router.report import format_table, json_summary, plot, summarize, write_parquet
    from router.sim import global_lru, simulate
    from router.trace import read_trace

    cfg = ClusterConfig(
        workers=args.workers, host_tokens=args.host_tokens, disk_tokens=args.disk_tokens,
        block_tokens=args.block_tokens, model=args.model, net_bw=args.net_gbps * 1e9 / 8,
    )
    requests = read_trace(args.trace, args.limit)
    names = list(POLICIES) if args.policy == "all" else [args.policy]
    bar = tqdm(total=len(requests) * len(names), unit="req", disable=args.no_progress or None,
               file=sys.stderr, desc=f"sim {args.sharing}")
    reference, rows, busy = simulate(requests, cfg, names, args.sharing, bar.update)
    bar.close()
    results = {n: summarize(rows[n], busy[n]) for n in names}
    print(format_table(reference, results, args.sharing))
    if args.parquet:
        write_parquet(args.parquet, rows)
    if args.plot:
        per_node = [cfg.host_tokens // 30, cfg.host_tokens // 10, cfg.host_tokens // 3,
                    cfg.host_tokens, cfg.host_tokens * 2]
        curve: dict[str, list[tuple[float, float]]] = {
            "global_lru": [(c, global_lru(requests, replace(cfg, host_tokens=c))) for c in per_node]
        }
        for n in names:
            pts = []
            for c in per_node:
                _, r, _ = simulate(requests, replace(cfg, host_tokens=c), [n], args.sharing)
                pts.append((float(c), summarize(r[n], [1.0])["hit_rate"]))
            curve[n] = pts
        plot(args.plot, curve, results, f"{args.trace.split('/')[-1]}, sharing={args.sharing}")
    if args.json:
        print(json.dumps(json_summary(reference, results)))
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from router.gateway import serve_from_args

    return int(serve_from_args(args))
