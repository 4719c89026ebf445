"""KVShareClient without Ray: two in-process node pools, the real GlobalIndex, real transports.

Node "A" is the worker's own node (shared memory); node "B" is another node (NIXL or the
object store; in one process both are real). Scenarios: store through shm, plan + load from
each place, paged destinations, a corrupt remote block, an index that is gone.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvshare.actors.index.global_index import GlobalIndex
from kvshare.client.sdk import KVShareClient
from kvshare.client.types import PagedKV
from kvshare.hashing import namespace_root
from kvshare.kv_convert import block_view, new_contiguous
from kvshare.layout import KVLayout
from kvshare.transfer.holder.local import make_local_source
from kvshare.transfer.holder.server import BlockServer
from kvshare.transfer.reader.control import LocalControl

LAYOUT = KVLayout(2, 2, 16, "fp32", block_tokens=8)
ROOT = namespace_root("client-test-model", LAYOUT.fingerprint())


class Cluster:
    """Two node pools, their controls and an index fed from their events."""

    def __init__(self, namespace: str, nixl: bool) -> None:
        self.ns = namespace
        self.sources: dict[str, BlockServer] = {
            n: make_local_source(namespace, n, LAYOUT, 32, nixl=nixl) for n in ("A", "B")
        }
        self.index = GlobalIndex()
        self.controls = {n: LocalControl(s) for n, s in self.sources.items()}

    def publish(self) -> None:
        for s in self.sources.values():
            self.index.apply(s.pool.take_events())

    def client(self, node: str = "A", remote: str = "objstore") -> KVShareClient:
        return KVShareClient(namespace=self.ns, layout=LAYOUT, root=ROOT, node=node,
                             index=self.index, control_for=self.controls.get,
                             worker_id=f"w{node}", remote=remote)

    def close(self) -> None:
        for s in self.sources.values():
            s.close()
            s.pool.close()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster(f"ct-{uuid.uuid4().hex[:8]}", nixl=True)
    yield c
    c.close()


def kv_for(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 2, tokens, 16, generator=g)


def test_store_on_one_node_load_on_the_other(cluster: Cluster) -> None:
    toks = list(range(5 * 8 + 3))
    kv = kv_for(len(toks), 0)
    writer = cluster.client("B")
    assert writer.store(toks, kv).result(timeout=10).stored == 5
    cluster.publish()
    for remote in ("objstore", "nixl"):
        reader = cluster.client("A", remote=remote)
        plan = reader.lookup(toks)
        assert plan.available_blocks == 5 and plan.by_transport() == {remote: 5}
        into = new_contiguous(LAYOUT, plan.load_tokens)
        res = reader.load(plan, into)
        assert res.loaded_blocks == 5 and not res.failed
        assert torch.equal(into, kv[:, :, :, :40])
        assert reader.counters[f"bytes_{remote}"] == 5 * LAYOUT.bytes_per_block
        assert reader.counters[f"transfers_{remote}"] == 1  # one batch from one holder
        assert 0 < reader.counters[f"transfer_seconds_{remote}"] < 10
        reader.close()
    writer.close()


def test_own_node_blocks_come_through_shared_memory_into_pages(cluster: Cluster) -> None:
    toks = list(range(100, 100 + 4 * 8))
    kv = kv_for(len(toks), 1)
    client = cluster.client("A")
    client.save_layer(0, kv[0, 0].unsqueeze(0), kv[0, 1].unsqueeze(0), toks)
    client.save_layer(1, kv[1, 0].unsqueeze(0), kv[1, 1].unsqueeze(0), toks)
    assert [r.stored for r in client.wait_for_save(10)] == [4]
    cluster.publish()
    plan = client.lookup(toks + [7])
    assert plan.by_transport() == {"shm": 4}
    pages = [torch.zeros(2, 16, 4, 2, 16) for _ in range(2)]  # 4-token pages
    table = list(range(15, 7, -1))
    res = client.load(plan, PagedKV(pages, table))
    assert res.loaded_blocks == 4
    assert torch.equal(pages[1][1, table[3]].transpose(0, 1), kv[1, 1, :, 12:16])
    client.close()


def test_blocks_a_client_stored_on_its_node_load_back_with_no_pin(cluster: Cluster) -> None:
    """An engine reloading its own blocks (evicted from its own cache) from its node's pool:
    the store taught the client their slots, so the load copies them after checking their
    epochs, with no pool round trip; the pool still counts the hits."""
    toks = list(range(300, 300 + 4 * 8))
    kv = kv_for(len(toks), 3)
    client = cluster.client("A")
    assert client.store(toks, kv).result(timeout=10).stored == 4
    cluster.publish()
    hits = cluster.sources["A"].pool.stats()["tiers"]["host"]["hits"]
    plan = client.lookup(toks + [7])
    assert plan.by_transport() == {"shm": 4}
    into = new_contiguous(LAYOUT, plan.load_tokens)
    before = client.fetcher.shm.fast_reads
    res = client.load(plan, into)
    assert res.loaded_blocks == 4 and not res.failed
    assert torch.equal(into, kv)
    assert client.fetcher.shm.fast_reads == before + 1
    assert cluster.sources["A"].pool.stats()["tiers"]["host"]["hits"] == hits + 4
    client.close()


def test_corrupt_remote_block_is_a_miss_and_later_blocks_are_not_used(cluster: Cluster) -> None:
    toks = list(range(3 * 8))
    kv = kv_for(len(toks), 2)
    cluster.client("B").store(toks, kv).result(timeout=10)
    cluster.publish()
    pool = cluster.sources["B"].pool
    h1 = cluster.client("B").hashes(toks)[1]
    lease = pool.pin([h1], "t")[0]
    assert lease is not None
    slab = cluster.sources["B"].slab
    assert slab is not None
    slab.array[lease.slot][:64] ^= 0xFF  # bit rot in B's host slab
    pool.unpin([lease.lease_id])
    reader = cluster.client("A", remote="objstore")
    into = new_contiguous(LAYOUT, 24)
    res = reader.load(reader.lookup(toks), into)
    assert [o.ok for o in res.outcomes] == [True, False, True]
    assert res.failed[0].reason == "corrupt" and res.loaded_blocks == 1
    assert reader.counters["miss_corrupt"] == 1


def test_index_gone_or_holder_gone_means_an_empty_or_failed_plan(cluster: Cluster) -> None:
    toks = list(range(2 * 8))
    cluster.client("B").store(toks, kv_for(16, 3)).result(timeout=10)
    cluster.publish()
    lonely = KVShareClient(namespace=cluster.ns, layout=LAYOUT, root=ROOT, node="A", index=None,
                           control_for=cluster.controls.get, remote="objstore")
    assert lonely.lookup(toks).load_blocks == 0
    orphan = KVShareClient(namespace=cluster.ns, layout=LAYOUT, root=ROOT, node="A",
                           index=cluster.index, control_for=lambda n: None, remote="objstore")
    res = orphan.load(orphan.lookup(toks), new_contiguous(LAYOUT, 16))
    assert res.loaded_blocks == 0 and {o.reason for o in res.outcomes} == {"source_dead"}


def test_wrong_plan_or_target_is_rejected(cluster: Cluster) -> None:
    client = cluster.client("A")
    other = KVShareClient(namespace="other-ns", layout=LAYOUT, root=ROOT, node="A",
                          index=None, control_for=cluster.controls.get, remote="objstore")
    with pytest.raises(ValueError, match="namespace"):
        client.load(other.lookup(list(range(8))), new_contiguous(LAYOUT, 8))
    with pytest.raises(ValueError, match="remote transport"):
        KVShareClient(namespace="x", layout=LAYOUT, root=ROOT, node="A", index=None,
                      control_for=cluster.controls.get, remote="carrier-pigeon")
    assert block_view(np.zeros(LAYOUT.bytes_per_block, np.uint8), LAYOUT).shape == LAYOUT.block_shape
    assert os.path.exists(f"/dev/shm/kvshare-{cluster.ns}-A-0")


def test_async_variants_match_the_sync_ones(cluster: Cluster) -> None:
    import asyncio

    from kvshare.router.core.embed import InProcessIndex

    toks = list(range(50, 50 + 3 * 8))
    kv = kv_for(len(toks), 4)
    client = KVShareClient(namespace=cluster.ns, layout=LAYOUT, root=ROOT, node="A",
                           index=InProcessIndex(cluster.index), control_for=cluster.controls.get,
                           remote="objstore")

    async def scenario() -> tuple[int, int, bool]:
        stored = await client.store_async(toks, kv)
        cluster.publish()
        plan = await client.lookup_async(toks)
        into = new_contiguous(LAYOUT, plan.load_tokens)
        res = await client.load_async(plan, into)
        return stored.stored, res.loaded_blocks, torch.equal(into, kv)

    assert asyncio.run(scenario()) == (3, 3, True)
    client.close()


def test_bad_kv_is_rejected_before_anything_moves(cluster: Cluster) -> None:
    client = cluster.client("A")
    toks = list(range(16))
    with pytest.raises(ValueError, match="kv_heads"):
        client.store(toks, torch.zeros(2, 2, 3, 16, 16))  # 3 kv heads, the layout has 2
    with pytest.raises(ValueError, match="layers"):
        client.store(toks, [(torch.zeros(1, 2, 16, 16), torch.zeros(1, 2, 16, 16))])
    with pytest.raises(ValueError, match="float32"):
        client.store(toks, torch.zeros(2, 2, 2, 16, 16, dtype=torch.float16))
    assert cluster.sources["A"].pool.prefix_len(client.hashes(toks)) == 0
    client.store(toks, kv_for(16, 5)).result(timeout=10)
    cluster.publish()
    plan = client.lookup(toks)
    with pytest.raises(ValueError, match="tokens"):
        client.load(plan, new_contiguous(LAYOUT, 8))
    with pytest.raises(ValueError, match="page table"):
        client.load(plan, PagedKV([torch.zeros(2, 4, 4, 2, 16)] * 2, [0, 1]))
    client.close()


def test_the_cut_sees_each_blocks_holder_and_load_all_overrides_it(cluster: Cluster) -> None:
    """A reader on A plans B's blocks: its cut policy is told they come from node B; with
    B -> A priced slow it loads none, ``load_all`` loads them anyway, a fast link loads all."""
    from kvshare.cost_cut import CostCut

    toks = list(range(5 * 8 + 3))
    assert cluster.client("B").store(toks, kv_for(len(toks), 3)).result(timeout=10).stored == 5
    cluster.publish()
    seen: list[list[str]] = []
    cut = CostCut(LAYOUT, [(1000, 0, 1.0), (2000, 0, 2.0)])  # 1 ms/token: 8 ms a block

    def recording(n: int, sources: object, holders: list[str]) -> int:
        seen.append(list(holders))
        return cut(n, sources, holders)  # type: ignore[arg-type]

    reader = KVShareClient(namespace=cluster.ns, layout=LAYOUT, root=ROOT, node="A",
                           index=cluster.index, control_for=cluster.controls.get,
                           worker_id="wcut", remote="objstore", cut_policy=recording)
    cut.set_bandwidths({"objstore": 1e12})
    cut.set_peer_bandwidths("A", {"B": 1e3})  # 4 s a 4 KiB block from B: recompute
    assert reader.lookup(toks).load_blocks == 0 and seen[-1] == ["B"] * 5
    assert reader.lookup(toks, load_all=True).load_blocks == 5
    cut.set_peer_bandwidths("A", {"B": 1e12})
    assert reader.lookup(toks).load_blocks == 5
    # a link where each block arrives sooner than it computes (5 ms vs 8 ms), but not all
    # five within a 20 ms load deadline: the client gives its cut the deadline, and the plan
    # takes the leading blocks that arrive in time
    timed = CostCut(LAYOUT, [(1000, 0, 1.0), (2000, 0, 2.0)])
    hurried = KVShareClient(namespace=cluster.ns, layout=LAYOUT, root=ROOT, node="A",
                            index=cluster.index, control_for=cluster.controls.get,
                            worker_id="wdeadline", remote="objstore", cut_policy=timed,
                            load_deadline_s=0.02)
    assert timed.deadline_s == 0.02
    timed.set_peer_bandwidths("A", {"B": LAYOUT.bytes_per_block / 0.005})
    assert 0 < hurried.lookup(toks).load_blocks < 5
