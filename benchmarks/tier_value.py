"""The docs' worked run (docs/measure.md): replay a workload, read what each tier is worth,
size the tiers.

Starts the emulated cluster the demos use (a head and two nodes), deploys kvshare with a small
host tier and a disk tier per node (``--host-blocks``, ``--disk-blocks``), two reference
transformers workers (tiny Llama, random weights) and the gateway; writes a Mooncake trace of
``--users`` conversations of ``--turns`` turns, each turn extending its conversation by
``--turn-blocks`` blocks after a shared system prompt block, so that a conversation's earlier
turns are reused after other conversations have pushed them out of the host tier; replays it
with ``kvshare bench`` through the gateway; then prints ``kvshare status --sizing`` (the tier
values and the sizing curves) as an operator would run them, and ends with one JSON line
(the tier value rows and the bench figures).

    python benchmarks/tier_value.py [--users 6] [--turns 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's kvshare first
NAMESPACE = "measure"
GiB = 2**30


def write_trace(path: Path, users: int, turns: int, turn_blocks: int, block_tokens: int,
                gap_ms: int) -> int:
    """Mooncake JSONL: user ``u``'s turn ``t`` is the system block, then ``(t + 1) *
    turn_blocks`` blocks of its own, sent round-robin over users ``gap_ms`` apart."""
    rows = []
    at = 0
    for t in range(turns):
        for u in range(users):
            ids = [1] + [1000 * (u + 1) + i for i in range((t + 1) * turn_blocks)]
            rows.append({"timestamp": at, "input_length": len(ids) * block_tokens,
                         "output_length": 4, "hash_ids": ids})
            at += gap_ms
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def run(cmd: list[str], env: dict[str, str]) -> str:
    print("$ " + " ".join(cmd[2:] if cmd[1:3] == ["-m", "kvshare.cli"] else cmd), flush=True)
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    sys.stderr.write(done.stderr[-4000:])
    print(done.stdout, flush=True)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[3] if len(cmd) > 3 else cmd} failed ({done.returncode})")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-blocks", type=int, default=2)
    ap.add_argument("--gap-ms", type=int, default=400)
    ap.add_argument("--host-blocks", type=int, default=12)
    ap.add_argument("--disk-blocks", type=int, default=96)
    ap.add_argument("--block-tokens", type=int, default=128)
    args = ap.parse_args(argv)

    import ray
    import uvicorn

    from kvshare.actors.admin import ClusterAdmin
    from kvshare.actors.deploy import deploy, get_index_client, status
    from kvshare.actors.local_cluster import local_cluster
    from kvshare.actors.tier_value import value_rows
    from kvshare.engines.hf import EngineConfig, model_keys
    from kvshare.engines.service import WorkerService
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import IndexWorkers
    from kvshare.router.gateway.app import create_app

    engine_cfg = EngineConfig(threads=1, block_tokens=args.block_tokens)
    keys = model_keys(engine_cfg)
    bb = keys.layout.bytes_per_block
    with local_cluster(2, node_cpus=2, temp_prefix="kvs-tier-value-ray-") as c, tempfile.TemporaryDirectory(prefix="kvs-tier-value-") as tmp:
        deploy(c.address, namespace=NAMESPACE, layout=keys.layout,
               host_gb=args.host_blocks * bb / GiB, disk_gb=args.disk_blocks * bb / GiB,
               disk_dir=os.path.join(tmp, "disk"))
        worker_cls = ray.remote(num_cpus=1)(WorkerService)
        workers = {f"worker-{i}": worker_cls.options(resources={f"node_{i}": 0.1}).remote(  # type: ignore[attr-defined]
            NAMESPACE, engine_cfg, worker_id=f"worker-{i}", model_name="tiny-llama")
            for i in range(2)}
        ray.get([w.ready.remote() for w in workers.values()], timeout=300)
        index = get_index_client()
        cfg = RouterConfig.from_model_keys(keys, namespace=NAMESPACE, policy="cost")
        router = CacheAwareRouter(index, IndexWorkers(index), cfg, keys.tokenizer)
        server = uvicorn.Server(uvicorn.Config(create_app(router, admin=ClusterAdmin()),
                                               host="127.0.0.1", port=0, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        trace = Path(tmp) / "conversations.jsonl"
        n = write_trace(trace, args.users, args.turns, args.turn_blocks, args.block_tokens,
                        args.gap_ms)
        print(f"kvshare up: {args.host_blocks} host blocks ({args.host_blocks * bb / 2**20:.0f}"
              f" MiB) and {args.disk_blocks} disk blocks per node; gateway {url}; "
              f"{n} requests", flush=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": c.address}
        py = [sys.executable, "-m", "kvshare.cli"]
        out = run([*py, "bench", "--url", url, "--trace", str(trace), "--block-tokens",
                   str(args.block_tokens), "--vocab", "512", "--max-tokens", "4", "--json"], env)
        bench = json.loads(out.strip().splitlines()[-1])
        time.sleep(1.0)  # the workers' next load reports carry their prefill speed
        run([*py, "status", "--sizing", "--address", c.address], env)
        st = status()
        rows = value_rows(st)
        server.should_exit = True
        for w in workers.values():
            ray.get(w.stop.remote(), timeout=30)
    run_ = bench["runs"][0]
    print(json.dumps({"requests": n, "ttft_p50_s": run_["ttft_s"]["p50"],
                      "ttft_p99_s": run_["ttft_s"]["p99"], "tier_value": rows,
                      "prefill_tokens_per_s": st.get("prefill_tokens_per_s", {})}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
