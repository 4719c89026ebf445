"""``kvshare sim``, ``kvshare gateway``, ``kvshare bench`` and the live page of ``kvshare status --web``
(registered through the ``kvshare.commands`` entry-point group: ``kvshare.router.cli:register``;
the page is routing's, so this plugin adds ``--web`` to the cluster plugin's ``status``)."""

from __future__ import annotations

import argparse
from typing import Any


def _tokens(text: str) -> int:
    from kvshare.router.sim.cluster_model import MAX_TOKENS

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if not 0 <= value <= MAX_TOKENS:  # also refuses inf and nan
        raise argparse.ArgumentTypeError(f"must be a number of tokens in [0, {MAX_TOKENS:.0e}], got {text}")
    return int(value)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (also ``benchmarks/sim_sweep.py``'s)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def jitter_ms(text: str) -> float:
    """An argparse type: how far a replica may move an arrival, ms in [0, 60000]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds, got {text!r}") from None
    if not 0 <= value <= 60_000:  # also refuses inf and nan
        raise argparse.ArgumentTypeError(f"must be a number of ms in [0, 60000], got {text}")
    return value


def register(subparsers: Any) -> None:
    """Add ``sim``, ``gateway`` and ``bench`` to the ``kvshare`` command, and ``--web`` to ``status``."""
    from kvshare.router.core.registry import DEFAULT_POLICY, policy_names

    _add_status_web(subparsers)

    sim = subparsers.add_parser(
        "sim", help="replay a request trace through the routing policies",
        description="Replay a trace on a modelled cluster (defaults: 10 workers, 3M tokens of "
        "host cache each, 512-token blocks, Llama-2-70B KV, 100 Gbit/s; see router/cluster.py). "
        "Formats: Mooncake JSONL, or kv-cache-tester agentic JSON (a directory or files).",
    )
    sim.add_argument("trace", nargs="+", help="Mooncake JSONL file, or agentic trace dir/files")
    sim.add_argument("--format", default="auto", choices=["auto", "mooncake", "agentic"],
                     help="trace format (default: detected)")
    sim.add_argument("--policy", default="all", choices=[*policy_names(), "all"],
                     help=f"one policy or all (default all; routers default to {DEFAULT_POLICY})")
    sim.add_argument("--sharing", default="global", choices=["local", "global"],
                     help="local: reuse only the own node's blocks; global: any node's")
    sim.add_argument("--workers", type=int, default=10)
    sim.add_argument("--host-tokens", type=_tokens, default=3_000_000, help="per node")
    sim.add_argument("--disk-tokens", type=_tokens, default=0, help="per node")
    sim.add_argument("--block-tokens", type=positive_int, default=None,
                     help="tokens per trace hash id (default: 512 for Mooncake, the files' "
                     "block_size for agentic; a multiple of it coarsens the blocks)")
    sim.add_argument("--model", default="Llama-2-70b-hf", help="bundled config name or path")
    sim.add_argument("--net-gbps", type=float, default=100.0, help="between nodes, Gbit/s")
    sim.add_argument("--gpu-gb", type=float, default=640.0,
                     help="GPU memory per worker, GB (weights + the KV of the running prompt; "
                     "prompts that do not fit are reported, not replayed)")
    sim.add_argument("--gpu-cache-tokens", type=_tokens, default=None,
                     help="each engine's own prefix cache, tokens (every block it computes or "
                     "loads; default: the KV room next to the weights; 0: none)")
    sim.add_argument("--limit", type=positive_int, default=None, help="first N requests only")
    sim.add_argument("--replicas", type=positive_int, default=1,
                     help="replay each policy N times, arrivals moved within --jitter-ms from the "
                     "second on, and print each policy's average, spread and which gaps stand "
                     "out of that noise (a single replay is chaotic: default 1)")
    sim.add_argument("--jitter-ms", type=jitter_ms, default=0.5,
                     help="how far a replica may move each arrival, ms (default 0.5: within "
                     "a Mooncake trace's millisecond timestamps)")
    add_agentic_options(sim, "agentic traces (kv-cache-tester's replay knobs)").add_argument(
        "--time-scale", type=float, default=None,
        help="scale the gaps (0.5 = twice as fast; default 1)")
    sim.add_argument("--json", action="store_true", help="print one JSON object last")
    sim.add_argument("--plot", default=None, help="write a PNG: hit rate vs capacity, TTFT")
    sim.add_argument("--parquet", default=None, help="write per-request results as Parquet")
    sim.add_argument("--no-progress", action="store_true", help="no progress bars")
    sim.add_argument("--progress", action="store_true",
                     help="progress bars even when stderr is not a terminal (default: only on one)")
    sim.set_defaults(func=_sim)

    gw = subparsers.add_parser("gateway", help="OpenAI-compatible cache-aware gateway")
    gw.add_argument("--host", default="node",
                    help="address to listen on: 'node' (default) is this node's cluster address "
                    "(with --address Ray's node IP; KVSHARE_NODE_IP overrides it) and "
                    "127.0.0.1, so clients and the other nodes reach it and no other interface "
                    "does; 0.0.0.0 listens on every interface, 127.0.0.1 on this machine only")
    gw.add_argument("--port", type=int, default=8000)
    gw.add_argument("--workers", default="", help="comma-separated worker base URLs")
    gw.add_argument("--address", default=None,
                    help="Ray cluster address: discover workers registered in the kvshare index")
    gw.add_argument("--policy", default=DEFAULT_POLICY, choices=policy_names())
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
    gw.add_argument("--vllm-model", "--sglang-model", dest="vllm_model", default=None,
                    help="the local model directory the vLLM or SGLang workers serve (kvshare "
                    "vllm|sglang start): tokenize with its tokenizer and chat template, hash "
                    "with its identity (SGLang: --block-tokens is its --page-size)")
    gw.add_argument("--dtype", default="", help="with --vllm-model: the dtype the engine serves in")
    gw.add_argument("--bandwidth", default="",
                    help="GB/s per transport for the cost model, e.g. shm=20,nixl=8,disk=3 (the "
                    "same syntax as KVSHARE_BANDWIDTH_GBPS); with --address these override what "
                    "the cluster's pools measured")
    gw.add_argument("--links-refresh-s", type=float, default=60.0,
                    help="with --address: re-read the pools' probed bandwidths (per transport "
                    "and per link; pools re-probe every 10 min) this often; 0: read them once")
    gw.add_argument("--prefill-tokens-per-s", type=float, default=5000.0,
                    help="initial prefill speed; refitted from the workers' measured timings")
    gw.add_argument("--no-worker-wait-s", type=float, default=10.0,
                    help="how long a request waits for a worker of its namespace to appear "
                    "(starting, re-registering) before a 503; 0: answer 503 at once")
    gw.set_defaults(func=_gateway)

    from kvshare.router.bench.cli import add_bench

    add_bench(subparsers, positive_int, add_agentic_options)


def _sim(args: argparse.Namespace) -> int:
    from kvshare.router.sim.cli import run_sim

    return run_sim(args)


def _gateway(args: argparse.Namespace) -> int:
    from kvshare.router.gateway.cli import serve_from_args

    return int(serve_from_args(args))


def _add_status_web(subparsers: Any) -> None:
    """``kvshare status --web``: the cluster plugin's ``status`` serves the live page instead."""
    status = subparsers.choices.get("status")
    if status is None:  # the cluster plugin is not installed
        return
    status.add_argument("--web", action="store_true",
                        help="serve the live status page at http://HOST:PORT/dashboard")
    status.add_argument("--port", type=int, default=9479, help="--web: HTTP port")
    status.add_argument("--host", default="127.0.0.1",
                        help="--web: address to listen on (default 127.0.0.1: the page has no "
                        "API keys; reach it over ssh -L, or use the gateway's /dashboard, which "
                        "asks for a key); 'node' is this node's cluster address")
    plain = status.get_default("func")

    def status_or_web(args: argparse.Namespace) -> int:
        return _serve_web(args) if args.web else int(plain(args))

    status.set_defaults(func=status_or_web)


def _serve_web(args: argparse.Namespace) -> int:
    """The live page (:mod:`kvshare.router.web`) for this cluster until Ctrl-C."""
    import sys

    from kvshare.actors.admin import ClusterAdmin
    from kvshare.actors.cli_connect import connect_from_cli
    from kvshare.router.web import status_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {args.port}")
    connect_from_cli(args.address, args.ray_namespace, start=False)
    from kvshare.addresses import listen_hosts
    from kvshare.asgi import serve

    hosts = listen_hosts(args.host)  # (connected: 'node' is this node's address)
    print(f"kvshare status page on http://{hosts[0]}:{args.port}/dashboard (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    serve(status_app(ClusterAdmin(args.ray_namespace)), hosts, args.port)
    return 0


def add_agentic_options(parser: argparse.ArgumentParser, title: str) -> Any:
    """kv-cache-tester's replay knobs for agentic traces (``kvshare sim`` and ``kvshare
    bench``); returns their argument group."""
    agentic = parser.add_argument_group(title)
    agentic.add_argument("--users", type=positive_int, default=None,
                         help="concurrent users (default: one per conversation)")
    agentic.add_argument("--warm-prefix-pct", type=float, default=None,
                         help="fraction of max(tool+system tokens) shared by every "
                         "conversation (default 0.5; 0 disables)")
    agentic.add_argument("--max-delay", type=float, default=None,
                         help="cap on the gap between a user's requests, s (default 60)")
    return agentic
