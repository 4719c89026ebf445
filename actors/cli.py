"""``kvshare up | status | metrics | down``: the cluster commands (a ``kvshare.commands`` plugin).

``up`` with no ``--address`` joins the Ray cluster running on this machine or, if there is
none, starts one with ``ray start --head`` (so it outlives this command; stop it with
``ray stop``). Ray is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvshare.actors import admin_cli
from kvshare.actors.cli_connect import connect_from_cli as _connect
from kvshare.actors.tier_value import value_lines, value_rows
from kvshare.cost import GB
from kvshare.layout import format_bytes


def _up(args: argparse.Namespace) -> int:
    from kvshare.actors.deploy import DEFAULT_LAYOUT, deploy
    from kvshare.layout import KVLayout
    from kvshare.transfer.probe import parse_overrides

    layout = DEFAULT_LAYOUT
    if args.layout:
        layout = KVLayout.from_hf_config(args.layout, dtype=args.dtype, block_tokens=args.block_tokens)
    _connect(args.address, args.ray_namespace, start=True)
    print(f"deploying kvshare (namespace {args.namespace}, {args.host_gb} GiB host, "
          f"{args.disk_gb} GiB disk per node) ...", file=sys.stderr)
    try:
        st = deploy(host_gb=args.host_gb, disk_dir=args.disk_dir, disk_gb=args.disk_gb,
                    namespace=args.namespace, layout=layout, index_shards=args.index_shards,
                    ray_namespace=args.ray_namespace, snapshot_path=args.snapshot,
                    bandwidth_overrides=parse_overrides(args.bandwidth),
                    probe_every_s=args.probe_every)
    except (MemoryError, ValueError) as exc:
        print(f"kvshare up: refused: {exc}", file=sys.stderr)
        return 2
    _print_status(st, args.json)
    return 0


def _status(args: argparse.Namespace) -> int:
    from kvshare.actors.deploy import status

    _connect(args.address, args.ray_namespace, start=False)
    st = status(args.ray_namespace)
    _print_status(st, args.json)
    if args.sizing and not args.json:
        print("\n".join(sizing_lines(st)) or "no sizing estimate (no pool answered)")
    return 0


def _metrics(args: argparse.Namespace) -> int:
    from prometheus_client import generate_latest, start_http_server

    from kvshare.actors.metrics import ClusterCollector, cluster_registry

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    _connect(args.address, args.ray_namespace, start=False)
    registry = cluster_registry(ClusterCollector(ray_namespace=args.ray_namespace,
                                                 timeout_s=args.timeout))
    if args.once:
        sys.stdout.write(generate_latest(registry).decode())
        return 0
    server, thread = start_http_server(args.port, addr=args.host, registry=registry)
    print(f"kvshare metrics on http://{args.host}:{server.server_port}/metrics (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    return 0


def _down(args: argparse.Namespace) -> int:
    from kvshare.actors.deploy import shutdown

    _connect(args.address, args.ray_namespace, start=False)
    n = shutdown(args.ray_namespace)
    print(f"kvshare stopped ({n} actors removed)")
    return 0


def rows(st: dict[str, Any]) -> list[list[str]]:
    """Status as table rows: node, alive, namespace, tier, used/capacity, blocks, hit rate."""
    out = []
    for node in st["nodes"]:
        pool = node.get("pool")
        short = node["node_id"][:12]
        if pool is None:
            out.append([short, "yes" if node["alive"] else "no", "-", "-",
                        node.get("pool_error", "no pool")[:40], "-", "-"])
            continue
        for ns, info in pool["namespaces"].items():
            for tier, t in info["tiers"].items():
                looked = t["hits"] + t["misses"]
                rate = f"{t['hits'] / looked:.0%}" if looked else "-"
                used = f"{format_bytes(t['used_bytes'])} / {format_bytes(t['capacity_bytes'])}"
                out.append([short, "yes" if node["alive"] else "no", ns, tier, used,
                            str(t["blocks"]), rate])
    return out


def sizing_lines(st: dict[str, Any]) -> list[str]:
    """Per node and namespace, the hit rate each tier would have at other sizes:
    ``host 4.00 GiB -> 61%; 8.00 GiB -> 72%`` (:meth:`TieredBlockPool.sizing`)."""
    out = []
    for node in st["nodes"]:
        for ns, info in ((node.get("pool") or {}).get("namespaces") or {}).items():
            est = info.get("sizing")
            if not est:
                continue
            tiers = " | ".join(
                f"{tier} " + "; ".join(f"{format_bytes(c)} -> {r:.0%}" for c, r in points)
                for tier, points in est["tiers"].items())
            out.append(f"sizing {node['node_id'][:12]} {ns}: {tiers} "
                       f"({est['lookups']:,} lookups, sampled {est['rate']:.0%})")
    return out


def _print_status(st: dict[str, Any], as_json: bool) -> None:
    if as_json:  # with the tier values as the other views read them
        print(json.dumps({**st, "tier_value": value_rows(st)}, default=str))
        return
    table = [["NODE", "ALIVE", "NAMESPACE", "TIER", "USED / CAPACITY", "BLOCKS", "HIT RATE"],
             *rows(st)]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for node in st["nodes"]:
        bw = node.get("bandwidth_bytes_per_s")
        if bw is not None:
            figures = ", ".join(f"{k}={v / GB:.2f}" for k, v in sorted(bw.items())) or "not probed yet"
            print(f"bandwidth GB/s {node['node_id'][:12]}: {figures}")
    for shard in st.get("index", []):
        blocks = {ns: v["blocks"] for ns, v in shard["namespaces"].items()}
        print(f"index epoch {shard['epoch']}: blocks {blocks}, {len(shard['locations'])} "
              f"locations, {shard['workers']} workers, {shard['gaps']} gaps, "
              f"{shard['replaced']} resyncs")
    if "index_error" in st:
        print(f"index unreachable: {st['index_error']}")
    for line in value_lines(st):
        print(line)


def register(subparsers: Any) -> None:
    """Add ``up``, ``status``, ``metrics`` and ``down`` to the ``kvshare`` command."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default=None, help="Ray cluster address (default: local)")
        p.add_argument("--ray-namespace", default="kvshare", help=argparse.SUPPRESS)

    up = subparsers.add_parser("up", help="start kvshare on a Ray cluster (pools + index)")
    common(up)
    up.add_argument("--host-gb", type=float, default=1.0, help="host slab per node (GiB)")
    up.add_argument("--disk-dir", default=None, help="disk tier root (default /tmp/kvshare-disk)")
    up.add_argument("--disk-gb", type=float, default=0.0, help="disk tier per node (GiB, 0 = none)")
    up.add_argument("--namespace", default="default", help="kvshare namespace (one model/layout)")
    up.add_argument("--layout", default=None, help="HF config.json giving the KV layout")
    up.add_argument("--dtype", default=None, help="KV dtype (default: the config's)")
    up.add_argument("--block-tokens", type=int, default=256)
    up.add_argument("--index-shards", type=int, default=1)
    up.add_argument("--snapshot", default="", metavar="PATH",
                    help="Parquet file the index snapshots to every 10 s and warm-starts from")
    up.add_argument("--bandwidth", default="", metavar="T=GBPS,...",
                    help="override the probed GB/s per transport, e.g. nixl=10,objstore=1.5 "
                    "(a node's KVSHARE_BANDWIDTH_GBPS wins over this)")
    up.add_argument("--probe-every", type=float, default=600.0, metavar="SECONDS",
                    help="re-measure transport bandwidths this often (0 = only when a pool "
                    "comes up)")
    up.add_argument("--json", action="store_true", help="print status as one JSON object")
    up.set_defaults(func=_up)
    status = subparsers.add_parser(
        "status", help="nodes, tiers, capacity, blocks, hit rates, what each tier is worth")
    common(status)
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument("--sizing", action="store_true",
                        help="also print the hit rate each tier would have at 0.5x, 1x, 2x "
                        "and 4x its size, estimated from the live lookups")
    status.set_defaults(func=_status)
    metrics = subparsers.add_parser(
        "metrics", help="serve the pools' and index's Prometheus metrics over HTTP")
    common(metrics)
    metrics.add_argument("--port", type=int, default=9478, help="HTTP port (0 = any free port)")
    metrics.add_argument("--host", default="0.0.0.0", help="address to listen on")
    metrics.add_argument("--timeout", type=float, default=5.0,
                         help="seconds to wait for each actor per scrape")
    metrics.add_argument("--once", action="store_true",
                         help="print one scrape to stdout and exit")
    metrics.set_defaults(func=_metrics)
    down = subparsers.add_parser("down", help="stop kvshare's actors (disk blocks stay)")
    common(down)
    down.set_defaults(func=_down)
    admin_cli.register(subparsers)  # lookup, pin, unpin, prefetch, clear
