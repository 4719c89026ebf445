"""A router-side replica of the index, fed by the shards' change streams: it ends up equal to
the index (unit, no Ray) and follows real index actors on a real cluster within a few rounds,
through stores, removals, drops, a worker's expiry and a shard restart."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest

from kvshare.actors.index.feed import IndexFeed
from kvshare.actors.index.global_index import GlobalIndex
from kvshare.actors.index.holders import HolderStates
from kvshare.actors.index.replica import _apply
from kvshare.actors.index.table import BlockTable
from kvshare.events import BlockRemoved, BlockStored, events_to_arrow
from kvshare.types import BlockHash, Location, Tier

A, B = Location("node:ra"), Location("node:rb")


def hs(tag: str, n: int) -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(f"{tag}{i}".encode()).digest()) for i in range(n)]


class Copy:
    """What IndexReplica keeps, fed by hand from one GlobalIndex's feed."""

    def __init__(self, index: GlobalIndex) -> None:
        self.index = index
        self.states, self.tables = HolderStates(), {}  # type: ignore[var-annotated]
        reply = index.feed_snapshot()
        _apply(self.states, self.tables, reply.deltas or [], reply.namespaces)
        self.cursor = reply.cursor

    def follow(self) -> None:
        reply = self.index.feed_since(self.cursor)
        assert reply.deltas is not None
        _apply(self.states, self.tables, reply.deltas, reply.namespaces)
        self.cursor = reply.cursor

    def lookup(self, ns: str, hashes: list[BlockHash]) -> list[dict[Location, Tier]]:
        t: BlockTable | None = self.tables.get(ns)
        return t.lookup(hashes) if t is not None else [{} for _ in hashes]


def test_the_feed_rebuilds_the_index_through_stores_removals_and_drops() -> None:
    index = GlobalIndex(worker_ttl_s=3600)
    index.declare_namespace("m")
    before = hs("pre", 8)
    gen_a = index.new_generation(A)
    index.apply_arrow(events_to_arrow([BlockStored("m", A, Tier.HOST, h, gen_a, i + 1)
                                       for i, h in enumerate(before)]))
    copy = Copy(index)  # joins late: starts from a snapshot
    assert copy.lookup("m", before) == index.lookup("m", before)
    gen_b = index.new_generation(B)
    shared, tail = hs("doc", 20), hs("tail", 5)
    index.apply_arrow(events_to_arrow([BlockStored("m", B, Tier.DISK, h, gen_b, i + 1)
                                       for i, h in enumerate(shared + tail)]))
    index.apply_arrow(events_to_arrow([BlockStored("m", A, Tier.HOST, h, gen_a, 9 + i)
                                       for i, h in enumerate(shared)]))
    index.apply_arrow(events_to_arrow([BlockRemoved("m", B, Tier.DISK, tail[0], gen_b, 26)]))
    index.declare_namespace("other", 16)
    copy.follow()
    everything = before + shared + tail
    assert copy.lookup("m", everything) == index.lookup("m", everything)
    assert copy.tables["other"].hash_size == 16
    index.new_generation(A)  # A's pool restarted: its entries go
    copy.follow()
    assert copy.lookup("m", everything) == index.lookup("m", everything)
    assert all(A not in holders for holders in copy.lookup("m", everything))
    index.drop_location(B)
    copy.follow()
    assert copy.lookup("m", everything) == [{}] * len(everything)


def test_a_reader_behind_the_kept_deltas_is_told_to_start_over() -> None:
    feed = IndexFeed(max_deltas=2)
    feed.pending.extend([("S", "m", "node:a", 1, b"x" * 32)] * 3)
    assert feed.since(0) == (3, None) and len(feed.since(1)[1] or []) == 2
    assert feed.since(3) == (3, [])
    with pytest.raises(ValueError, match=">= 1"):
        IndexFeed(0)


