"""CacheAwareRouter embedded in asyncio: real GlobalIndex in-process, and the real index
actor through IndexClient (down -> load-only fallback, counted)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest
from conftest import wait_dead

from kvshare.actors.index.global_index import GlobalIndex
from kvshare.events import BlockStored, events_to_arrow
from kvshare.hashing import block_hashes, namespace_root
from kvshare.match import MatchResult
from kvshare.router.core.embed import CacheAwareRouter, InProcessIndex, RouterConfig, Tenant
from kvshare.router.core.index import QueryIndex
from kvshare.router.core.policy import NoEligibleWorker
from kvshare.router.core.workers_view import IndexWorkers, StaticWorkers
from kvshare.types import BlockHash, NodeId, Tier, WorkerId, node_location
from kvshare.workers import IndexQuery, WorkerInfo, WorkerLoad

NS = "llm"
BT = 16
CFG = RouterConfig(namespace=NS, model_id="m", layout_fingerprint="fp", block_tokens=BT,
                   prefill_tokens_per_s=2_000, index_timeout_s=0.05)
PROMPT = "You are a helpful assistant. " * 20  # 580 bytes -> 36 full blocks


def workers(n: int = 3) -> StaticWorkers:
    return StaticWorkers([
        WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i}"), (NS,), f"http://w{i}") for i in range(n)
    ])


def stored(hashes: Sequence[BlockHash], node: str) -> list[BlockStored]:
    loc = node_location(node)
    return [BlockStored(NS, loc, Tier.HOST, h, 0, i + 1) for i, h in enumerate(hashes)]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_router_hashes_like_kvshare_hashing_per_tenant() -> None:
    r = CacheAwareRouter(None, workers(), CFG)
    ids = r.tokenize(PROMPT)
    assert ids == list(PROMPT.encode())
    expect = block_hashes(namespace_root("m", "fp", "s1"), ids, BT)
    assert r.hashes(ids, Tenant("a", "s1")) == expect
    assert r.hashes(ids, Tenant("b", "s2"))[0] != expect[0]
    with pytest.raises(ValueError, match="prompt"):
        r.tokenize(prompt="")
    with pytest.raises(ValueError, match="prompt"):
        r.tokenize(prompt=[1, -2])
    with pytest.raises(ValueError, match="messages"):
        r.tokenize(messages=[])


def test_routes_to_the_worker_holding_the_prefix_and_only_for_that_tenant() -> None:
    index = GlobalIndex()
    index.declare_namespace(NS)
    r = CacheAwareRouter(InProcessIndex(index), workers(), CFG)
    acme, globex = Tenant("acme", "salt-a"), Tenant("globex", "salt-g")
    ids = r.tokenize(PROMPT)
    index.apply(stored(r.hashes(ids, acme), "n2"))

    async def go() -> tuple[object, object]:
        a = await r.route(prompt=PROMPT, tenant=acme)
        g = await r.route(prompt=PROMPT, tenant=globex)
        return a, g

    a, g = run(go())
    assert a.decision.worker == "w2" and a.decision.reason == "cache_local"  # type: ignore[attr-defined]
    assert a.decision.cached_blocks == 36 and a.decision.est_ttft_saved_s > 0.2  # type: ignore[attr-defined]
    # globex's hashes differ: the index holds nothing of theirs; no blocks were cached
    assert g.decision.cached_blocks == 0 and g.hashes[0] != a.hashes[0]  # type: ignore[attr-defined]
    assert a.kvshare_field()["cache_salt"] == "salt-a"  # type: ignore[attr-defined]
    assert a.kvshare_field()["hashes_hex"][0] == a.hashes[0].hex()  # type: ignore[attr-defined]


def test_a_worker_marked_down_is_avoided_until_marked_up() -> None:
    index = GlobalIndex()
    index.declare_namespace(NS)
    r = CacheAwareRouter(InProcessIndex(index), workers(), CFG)
    tenant = Tenant("acme", "salt-a")
    index.apply(stored(r.hashes(r.tokenize(PROMPT), tenant), "n2"))

    def where() -> str:
        return str(run(r.route(prompt=PROMPT, tenant=tenant)).decision.worker)  # type: ignore[attr-defined]

    assert where() == "w2"
    r.mark_down(WorkerId("w2"), for_s=60)
    assert where() != "w2"
    r.mark_up(WorkerId("w2"))
    assert where() == "w2"
    r.mark_up(WorkerId("w1"))  # not marked down: nothing changes


def test_a_burst_sharing_a_new_prefix_is_not_scattered() -> None:
    index = GlobalIndex()
    index.declare_namespace(NS)
    r = CacheAwareRouter(InProcessIndex(index), workers(4), CFG)
    other = ["Tell me about cats. " * 30, "Tell me about dogs. " * 30, "Explain graphs. " * 30]

    async def burst() -> list[str]:
        out = []
        for i in range(6):  # the shared prefix is in no index yet: only pending knows it
            routed = await r.route(prompt=PROMPT + f" question {i}")
            out.append(routed.decision.worker)
            r.prefilled(routed.request_id)
        for p in other:  # unrelated prompts still spread over the other workers
            out.append((await r.route(prompt=p)).decision.worker)
        return out

    picks = run(burst())
    assert len(set(picks[:6])) == 1, picks
    assert len(set(picks[6:]) - {picks[0]}) >= 2, picks


def test_slow_index_falls_back_to_load_only_and_counts_it() -> None:
    class SlowIndex:  # a real coroutine that answers after the deadline
        unavailable = 0

        def match(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
            raise AssertionError("the router must not call the blocking match")

        async def match_async(self, namespace: str, hashes: Sequence[BlockHash]) -> MatchResult:
            await asyncio.sleep(1.0)
            return MatchResult(len(hashes), 0, {})

    assert isinstance(SlowIndex(), IndexQuery)
    w = workers()
    r = CacheAwareRouter(QueryIndex(SlowIndex()), w, CFG)  # (match_async only)
    w.report(WorkerLoad(WorkerId("w0"), 5000, 3, 2000.0, 0.0))
    routed = run(r.route(prompt=PROMPT))
    assert routed.fallback == "index_timeout"
    assert routed.decision.reason == "fallback_index_timeout" and routed.decision.worker != "w0"
    assert r.fallbacks == 1
    assert b'kvshare_router_fallbacks_total{cause="index_timeout"} 1.0' in r.metrics.render()


def test_observed_prefill_timings_refit_the_cost_model() -> None:
    r = CacheAwareRouter(None, workers(), RouterConfig(namespace=NS, refit_every=4))
    before = r.policy.cost.prefill.a
    for n in (100, 200, 400, 800):
        r.observe_prefill(n, 0, n * 1e-3)
    assert r.policy.cost.prefill.a == pytest.approx(1e-3) != before


# ------------------------------------------------------------------ real index actor
@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             namespace="kvshare-test-embed", object_store_memory=80 * 2**20)
    yield
    ray.shutdown()


@pytest.mark.cluster
def test_index_actor_down_means_load_only_routing(local_ray: None) -> None:
    import ray

    from kvshare.actors.config import IndexConfig
    from kvshare.actors.index.actor import GlobalIndexActor
    from kvshare.actors.index.client import IndexClient

    actor = GlobalIndexActor.remote(IndexConfig(worker_ttl_s=120.0))  # slow shared machine
    client = IndexClient([actor], timeout_s=30.0)  # a busy shared machine starts actors slowly
    client.declare_namespace(NS)
    # a generous deadline: this test is about a dead index, not a slow one (see above)
    r = CacheAwareRouter(client, workers(), replace(CFG, index_timeout_s=10.0))
    ids = r.tokenize(PROMPT)
    ray.get(actor.apply.remote(stored(r.hashes(ids, Tenant()), "n1")))

    first = run(r.route(prompt=PROMPT))
    assert (first.decision.worker, first.decision.reason, first.fallback) == ("w1", "cache_local", ""), first

    # workers registered in the index are discovered (kvshare gateway --address)
    info = WorkerInfo(WorkerId("reg0"), NodeId("n1"), (NS,), "http://reg0:8000")
    client.register_worker(info)
    client.report_load(WorkerLoad(info.worker_id, 0, 0, 1000.0, time.time()))
    found = CacheAwareRouter(client, IndexWorkers(client), replace(CFG, index_timeout_s=10.0))
    got = run(found.route(prompt=PROMPT))
    assert (got.decision.worker, got.decision.endpoint) == ("reg0", "http://reg0:8000"), got
    assert got.decision.reason == "cache_local", got  # reg0 is on n1, which holds the prefix
    ray.kill(actor, no_restart=True)
    wait_dead(actor)
    after = run(r.route(prompt=PROMPT + " again"))
    assert after.fallback in ("index_unavailable", "index_error", "index_timeout"), after
    assert after.decision.reason.startswith("fallback_") and r.fallbacks == 1, (after, r.fallbacks)
    # the answer itself says the index did not answer (no counter to compare before/after)
    hashes = r.hashes(ids, Tenant())
    dead = client.match(NS, hashes)
    assert (dead.available, dead.unavailable, dead.combined_prefix) == (False, "index_down", 0)
    runs = run(client.match_runs_async(NS, hashes))
    assert (runs.available, runs.unavailable, runs.runs) == (False, "index_down", [])


@pytest.mark.cluster
@pytest.mark.parametrize("shards", [1, 2])
def test_the_index_client_matches_in_run_form_blocking_or_awaited(local_ray: None,
                                                                  shards: int) -> None:
    """``IndexClient.match_runs`` (the core's RouterIndex, blocking) answers as
    ``match_runs_async`` and ``match`` do, over one shard or several."""
    import ray

    from kvshare.actors.config import IndexConfig
    from kvshare.actors.index.actor import GlobalIndexActor
    from kvshare.actors.index.client import IndexClient
    from kvshare.actors.index.runs import from_runs

    actors = [GlobalIndexActor.remote(IndexConfig(worker_ttl_s=120.0)) for _ in range(shards)]
    client = IndexClient(actors, timeout_s=30.0)
    client.declare_namespace(NS)
    r = CacheAwareRouter(None, workers(), CFG)
    hashes = r.hashes(r.tokenize(PROMPT), Tenant())
    client.publish(events_to_arrow(stored(hashes[:3], "n1")))
    probe = list(hashes[:5])
    try:
        runs = client.match_runs(NS, probe)
        assert runs == run(client.match_runs_async(NS, probe))
        assert from_runs(*runs) == client.match(NS, probe)
        assert (runs.num_blocks, runs.combined_prefix, runs.unavailable) == (5, 3, "")
        assert not client.inline
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def test_a_decision_carries_the_worker_as_routed_when_the_list_changes_after() -> None:
    """The gateway forwards in the chosen worker's engine form (a vLLM server gets vLLM's
    fields and its served model name): that comes from the registration the router decided
    with, so a worker that a later listing lacks (its lease lapsed for a moment) still gets
    the right body."""
    from kvshare.router.gateway.forward import forward_body

    vllm = WorkerInfo(WorkerId("v0"), NodeId("n0"), (NS,), "http://v0", 1, "fp",
                      {"engine": "vllm", "model": "/models/tiny"})
    source = StaticWorkers([vllm])
    r = CacheAwareRouter(None, source, CFG)
    routed = run(r.route(prompt=PROMPT))
    source.workers = []  # listed no more
    assert routed.decision.worker == "v0" and routed.info == vllm
    body = forward_body({"model": NS, "prompt": PROMPT}, routed, routed.info, chat=False)
    assert body["model"] == "/models/tiny" and body["prompt"] == r.tokenize(PROMPT)
    assert "kvshare" not in body


def test_an_index_that_lists_no_workers_is_believed_only_after_the_grace_from_its_first_empty_answer() -> None:
    """A gateway with sparse traffic refreshes its worker list only when it routes: the
    workers' leases lapsing on a starved host (they register again moments later) must not
    make the first request after a quiet spell a 503, however long ago the last listing was."""
    index = GlobalIndex(worker_ttl_s=3600)
    index.declare_namespace(NS)
    info = WorkerInfo(WorkerId("w0"), NodeId("n0"), (NS,), "http://w0")
    index.register_worker(info)
    view = IndexWorkers(InProcessIndex(index), refresh_s=0.0, empty_grace_s=0.3)
    r = CacheAwareRouter(None, view, CFG)
    assert run(r.route(prompt=PROMPT)).decision.worker == "w0"
    time.sleep(0.5)  # no traffic for longer than the grace
    index.unregister_worker("w0")  # the lease lapsed
    assert run(r.route(prompt=PROMPT)).decision.worker == "w0"  # not believed yet
    index.register_worker(info)  # registered again within the grace: as if nothing happened
    assert run(view.snapshot())[0] == [info]
    index.unregister_worker("w0")  # gone for good this time
    run(view.snapshot())
    time.sleep(0.35)
    assert run(view.snapshot())[0] == []
    with pytest.raises(NoEligibleWorker, match="no worker serves namespace"):
        run(r.route(prompt=PROMPT))


def test_callers_arriving_during_a_refresh_share_it() -> None:
    """Every request waiting on a worker checks the list (upstream.unless_lapsed): a stale
    list is fetched once for all of them, not once each."""
    info = WorkerInfo(WorkerId("w0"), NodeId("n0"), (NS,), "http://w0")
    calls: list[int] = []

    class SlowIndex:
        async def workers_async(self) -> list[WorkerInfo]:
            calls.append(1)
            await asyncio.sleep(0.05)
            return [info]

        async def loads_async(self) -> dict[WorkerId, Any]:
            return {}

    view = IndexWorkers(SlowIndex(), refresh_s=0.0)

    async def many() -> list[Any]:
        return await asyncio.gather(*(view.snapshot() for _ in range(50)))

    assert all(got[0] == [info] for got in asyncio.run(many())) and len(calls) == 1
    asyncio.run(view.snapshot())  # a new loop (the old one's refresh is done): fetched again
    assert len(calls) == 2
