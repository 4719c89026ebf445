"""Run one reference worker: ``python -m kvshare.engines --namespace tiny --port 8001``.

With ``--address`` (or ``auto``) it joins a Ray cluster where kvshare is deployed, reuses and
stores KV through the node's pool and registers with the index; without it, it serves with no
cache (the cold baseline). Stops on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvshare.engines", description=__doc__)
    p.add_argument("--namespace", default="default", help="kvshare namespace (pools serve it)")
    p.add_argument("--model", default=None, help="local HF model directory (default: tiny Llama)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-init model")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument("--address", default=None, help="Ray address, or 'auto'; omit for no cache")
    p.add_argument("--remote", default="auto", choices=("auto", "nixl", "objstore"),
                   help="remote transport (auto: the faster one the node's pool measured)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--host", default=None,
                   help="address to bind and register (default: the node's, see kvshare.addresses)")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    for key, value in (("RAY_USAGE_STATS_ENABLED", "0"), ("NIXL_LOG_LEVEL", "WARN")):
        os.environ.setdefault(key, value)
    from kvshare.engines.hf import EngineConfig
    from kvshare.engines.service import WorkerService

    if args.address:
        import ray

        ray.init(address=args.address, log_to_driver=False)
    cfg = EngineConfig(model_path=args.model, seed=args.seed, dtype=args.dtype,
                       block_tokens=args.block_tokens, threads=args.threads)
    svc = WorkerService(args.namespace, cfg, worker_id=args.worker_id,
                        connect=bool(args.address), remote=args.remote, host=args.host,
                        port=args.port, model_name=args.namespace)
    print(json.dumps(svc.ready()), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    svc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
