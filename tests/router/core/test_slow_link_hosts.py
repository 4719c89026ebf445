"""Per-link pricing on real links: three emulated hosts (A, B, C), host A's link shaped slow,
C's not (root only).

One stack for the module: a Ray node per host, kvshare deployed, a reference worker (tiny
Llama, one layer) on each host. Host B's pool probes A and C over the wire; the figures it
keeps per peer price each pull: B's worker recomputes a prefix only A holds and loads one only
C holds, and the router sends a prompt held only on A to A's worker, not to B to pull it
across (the same router pricing every pull at the node figure would have B pull it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvshare.testing.hosts import EmulatedHosts, requires_root

pytestmark = [pytest.mark.hosts, requires_root(), pytest.mark.timeout(900)]  # (a loaded machine)

NS = "links"
SLOW = "50mbit"  # 6.25 MB/s: far below what recomputing the tiny model's KV costs


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray

    from kvshare.actors.deploy import deploy, shutdown
    from kvshare.engines.hf import EngineConfig, model_keys

    cfg = EngineConfig(overrides={"num_hidden_layers": 1})
    keys = model_keys(cfg)
    t0 = time.monotonic()
    with EmulatedHosts(3, ray=True, base_dir=tmp_path_factory.mktemp("links"),
                       start_timeout_s=600) as hs:  # (a loaded machine starts Ray slowly)
        hs.connect_ray("kvs-test-links")
        try:
            deploy(namespace=NS, layout=keys.layout, host_gb=64 * keys.layout.bytes_per_block / 2**30)
            worker = ray.remote(num_cpus=0)(_refreshing_worker())
            on = {h.name: worker.options(resources={h.name: 0.01}).remote(
                NS, cfg, worker_id=h.name) for h in hs.hosts}  # (serving: registered)
            infos = dict(zip(on, ray.get([w.ready.remote() for w in on.values()], timeout=300),
                             strict=True))
            print(f"3 hosts, kvshare and 3 workers up in {time.monotonic() - t0:.1f} s")
            yield {"hosts": hs, "workers": on, "nodes": {h: i["node"] for h, i in infos.items()},
                   "cfg": cfg, "keys": keys}
            ray.get([w.stop.remote() for w in on.values()], timeout=60)
        finally:
            shutdown()
            ray.shutdown()


def _refreshing_worker() -> type:
    """A reference worker that re-reads its node pool's figures when asked (after a probe);
    defined in a function, so Ray pickles it by value (the hosts need not import tests)."""
    from kvshare.engines.service import WorkerService

    class RefreshingWorker(WorkerService):
        def refresh(self) -> dict[str, float]:
            assert self.client is not None
            self.client.choose_remote()
            return dict(self.client.choice.peer_bandwidths)

    return RefreshingWorker


def _pool(node: str) -> Any:
    import ray

    from kvshare.discovery import RAY_NAMESPACE, pool_name

    return ray.get_actor(pool_name(node), namespace=RAY_NAMESPACE)


def _prompt(seed: int, blocks: int, block_tokens: int) -> list[int]:
    return [(seed * 7919 + 13 * i) % 500 + 3 for i in range(blocks * block_tokens + 5)]


@pytest.fixture(scope="module")
def shaped(stack: dict[str, Any]) -> Iterator[dict[str, float]]:
    """A's link shaped to SLOW, C's not; B's pool re-probes A and C, C's re-probes A (its
    link from A is slow too), B's worker re-reads its figures."""
    import ray

    from kvshare.transfer.probe import PROBE_NAMESPACE

    hs, nodes = stack["hosts"], stack["nodes"]
    a, b, c = (h.name for h in hs.hosts)
    hs.shape(hs[0], SLOW)
    try:
        t0 = time.monotonic()
        blocks = 2  # reads of 2 and 4 MiB: enough for the fit, short on the slow link
        ray.get([_pool(nodes[b]).transfer_measure.remote(
            PROBE_NAMESPACE, {nodes[a]: _pool(nodes[a]), nodes[c]: _pool(nodes[c])}, blocks),
            _pool(nodes[c]).transfer_measure.remote(
            PROBE_NAMESPACE, {nodes[a]: _pool(nodes[a])}, blocks)], timeout=300)
        print(f"B probed A (shaped) and C, C probed A, in {time.monotonic() - t0:.1f} s")
        yield ray.get(stack["workers"][b].refresh.remote(), timeout=60)
    finally:
        hs.shape(hs[0], None)


