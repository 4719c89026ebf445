"""``kvshare lookup | pin | unpin | prefetch | clear``: admin operations from the shell.

A prefix is given either as ``--hashes-file F`` (hex block hashes, one per line, first block
first; the command then talks to the Ray cluster, ``--address``) or as ``--gateway URL
--prompt TEXT`` (the command posts to the gateway's ``/v1/kvshare/<op>``, which tokenizes and
hashes the text the way routing does, under ``--api-key``'s tenant). ``--node`` takes a node id
or a unique prefix of one (``kvshare status`` prints the first 12 characters).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from kvshare.types import BlockHash

OPS = ("lookup", "pin", "unpin", "prefetch", "clear")


def read_hashes(path: str) -> list[BlockHash]:
    """Hex hashes, one per line (blank lines and ``#`` comments skipped); ValueError naming
    the line otherwise."""
    out: list[BlockHash] = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                out.append(BlockHash(bytes.fromhex(text)))
            except ValueError:
                raise ValueError(f"{path}:{no}: {text[:20]!r} is not a hex block hash") from None
    if not out:
        raise ValueError(f"{path} holds no block hashes: write one hex hash per line")
    return out


def resolve_nodes(given: Sequence[str], known: Sequence[str]) -> list[str]:
    """Each of ``given`` as a full node id: exact, or the one id it is a prefix of."""
    out = []
    for g in given:
        hits = [k for k in known if k == g] or [k for k in known if k.startswith(g)]
        if len(hits) != 1:
            why = "matches several nodes" if hits else "matches no kvshare node"
            raise ValueError(f"--node {g!r} {why}: known nodes are {sorted(known)}")
        out.append(hits[0])
    return out


def _via_cluster(op: str, args: argparse.Namespace) -> Any:
    from kvshare.actors import admin
    from kvshare.actors.cli_connect import connect_from_cli as _connect
    from kvshare.actors.config import POOL_PREFIX
    from kvshare.actors.deploy import _named

    _connect(args.address, args.ray_namespace, start=False)
    rns = args.ray_namespace
    known = [n[len(POOL_PREFIX):] for n in _named(rns, POOL_PREFIX)]
    nodes = resolve_nodes(args.node, known) if args.node else None
    ns = args.namespace
    if op == "unpin":
        return {"released": admin.unpin_prefix(ns, _name(args), nodes, ray_namespace=rns)}
    if op == "clear":
        return {"removed": admin.clear(ns, nodes, ray_namespace=rns)}
    if not args.hashes_file:
        raise ValueError(f"kvshare {op} needs --hashes-file F, or --gateway URL --prompt TEXT")
    hashes = read_hashes(args.hashes_file)
    if op == "lookup":
        return {"nodes": admin.lookup(ns, hashes, ray_namespace=rns)}
    if op == "pin":
        return {"pinned": admin.pin_prefix(ns, hashes, _ttl(args), _name(args), nodes,
                                           ray_namespace=rns)}
    if not nodes or len(nodes) != 1:
        raise ValueError("kvshare prefetch needs exactly one --node (the node to fill)")
    return admin.prefetch(ns, hashes, nodes[0], deadline_s=args.deadline, ray_namespace=rns)


def _via_gateway(op: str, args: argparse.Namespace) -> Any:
    import httpx

    if op == "clear":
        raise ValueError("kvshare clear talks to the cluster: pass --address, not --gateway")
    body: dict[str, Any] = {}
    if op != "unpin":
        if args.prompt is None:
            raise ValueError(f"kvshare {op} --gateway needs --prompt TEXT")
        body["prompt"] = args.prompt
    if op in ("pin", "unpin"):
        body["name"] = _name(args)
    if op == "pin":
        body["ttl_s"] = _ttl(args)
    if args.node:
        if op == "prefetch":
            if len(args.node) != 1:
                raise ValueError("kvshare prefetch needs exactly one --node (the node to fill)")
            body["node"] = args.node[0]
        else:
            body["nodes"] = list(args.node)
    if op == "prefetch":
        body["deadline_s"] = args.deadline
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r = httpx.post(f"{args.gateway.rstrip('/')}/v1/kvshare/{op}", json=body, headers=headers,
                   timeout=args.deadline + 60)
    try:
        out = r.json()
    except ValueError:
        raise ValueError(f"gateway answered HTTP {r.status_code} without JSON") from None
    if r.status_code != 200:
        msg = out.get("error", {}).get("message", r.text) if isinstance(out, dict) else r.text
        raise ValueError(f"gateway answered HTTP {r.status_code}: {msg}")
    return out


def _name(args: argparse.Namespace) -> str:
    if not args.name:
        raise ValueError("--name NAME is required: it names the pin for a later unpin or re-pin")
    return str(args.name)


def _ttl(args: argparse.Namespace) -> float:
    if args.ttl is None or not args.ttl > 0:
        raise ValueError("--ttl SECONDS (> 0) is required: how long the pin lasts")
    return float(args.ttl)


def _run(args: argparse.Namespace) -> int:
    op = args.admin_op
    out = _via_gateway(op, args) if args.gateway else _via_cluster(op, args)
    if args.json:
        print(json.dumps(out, default=str))
        return 0
    for key, value in out.items():
        if isinstance(value, dict) and value:
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {json.dumps(v) if isinstance(v, dict) else v}")
        else:
            print(f"{key}: {value}")
    return 0


def register(subparsers: Any) -> None:
    """Add the admin subcommands to the ``kvshare`` command."""
    helps = {
        "lookup": "which nodes hold a prefix, and in which tiers",
        "pin": "keep a prefix from eviction on the nodes holding it, for --ttl seconds",
        "unpin": "end a pin (by --name)",
        "prefetch": "copy a prefix into one node's pool from the nodes holding it",
        "clear": "drop every unpinned block of a namespace",
    }
    for op in OPS:
        p = subparsers.add_parser(op, help=helps[op], description=helps[op])
        p.add_argument("--address", default=None, help="Ray cluster address (default: local)")
        p.add_argument("--ray-namespace", default="kvshare", help=argparse.SUPPRESS)
        p.add_argument("--namespace", default="default", help="kvshare namespace")
        p.add_argument("--node", action="append", default=[],
                       help="node id or unique prefix; repeatable (default: every node)")
        if op not in ("clear", "unpin"):
            p.add_argument("--hashes-file", default=None, help="hex block hashes, one per line")
            p.add_argument("--prompt", default=None, help="prompt text (with --gateway)")
        else:
            p.set_defaults(hashes_file=None, prompt=None)
        if op != "clear":
            p.add_argument("--gateway", default=None, metavar="URL",
                           help="post to this kvshare gateway instead of the cluster")
            p.add_argument("--api-key", default=None, help="the gateway API key (its tenant)")
        else:
            p.set_defaults(gateway=None, api_key=None)
        if op in ("pin", "unpin"):
            p.add_argument("--name", default=None, help="the pin's name")
        if op == "pin":
            p.add_argument("--ttl", type=float, default=None, help="seconds the pin lasts")
        p.add_argument("--deadline", type=float, default=10.0, help=argparse.SUPPRESS
                       if op != "prefetch" else "seconds the prefetch may take")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(func=_run, admin_op=op)