def _until_equal(replica: Any, client: Any, queries: list[list[BlockHash]], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if replica.ready and all(replica.match("m", q) == client.match("m", q) for q in queries):
            return
        time.sleep(0.02)
    raise AssertionError(f"replica did not follow the index after {what}: {replica.stats()}")


@pytest.mark.cluster
def test_replica_follows_sharded_index_actors_on_a_cluster(ray_cluster: Any) -> None:
    import ray

    from kvshare.actors.config import IndexConfig
    from kvshare.actors.index.actor import GlobalIndexActor
    from kvshare.actors.index.client import IndexClient
    from kvshare.actors.index.replica import IndexReplica

    cfgs = [IndexConfig(i, 2, namespaces=(("m", 32, ""),)) for i in range(2)]  # as deployed
    shards = [GlobalIndexActor.options(namespace="kvs-test-replica").remote(cfgs[i])
              for i in range(2)]
    client = IndexClient(shards, timeout_s=30)
    client.declare_namespace("m")
    replica = IndexReplica.follow(client, poll_s=0.01)
    try:
        doc, tail_a, tail_b = hs("cdoc", 64), hs("ctail-a", 16), hs("ctail-b", 16)
        queries = [doc + tail_a, doc + tail_b, tail_b]
        gens = {loc: client.new_generation(loc) for loc in (A, B)}
        client.publish(events_to_arrow([BlockStored("m", A, Tier.HOST, h, gens[A], i + 1)
                                        for i, h in enumerate(doc + tail_a)]))
        client.publish(events_to_arrow([BlockStored("m", B, Tier.DISK, h, gens[B], i + 1)
                                        for i, h in enumerate(doc + tail_b)]))
        _until_equal(replica, client, queries, "stores")
        assert replica.match("m", doc + tail_a).locations[A].prefix_blocks == 80
        client.publish(events_to_arrow([BlockRemoved("m", B, Tier.DISK, tail_b[3], gens[B], 81)]))
        client.drop_location(A)
        _until_equal(replica, client, queries, "a removal and a drop")
        assert A not in replica.match("m", doc).locations
        ray.kill(shards[1], no_restart=False)  # restarts empty, with a new epoch: resync
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and replica.resyncs < 2:
            time.sleep(0.05)
        _until_equal(replica, client, queries, "a shard restart")
        assert replica.resyncs >= 2 and replica.unavailable == 0
    finally:
        replica.close()
        for s in shards:
            ray.kill(s)


@pytest.mark.cluster
def test_a_replica_stops_when_its_process_leaves_ray(ray_cluster: Any) -> None:
    """A router's replica thread that outlives its process's ``ray.shutdown`` must not connect
    the process to Ray again (``Cluster.shutdown`` then refused to remove the head, and a
    benchmark ended with a traceback after its results): it stops following instead."""
    import ray

    from kvshare.actors.config import IndexConfig
    from kvshare.actors.index.actor import GlobalIndexActor
    from kvshare.actors.index.client import IndexClient
    from kvshare.actors.index.replica import IndexReplica

    shard = GlobalIndexActor.options(namespace="kvs-test-replica").remote(
        IndexConfig(0, 1, namespaces=(("m", 32, ""),)))
    replica = IndexReplica.follow(IndexClient([shard], timeout_s=30), poll_s=0.01)
    try:
        deadline = time.monotonic() + 60
        while not replica.ready and time.monotonic() < deadline:
            time.sleep(0.02)
        assert replica.ready
        thread = replica._thread
        assert thread is not None
        ray.shutdown()
        thread.join(timeout=10)
        assert not thread.is_alive(), replica.stats()
        assert not ray.is_initialized()
    finally:
        replica.close()
        if ray.is_initialized():
            ray.kill(shard)
        else:  # (the shard went with the driver's job) the module's later tests need Ray
            ray.init(address=ray_cluster.address, namespace="kvshare-test", log_to_driver=False)