def test_the_slow_peer_is_priced_slow_and_the_other_fast(
        stack: dict[str, Any], shaped: dict[str, float]) -> None:
    import ray

    from kvshare.actors.deploy import measured_links, status
    from kvshare.router.web.view import cluster_view

    hs, nodes, on, keys = stack["hosts"], stack["nodes"], stack["workers"], stack["keys"]
    a, b, c = (h.name for h in hs.hosts)
    links = measured_links()
    slow, fast = links.get(nodes[a], nodes[b]), links.get(nodes[c], nodes[b])
    print(f"B's links: from A {slow} B/s (shaped {SLOW}), from C {fast} B/s; worker B prices "
          f"{shaped}")
    assert slow is not None and fast is not None
    assert slow < 50e6 / 8 * 1.3 and fast > 4 * slow  # the tbf rate, give or take the burst
    assert shaped[nodes[a]] < 50e6 / 8 * 1.3 and shaped[nodes[c]] > 4 * shaped[nodes[a]]
    # the live page: each node's address, and B's figures per peer
    view = {n["node_id"]: n for n in cluster_view(status())["nodes"]}
    assert view[nodes[b]]["address"] == hs[1].ip
    peers = {p["peer"] for p in view[nodes[b]]["peers"]}
    assert {nodes[a], nodes[c]} <= peers
    # B's cut: a prefix only A holds is recomputed, one only C holds is loaded
    bt = keys.layout.block_tokens
    only_a, only_c = _prompt(1, 8, bt), _prompt(2, 8, bt)
    ray.get([on[a].generate.remote(only_a, 1), on[c].generate.remote(only_c, 1)], timeout=120)
    time.sleep(0.3)  # the index hears of the blocks (bounded delay)
    got_a = ray.get(on[b].generate.remote(only_a, 1), timeout=120)
    got_c = ray.get(on[b].generate.remote(only_c, 1), timeout=120)
    print(f"B: prefix on A reused {got_a['reused_tokens']} ({got_a['plan']}), on C reused "
          f"{got_c['reused_tokens']} ({got_c['plan']})")
    assert got_a["plan"]["available"] == 8 and got_a["reused_tokens"] == 0
    assert got_c["reused_tokens"] == 8 * bt and not got_c["bytes_by_transport"].get("shm")


def test_the_router_keeps_a_prompt_held_on_a_slow_host_there(
        stack: dict[str, Any], shaped: dict[str, float]) -> None:
    import ray

    from kvshare.actors.deploy import measured_bandwidths, measured_links
    from kvshare.actors.index.client import IndexClient
    from kvshare.cost import Bandwidths
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import IndexWorkers

    hs, on, keys = stack["hosts"], stack["workers"], stack["keys"]
    a, b, c = (h.name for h in hs.hosts)
    prompt = _prompt(3, 8, keys.layout.block_tokens)
    ray.get(on[a].generate.remote(prompt, 1), timeout=120)  # held only on A
    time.sleep(0.3)
    index = IndexClient.connect()
    node_figures = measured_bandwidths()  # per transport the median over nodes

    def route(links: bool) -> Any:
        base = Bandwidths(links=measured_links()) if links else Bandwidths()
        cfg = RouterConfig.from_model_keys(
            keys, namespace=NS, bandwidths=Bandwidths.from_measured(node_figures, base))
        router = CacheAwareRouter(index, IndexWorkers(index), cfg, keys.tokenizer)
        routed = asyncio.run(router.route(token_ids=prompt))
        assert routed.ranking is not None
        return routed, {str(e.worker): e for e in routed.ranking.estimates()}

    routed, est = route(links=True)
    print(f"with links: {routed.decision.worker} ({routed.decision.reason}); B's plan "
          f"{est[b].plan}")
    assert (routed.decision.worker, routed.decision.remote_blocks) == (a, 0)
    assert est[b].plan.remote_blocks == 0  # B would recompute, not pull over the slow link
    assert est[c].plan.remote_blocks == 0  # C's own link is fast, but A -> C is slow too
    _, flat = route(links=False)  # one figure for every pull (the best over peers)
    print(f"without links B's plan {flat[b].plan}")
    assert flat[b].plan.remote_blocks == 8  # priced as fast, B would pull it across
    served = ray.get(on[routed.decision.worker].generate.remote(prompt, 1), timeout=120)
    assert served["reused_tokens"] == 8 * keys.layout.block_tokens
    assert set(served["bytes_by_transport"]) == {"shm"}  # from A's own pool, not across
