"""The gateway in front of real reference workers on a real two-node cluster, as a chat client
or an agent uses it: read-after-write between back-to-back turns, and a gateway routing on its
own index replica deciding as one asking the index actor does.

Head + 2 nodes (``ray.cluster_utils.Cluster``), kvshare deployed, one reference worker per
node serving HTTP, and two gateways in this process (uvicorn on loopback): one asking the
index actors, one reading an :class:`~kvshare.actors.index.replica.IndexReplica`.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from conftest import start_cluster, stop_cluster
from engine_helpers import BLOCK, SMALL
from http_helpers import Served, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from kvshare.actors.deploy import deploy
from kvshare.actors.index.client import IndexClient
from kvshare.actors.index.replica import IndexReplica
from kvshare.breakdown import STAGES, total
from kvshare.engines.hf import EngineConfig, model_keys
from kvshare.engines.service import WorkerService
from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
from kvshare.router.core.workers_view import IndexWorkers
from kvshare.router.gateway.app import create_app

pytestmark = pytest.mark.cluster

NS = "e2e"
CFG = EngineConfig(overrides=dict(SMALL), block_tokens=BLOCK, threads=1)
SYSTEM_CHARS = 1500  # ~1.5k byte tokens: ~94 blocks of 16


class Env:
    def __init__(self, cluster: Any, workers: dict[str, Any], gateways: dict[str, Any]) -> None:
        self.cluster, self.workers, self.gateways = cluster, workers, gateways
        self.router: CacheAwareRouter = gateways["index"][1]
        self.tokenizer = self.router.tokenizer

    def url(self, gateway: str = "index") -> str:
        served: Served = self.gateways[gateway][0]
        return served.url

    def chat(self, messages: list[dict[str, str]], gateway: str = "index",
             max_tokens: int = 4) -> tuple[str, dict[str, Any], str]:
        """(answer text, the worker's ``kvshare`` figures, the worker that served)."""
        body = {"model": NS, "max_tokens": max_tokens, "messages": messages}
        r = httpx.post(self.url(gateway) + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        return (data["choices"][0]["message"]["content"], data["kvshare"],
                r.headers["x-kvshare-worker"])

    def shared_tokens(self, first: list[dict[str, str]], second: list[dict[str, str]]) -> int:
        """Full blocks of the longest common token prefix of two chats."""
        a = self.tokenizer.apply_chat_template(first)
        b = self.tokenizer.apply_chat_template(second)
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n // BLOCK * BLOCK


def text(seed: int, n: int = SYSTEM_CHARS) -> str:
    rng = random.Random(seed)
    words = ["cache", "tensor", "ray", "node", "prefix", "block", "query", "route", "layer"]
    return " ".join(rng.choice(words) for _ in range(n // 4))[:n]


def _gateway(index: Any, keys: Any) -> tuple[Served, CacheAwareRouter]:
    # the tests assert where the index sends a prompt: a deadline for a busy 2-core CI machine
    # (the 50 ms default's load-only fallback is test_index_recovery's and test_embed's)
    cfg = RouterConfig.from_model_keys(keys, namespace=NS, policy="cost", index_timeout_s=10.0)
    router = CacheAwareRouter(index, IndexWorkers(IndexClient.connect()), cfg, keys.tokenizer)
    return Served(create_app(router)), router


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    cluster = start_cluster()
    workers: dict[str, Any] = {}
    gateways: dict[str, Any] = {}
    replica: IndexReplica | None = None
    try:
        keys = model_keys(CFG)
        bpb = keys.layout.bytes_per_block
        deploy(cluster.address, namespace=NS, layout=keys.layout, host_gb=1024 * bpb / 2**30,
               disk_gb=0, disk_dir=tempfile.mkdtemp(prefix="kvs-e2e-disk-"),
               publish_interval_s=1.0)  # batching alone would leave the next turn 1 s behind
        Worker = ray.remote(num_cpus=1)(WorkerService)
        workers = {f"w{i}": Worker.options(resources={f"node_{i}": 0.1}).remote(  # type: ignore[attr-defined]
            NS, CFG, worker_id=f"w{i}", model_name=NS, cut_policy="all") for i in range(2)}
        for w in workers.values():
            ray.get(w.ready.remote(), timeout=180)
        index = IndexClient.connect()
        replica = IndexReplica.follow(index)
        gateways = {"index": _gateway(index, keys), "replica": _gateway(replica, keys)}
        deadline = time.monotonic() + 30  # both workers registered, the replica synced
        while time.monotonic() < deadline and not (
                replica.ready and all(httpx.get(s.url + "/health").json().get("workers", 0) == 2
                                      for s, _ in gateways.values())):
            time.sleep(0.2)
        yield Env(cluster, workers, gateways)
    finally:
        for served, _ in gateways.values():
            served.stop()
        if replica is not None:
            replica.close()
        for w in workers.values():
            try:
                ray.get(w.stop.remote(), timeout=30)
            except Exception:
                pass
        stop_cluster(cluster)


def _turns(seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    first = [{"role": "system", "content": text(seed)},
             {"role": "user", "content": f"question {seed}: what is a KV block?"}]
    second = first + [{"role": "assistant", "content": "a block"},
                      {"role": "user", "content": "and who holds it?"}]
    return first, second


def test_back_to_back_turn_reuses_the_previous_turn_on_the_same_worker(env: Env) -> None:
    first, second = _turns(1)
    answer, kv1, w1 = env.chat(first)
    assert kv1["reused_tokens"] == 0  # a new system prompt: nothing cached anywhere
    second[2]["content"] = answer  # the client sends back what it got, at once
    _, kv2, w2 = env.chat(second)
    shared = env.shared_tokens(first, second)
    assert w2 == w1, "the router's pending blocks keep the conversation on its worker"
    assert kv2["reused_tokens"] >= 0.95 * shared, kv2
    assert kv2["bytes_by_transport"].get("shm", 0) > 0  # from the node's own pool


def test_back_to_back_turn_on_the_other_node_pulls_the_previous_turn(env: Env) -> None:
    first, second = _turns(2)
    answer, _, w1 = env.chat(first)
    second[2]["content"] = answer
    env.router.mark_down(w1, for_s=2.0)  # the first worker refuses: the turn goes elsewhere
    try:
        _, kv2, w2 = env.chat(second)
    finally:
        env.router.mark_up(w1)  # the next tests route to both workers
    shared = env.shared_tokens(first, second)
    assert w2 != w1
    assert kv2["reused_tokens"] >= 0.95 * shared, kv2
    remote = kv2["bytes_by_transport"].get("nixl", 0) + kv2["bytes_by_transport"].get("objstore", 0)
    assert remote > 0  # pulled from the first worker's node


def test_every_answer_says_where_its_ttft_went(env: Env) -> None:
    """Cold then warm, streamed with the official openai client and not: ``kvshare.breakdown``
    has every stage, the stages fit in the time the client waited, the warm turn's time moved
    from prefill to transfer, and both /metrics pages count the stages."""
    import openai

    client = openai.OpenAI(base_url=env.url() + "/v1", api_key="none", max_retries=0)
    before = _samples(env.url(), "kvshare_gateway_ttft_stage_seconds_count")
    first, second = _turns(3)
    seen: list[dict[str, Any]] = []
    for messages in (first, second):
        t0 = time.perf_counter()
        kv: dict[str, Any] = {}
        for chunk in client.chat.completions.create(model=NS, messages=messages, max_tokens=2,
                                                    stream=True):
            kv = (chunk.model_extra or {}).get("kvshare") or kv
        waited = time.perf_counter() - t0
        b = kv["breakdown"]
        assert set(STAGES) <= set(b) and all(b[s] >= 0 for s in STAGES), b
        assert total(b) <= waited, (total(b), waited)
        seen.append(b)
    cold, warm = seen
    assert cold["transfer"] == 0 and warm["transfer"] > 0 and "shm" in warm["transfer_by_transport"]
    assert warm["prefill"] < cold["prefill"]
    _, kv, _ = env.chat(second + [{"role": "user", "content": "and now?"}])  # not streamed
    assert set(STAGES) <= set(kv["breakdown"]), kv
    after = _samples(env.url(), "kvshare_gateway_ttft_stage_seconds_count")
    assert all(after[(("stage", s),)] - before.get((("stage", s),), 0) == 3 for s in STAGES)
    summed = 0.0
    for w in env.workers.values():
        url = ray.get(w.endpoint.remote())
        got = _samples(url, "kvshare_worker_ttft_stage_seconds_sum")
        summed += sum(v for k, v in got.items() if ("stage", "prefill") in k)
    assert summed > 0


def _samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples called ``name`` on ``url``/metrics, by their sorted labels."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for smp in fam.samples:
            if smp.name == name:
                out[tuple(sorted((k, v) for k, v in smp.labels.items() if k != "worker"))] = smp.value
    return out


def test_a_gateway_on_the_index_replica_routes_as_one_on_the_index(env: Env) -> None:
    """Prompts cached on either worker: both gateways see the same cached blocks and rank
    every worker for the same reason at the same estimate, once the replica has caught up, and
    send each prompt to the same worker (pulling it from the holder's node costs ~1 ms more
    here, about the policy's tie: a near-tie goes to the reader, not to each router's own
    rotation). Prompts cached nowhere are load ties (rotated): same reason, nothing cached."""
    seeded = []
    for i, seed in enumerate((10, 11, 12, 13)):  # straight to a worker: no gateway's pending
        first, _ = _turns(seed)
        ids = env.tokenizer.apply_chat_template(first)
        ray.get(env.workers[f"w{i % 2}"].generate.remote(ids, 1), timeout=120)
        seeded.append(first + [{"role": "user", "content": "one more"}])
    wait_idle(IndexClient.connect(), ["w0", "w1"], time.time())  # a report taken during a seeding prefill would make its holder busy
    time.sleep(1.0)  # the replica's poll round (10 ms), both gateways' load refresh (0.5 s)
    fresh = [_turns(seed)[0] for seed in (20, 21)]  # cached nowhere
    for messages in seeded + fresh:
        decided, ranked = [], []
        for gw in ("index", "replica"):
            r = httpx.post(env.url(gw) + "/v1/route", json={"messages": messages}, timeout=30)
            assert r.status_code == 200, r.text
            d = r.json()
            decided.append((d["worker"], d["reason"], d["cached_blocks"], d["fallback"]))
            ranked.append({c["worker"]: (c["reason"], c["est_ttft_s"]) for c in d["candidates"]})
        if messages not in seeded:
            assert decided[0][1:] == decided[1][1:] == ("load", 0, ""), decided
            continue
        assert decided[0][2:] == decided[1][2:] and decided[0][2] > 0, decided
        assert ranked[0].keys() == ranked[1].keys() == {"w0", "w1"}, ranked
        for w in ranked[0]:  # one view: the same plan and (to the cost model's rounding) estimate
            (r0, e0), (r1, e1) = ranked[0][w], ranked[1][w]
            assert r0 == r1 and e0 == pytest.approx(e1, rel=0.02, abs=2e-4), (w, ranked)
        assert decided[0] == decided[1], (decided, ranked)  # a near-tie too: the reader wins


def test_kvshare_bench_reads_the_hit_rate_per_tier_from_the_workers_answers(
        env: Env, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Reference workers export no vLLM counters: ``kvshare bench`` through the gateway takes
    each answer's ``kvshare.tokens_by_source`` instead (row 2 reuses row 1's 3 blocks)."""
    import json

    from kvshare.cli import main

    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 4 * BLOCK, "output_length": 2, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 3000, "input_length": 4 * BLOCK, "output_length": 2,
             "hash_ids": [1, 2, 3, 5]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["bench", "--url", env.url(), "--trace", str(trace), "--block-tokens", str(BLOCK),
               "--vocab", "500", "--json", "--metrics-interval", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    run = json.loads(out.strip().splitlines()[-1])["runs"][0]
    assert run["kind"] == "gateway" and run["requests"]["completed"] == 2, run
    assert run["hit_rate_from"] == ["usage"], run
    tiers = run["hit_rate_by_tier"]
    reused = tiers["local_pool"] + tiers["remote_pool"]  # whichever worker the router chose
    assert reused == pytest.approx(3 * BLOCK / (8 * BLOCK), abs=0.01), tiers
    assert tiers["computed"] == pytest.approx(1 - reused, abs=1e-3)
