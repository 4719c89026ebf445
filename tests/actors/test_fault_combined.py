"""Faults under load, one after another: a worker, a pool, then the index for good.

A real two-node Ray cluster with kvshare deployed (index, watcher, one pool per node), three
reference transformers workers as Ray actors (one on node 0, two on node 1), and the real
gateway (index-listed workers, cost policy) on loopback. Two clients keep sending completions
that share system prompts (so blocks are reused across nodes). While they do, the test kills
a worker that has requests in flight, then node 1's pool (Ray restarts it, empty), then the
index shard without restart (the watcher recreates it). Every request must be answered 200
(retried on another worker when its worker died), every answer must equal what a cold engine
computes for the same prompt (greedy, no cache), and the index must list the workers and
hold the cached prefixes again within 10 s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from conftest import start_cluster, stop_cluster
from engine_helpers import BLOCK, SMALL
from http_helpers import serve_app

from kvshare.actors.config import index_name
from kvshare.actors.deploy import RAY_NAMESPACE, deploy, get_pool
from kvshare.actors.index.client import IndexClient
from kvshare.engines.hf import EngineConfig, HFEngine, model_keys
from kvshare.engines.service import WorkerService
from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
from kvshare.router.core.workers_view import IndexWorkers
from kvshare.router.gateway.app import create_app

pytestmark = pytest.mark.cluster

NS = "faults"
CFG = EngineConfig(overrides=dict(SMALL), block_tokens=BLOCK, threads=1)
SYSTEMS = ["You are the kvshare assistant; answer about KV cache reuse. " * 5,
           "You translate short sentences into French, nothing else. " * 5]
PROMPTS = [f"{s}\nQ{q}: what happens to block {q}?" for s in SYSTEMS for q in range(3)]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    cluster = start_cluster()
    workers: dict[str, Any] = {}
    gateway = None
    try:
        keys = model_keys(CFG)
        bpb = keys.layout.bytes_per_block
        deploy(cluster.address, namespace=NS, layout=keys.layout, host_gb=256 * bpb / 2**30)
        Worker = ray.remote(num_cpus=0.5)(WorkerService)
        placement = {"w0": "node_0", "w1": "node_1", "w2": "node_1"}
        workers = {name: Worker.options(resources={node: 0.1}).remote(  # type: ignore[attr-defined]
            NS, CFG, worker_id=name, model_name=NS) for name, node in placement.items()}
        nodes = {name: ray.get(w.ready.remote(), timeout=300)["node"] for name, w in workers.items()}
        index = IndexClient.connect()
        router = CacheAwareRouter(index, IndexWorkers(index, refresh_s=0.2),
                                  RouterConfig.from_model_keys(keys, namespace=NS, policy="cost"),
                                  keys.tokenizer)
        gateway = serve_app(create_app(router))
        deadline = time.monotonic() + 60
        while httpx.get(f"{gateway.url}/health", timeout=10).json().get("workers", 0) < 3:
            assert time.monotonic() < deadline, "the workers did not register"
            time.sleep(0.2)
        cold = HFEngine(CFG)  # the recompute-only baseline: same weights, no cache at all
        baseline = {p: cold.generate(keys.tokenizer.encode(p), MAX_TOKENS)[0] for p in PROMPTS}
        yield {"url": gateway.url, "workers": workers, "nodes": nodes, "keys": keys,
               "baseline": baseline}
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers.values():
            try:
                ray.get(w.stop.remote(), timeout=30)
            except Exception:  # the killed one is gone
                pass
        stop_cluster(cluster)


class Load:
    """Clients sending completions through the gateway until :meth:`stop`; every answer kept."""

    def __init__(self, url: str, clients: int = 2) -> None:
        self.url = url
        self.answers: list[tuple[float, str, int, list[int] | str]] = []  # (t, prompt, status, ids)
        self.lock = threading.Lock()
        self.sent = 0
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(c,)) for c in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, c: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = c
            while not self._stop.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                with self.lock:
                    self.sent += 1
                try:
                    r = http.post(f"{self.url}/v1/completions", json={
                        "model": NS, "prompt": prompt, "max_tokens": MAX_TOKENS,
                        "ignore_eos": True})
                    got: list[int] | str = (r.json()["choices"][0]["token_ids"]
                                            if r.status_code == 200 else r.text[:300])
                    status = r.status_code
                except httpx.HTTPError as exc:  # a lost request: counted, never hidden
                    status, got = -1, repr(exc)
                with self.lock:
                    self.answers.append((time.monotonic(), prompt, status, got))
                i += 1

    def count(self) -> int:
        with self.lock:
            return len(self.answers)

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=180)


def wait_for(what: str, check: Any, timeout_s: float) -> float:
    """Seconds until ``check()`` is true (AssertionError after ``timeout_s``)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def test_worker_pool_and_index_killed_under_load_lose_nothing(env: dict[str, Any]) -> None:
    keys, workers, nodes = env["keys"], env["workers"], env["nodes"]
    hashes = {p: keys.hashes(keys.tokenizer.encode(p)) for p in PROMPTS}
    probe = IndexClient.connect(timeout_s=2.0)

    def cached_prefixes() -> int:  # prompts whose first block some node's pool holds again
        try:
            return sum(probe.match(NS, hashes[p]).combined_prefix > 0 for p in PROMPTS)
        except Exception:
            return 0

    def workers_listed() -> int:
        try:
            return len(probe.workers())
        except Exception:
            return 0

    load = Load(env["url"])
    marks: dict[str, int] = {}
    listed_at: float | None = None  # seconds after the index kill until it lists both workers
    cached_at: float | None = None  # ... and until it holds cached prefixes again
    try:
        wait_for("steady load", lambda: load.count() >= 12, 120)
        wait_for("cached prefixes", lambda: cached_prefixes() == len(PROMPTS), 60)
        victim = workers["w2"]  # kill it while it has requests in flight
        wait_for("a request on w2", lambda: ray.get(victim.stats.remote())["load"]["running"] > 0, 60)
        marks["worker"] = load.count()
        ray.kill(victim, no_restart=True)
        wait_for("answers after the worker kill", lambda: load.count() >= marks["worker"] + 8, 120)
        marks["pool"] = load.count()
        ray.kill(get_pool(nodes["w1"]), no_restart=False)  # Ray restarts it, empty
        wait_for("answers after the pool kill", lambda: load.count() >= marks["pool"] + 8, 120)
        marks["index"] = load.count()
        ray.kill(ray.get_actor(index_name(0), namespace=RAY_NAMESPACE), no_restart=True)
        t_kill = time.monotonic()
        while time.monotonic() - t_kill < 40 and None in (listed_at, cached_at):
            if listed_at is None and workers_listed() == 2:
                listed_at = time.monotonic() - t_kill
            if cached_at is None and cached_prefixes() > 0:
                cached_at = time.monotonic() - t_kill
            time.sleep(0.05)
        end = load.count()
        wait_for("answers after the index came back", lambda: load.count() >= end + 8, 120)
    finally:
        load.stop()
    answers = load.answers
    phases = sorted(marks.items(), key=lambda kv: kv[1])
    bounds = [*(n for _, n in phases), len(answers)]
    for (name, start), end in zip(phases, bounds[1:], strict=True):
        part = answers[start:end]
        print(f"after {name} kill: {len(part)} answered, "
              f"{sum(a[2] == 200 for a in part)} ok, {sum(a[2] != 200 for a in part)} failed")
    watcher = ray.get(ray.get_actor("kvshare-watcher", namespace=RAY_NAMESPACE).status.remote())
    print(f"sent {load.sent}, answered {len(answers)}; after the index kill: workers listed in "
          f"{listed_at} s, prefixes cached in {cached_at} s; watcher {watcher}")
    bad = [(a[2], a[3]) for a in answers if a[2] != 200]
    assert not bad, bad[:5]  # no 5xx, no lost request
    assert load.sent == len(answers)
    wrong = [(p[-30:], got, env["baseline"][p]) for _, p, _, got in answers
             if got != env["baseline"][p]]
    assert not wrong, wrong[:3]  # every answer is what recomputation gives
    stats = {n: ray.get(w.stats.remote()) for n, w in workers.items() if n != "w2"}
    reused = sum(s["worker"].get("prefill_tokens_saved", 0) for s in stats.values())
    assert reused > 0, stats  # the cache was really in use (answers came from reused KV too)
    assert watcher["index_recreated"] == 1
    assert listed_at is not None and listed_at <= 10.0 and cached_at is not None \
        and cached_at <= 10.0, (listed_at, cached_at)
