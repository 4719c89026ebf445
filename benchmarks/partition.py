"""A partition longer than Ray's node-death timeout, under a steady stream through the gateway
(root only: emulated hosts).

Two emulated hosts, one vLLM-CPU worker with the kvshare connector on each (the tiny Llama of
the vLLM tests, fp32; ``benchmarks/vllm_hosts.py``), the gateway in the root namespace. Ray's
health checks are shortened so a node that stops answering is declared dead in ~2 s
(``health_check_period_ms`` 500, ``health_check_timeout_ms`` 500,
``health_check_failure_threshold`` 3; Ray's defaults take ~16-30 s). Six short prompts are
each computed once, cold, half on each host (the answers recomputation gives); then
``--clients`` clients send greedy completions through the gateway round-robin over them while
host B's link goes down for ``--cut-s`` seconds (default 12: several node-death timeouts).
Ray declares B's node dead; when the link returns, B's raylet learns it and exits, taking B's
worker actor and pool with it. B is then *replaced* as an operator would: B is rebooted
(every process on it ended, its old vLLM server too), a new Ray node starts on B (the watcher
gives it a pool) and
``kvshare vllm start``'s code path starts a new worker there. By then A holds the six prompts'
blocks and rightly keeps them, so the stream adds two prompts computed cold on B before the cut
(held by nobody after B's replacement): they go where no queue waits, B's new worker. The
stream runs until the new worker has answered a request (or ``--recover-timeout-s``).

Last line, JSON: ``requests``, ``status_5xx``, ``failed``, ``wrong`` (an answer other than the
prompt's recomputed one), ``max_latency_s``, ``over_deadline`` (past ``--deadline-s``),
``routed_to_cut_while_lapsed`` (decisions for B's old worker from 1 s after its lease lapsed),
``lease_lapsed_after_s``, ``node_dead_after_s`` (from the cut), ``recover_s`` (from the link's
return to B's new worker's first answer), ``replace_s`` (of which: restarting B's node and its
vLLM server), ``a_blocks_not_loaded_from_b`` and the Ray settings used.

    sudo .venv/bin/python benchmarks/partition.py [--cut-s 12] [--clients 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.vllm_hosts import VllmHostsStack, vllm_hosts_stack
from kvshare.testing.request_stream import Membership, RequestStream, decisions, summary

NODE_DEATH = {"health_check_period_ms": 500, "health_check_timeout_ms": 500,
              "health_check_failure_threshold": 3}
MAX_TOKENS = 4


def build_model(root: str) -> str:
    """The tiny Llama the vLLM tests serve (tests/vllm_helpers.py ``tiny_model``)."""
    from kvshare.testing.tiny_model import TinyModelSpec, build_tiny_llama

    spec = TinyModelSpec(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                         intermediate_size=256)
    return build_tiny_llama(os.path.join(root, "tiny-vllm"), spec)


def cold_answers(st: VllmHostsStack, prompts: list[str], on: Any = None) -> list[str]:
    """Each prompt computed once, nothing cached anywhere: half on each host (all on host
    ``on`` where given)."""
    import httpx

    out = []
    for i, text in enumerate(prompts):
        info = st.worker(on if on is not None else st.hosts[i % len(st.hosts)])
        r = httpx.post(f"{info['endpoint']}/v1/completions", timeout=120, json={
            "model": st.model, "prompt": st.router.tokenize(prompt=text), "temperature": 0,
            "max_tokens": MAX_TOKENS})
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


def failed_blocks(endpoint: str) -> float:
    import httpx

    text = httpx.get(f"{endpoint}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:kvshare_load_failed_blocks_total"))


def node_death(st: VllmHostsStack, node: str, since: float, stop: threading.Event) -> list[float]:
    """Polls Ray's node table; the returned list gets the time ``node`` was first not alive."""
    import ray

    seen: list[float] = []

    def poll() -> None:
        while not stop.is_set() and not seen:
            try:
                alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            except Exception:
                alive = {node}
            if node not in alive:
                seen.append(time.monotonic())
            stop.wait(0.2)

    threading.Thread(target=poll, daemon=True).start()
    return seen


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvs-partition-", dir="/tmp") as tmp, \
            vllm_hosts_stack(build_model(tmp), system_config=NODE_DEATH) as st:
        hs = st.hosts
        a, b = hs[0], hs[1]
        old = st.worker(b)
        prompts = [f"Partition note {i}: what crosses a link must survive its loss. " * 6
                   for i in range(6)]
        # two more, computed on B only: after B is replaced nobody holds them, so the stream
        # sends them once B is back (the six above stay on A, which holds them by then)
        fresh = [f"Fresh note {i}: a replaced host serves new prefixes first. " * 6
                 for i in range(2)]
        expected = cold_answers(st, prompts) + cold_answers(st, fresh, on=b)
        a_failed = failed_blocks(st.worker(a)["endpoint"])
        members = Membership(st.index.workers).start()
        routed = decisions(st.router)
        stream = RequestStream(st.url, st.namespace, prompts, clients=args.clients,
                               max_tokens=MAX_TOKENS, deadline_s=args.deadline_s).start()
        stop = threading.Event()
        replace_s = None
        try:
            time.sleep(3.0)
            cut_at = time.monotonic()
            dead = node_death(st, old["node"], cut_at, stop)
            hs.down(b)
            time.sleep(args.cut_s)
            hs.up(b)
            up_at = time.monotonic()
            print(f"link of {b.name} back after {args.cut_s:g} s; node declared dead "
                  f"{(dead[0] - cut_at) if dead else float('nan'):.1f} s after the cut",
                  flush=True)
            t0 = time.monotonic()
            hs.restart_ray_node(b)  # a reboot: also ends the old vLLM server (its own session)
            new = st.start_worker(b)
            replace_s = time.monotonic() - t0
            print(f"{b.name} replaced in {replace_s:.1f} s: worker {new['worker_id']}",
                  flush=True)
            stream.add(fresh)
            deadline = time.monotonic() + args.recover_timeout_s
            while time.monotonic() < deadline and not any(
                    o.worker == new["worker_id"] for o in stream.snapshot()):
                time.sleep(0.2)
        finally:
            outcomes = stream.stop()
            members.stop()
            stop.set()
            del st.router.route
        lapsed, back = members.gone_and_back(old["worker_id"], cut_at)
        got = summary(outcomes, expected, deadline_s=args.deadline_s, cut_at=cut_at,
                      up_at=up_at, cut_worker=old["worker_id"], lapsed_at=lapsed,
                      listed_again_at=back, routed=routed, served_again_by=[new["worker_id"]])
        got.update({
            "cut_s": args.cut_s, "clients": args.clients, "deadline_s": args.deadline_s,
            "node_dead_after_s": round(dead[0] - cut_at, 3) if dead else None,
            "replace_s": None if replace_s is None else round(replace_s, 3),
            "served_by_new_worker": sum(1 for o in outcomes if o.worker == new["worker_id"]),
            "a_blocks_not_loaded_from_b": failed_blocks(st.worker(a)["endpoint"]) - a_failed,
            "ray_system_config": NODE_DEATH, "load_avg_1m": round(os.getloadavg()[0], 2),
        })
        return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cut-s", type=float, default=12.0, help="how long host B's link is down")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=30.0,
                   help="each request's deadline_s at the gateway")
    p.add_argument("--recover-timeout-s", type=float, default=300.0)
    args = p.parse_args()
    from kvshare.testing.hosts import root_missing_reason

    if (why := root_missing_reason()) is not None:
        raise SystemExit(why)
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
