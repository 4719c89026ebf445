"""``kvshare gateway``: the gateway's router and app built from the command line's arguments.

Workers are static (``--workers URL,...``) or the cluster's (``--address``: the index's
registry, the pools' measured bandwidths, the cluster secret).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any
from urllib.parse import urlparse

from kvshare.addresses import is_loopback, listen_hosts
from kvshare.asgi import serve
from kvshare.auth import WorkerAuth, cluster_secret, secret_from_env
from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
from kvshare.router.core.workers_view import IndexWorkers, StaticWorkers
from kvshare.router.gateway.api_keys import load_api_keys
from kvshare.router.gateway.app import create_app
from kvshare.router.gateway.link_figures import LinkFigures, priced
from kvshare.types import NodeId, WorkerId
from kvshare.workers import WorkerInfo

log = logging.getLogger(__name__)


def static_workers(urls: str, namespace: str) -> StaticWorkers:
    """Workers from ``URL,URL,...``; each URL is its own node unless ``URL#node`` says."""
    infos = []
    for i, item in enumerate(u.strip() for u in urls.split(",") if u.strip()):
        url, _, node = item.partition("#")
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"worker URL {url!r} must look like http://host:port")
        infos.append(WorkerInfo(WorkerId(f"w{i}-{parsed.netloc}"), NodeId(node or parsed.netloc),
                                (namespace,), url.rstrip("/")))
    if not infos:
        raise ValueError("no workers: pass --workers http://host:port,... or --address")
    return StaticWorkers(infos)


def serve_from_args(args: argparse.Namespace) -> int:
    """``kvshare gateway``: static workers (``--workers``) or the cluster's (``--address``)."""
    index: Any = None
    admin: Any = None
    if args.address:
        import ray

        from kvshare.actors.index.client import IndexClient

        ray.init(address=args.address, log_to_driver=False)
        from kvshare.actors.admin import ClusterAdmin

        index = IndexClient.connect()
        workers: Any = IndexWorkers(index)
        if getattr(args, "index_replica", False):  # routing reads a local copy (no actor call)
            from kvshare.actors.index.replica import IndexReplica

            index = IndexReplica.follow(index)
        admin = ClusterAdmin()
    else:
        workers = static_workers(args.workers, args.namespace)
    from kvshare.cost import Bandwidths
    from kvshare.transfer.probe import parse_overrides

    given = parse_overrides(args.bandwidth) if args.bandwidth else {}  # --bandwidth wins
    if args.links_refresh_s < 0:
        raise SystemExit(f"--links-refresh-s must be >= 0 seconds, got {args.links_refresh_s}")
    bandwidths = Bandwidths.from_measured(given)
    if args.address:  # bytes/s the cluster's pools probed, per link where they probed links
        from kvshare.actors.deploy import measured_bandwidths, measured_links

        bandwidths = priced(measured_bandwidths(wait_s=10.0), measured_links(), given)
    common: dict[str, Any] = {
        "namespace": args.namespace, "policy": args.policy,
        "prefill_tokens_per_s": args.prefill_tokens_per_s, "bandwidths": bandwidths,
    }
    tokenizer: Any = None
    if getattr(args, "vllm_model", None):
        from kvshare.tokenizer import HFTokenizer
        from kvshare.vllm.server.worker import VllmKeys

        vk = VllmKeys.from_model(args.vllm_model, args.block_tokens, args.dtype)
        every, windows = vk.layout.fetch_terms()
        cfg = RouterConfig(model_id=vk.identity, layout_fingerprint=vk.layout.fingerprint(),
                           block_tokens=args.block_tokens, bytes_per_token=every,
                           kv_windows=windows, **common)
        tokenizer = HFTokenizer(args.vllm_model)
    elif args.engine_config:
        from kvshare.engines.hf import EngineConfig, model_keys

        keys = model_keys(EngineConfig(**json.loads(args.engine_config)))
        cfg = RouterConfig.from_model_keys(keys, **common)
        tokenizer = keys.tokenizer
    else:
        cfg = RouterConfig(block_tokens=args.block_tokens, model_id=args.model_id,
                           layout_fingerprint=args.layout_fingerprint, **common)
    router = CacheAwareRouter(index, workers, cfg, tokenizer)
    if args.address and args.links_refresh_s:
        from kvshare.actors.deploy import measured_bandwidths, measured_links

        LinkFigures(router.core, lambda: (measured_bandwidths(), measured_links()), given,
                    args.links_refresh_s).start()
    secret = cluster_secret() if args.address else secret_from_env()
    if secret is None:
        log.warning("no cluster secret (KVSHARE_CLUSTER_SECRET): tenant salts are this "
                    "process's own and no worker token is sent")
    app = create_app(router, load_api_keys(args.api_keys, secret), admin=admin,
                     worker_auth=WorkerAuth.from_secret(secret),
                     no_worker_wait_s=args.no_worker_wait_s)
    hosts = listen_hosts(args.host)  # after ray.init: 'node' is this node's cluster address
    if not all(map(is_loopback, hosts)) and not args.api_keys:
        log.warning("the gateway listens on %s port %d without --api-keys: anyone who reaches "
                    "it can send requests as tenant 'default'", ", ".join(hosts), args.port)
    log.info("kvshare gateway on %s port %d", ", ".join(hosts), args.port)
    serve(app, hosts, args.port)
    return 0
