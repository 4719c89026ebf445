"""kvshare on a real multi-node Ray cluster (head + 2 nodes): pools, index, liveness.

One module cluster; the scenarios run in file order (one near the end removes a node).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from sdk_helpers import load, prompt, report_speed, sdk_client, store

pytestmark = pytest.mark.cluster

RAY_NS = "kvs-test-cluster"


def hashes(n: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n)]


def wait_for(cond: Callable[[], bool], timeout: float, step: float = 0.02) -> float:
    """Seconds until ``cond()`` held; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def kv(ray_cluster: Any) -> Iterator[dict[str, Any]]:
    import ray

    from kvshare.actors.config import NamespaceSpec
    from kvshare.actors.deploy import deploy, get_index_client, shutdown
    from kvshare.layout import KVLayout

    layout = KVLayout(2, 2, 16, "fp32", 16)  # 8 KiB blocks
    bb = layout.bytes_per_block
    spec = NamespaceSpec("m", layout, host_bytes=16 * bb, disk_bytes=64 * bb)
    deploy(namespaces=[spec], disk_dir=f"{ray_cluster.head_node.get_temp_dir_path()}/disk",
           ray_namespace=RAY_NS, holder_check_s=0.3)
    nodes = {}
    for n in ray.nodes():
        for key in ("node_0", "node_1"):
            if n["Alive"] and key in n["Resources"]:
                nodes[key] = n["NodeID"]
    try:
        yield {"layout": layout, "client": get_index_client(RAY_NS), "a": nodes["node_0"],
               "b": nodes["node_1"], "cluster": ray_cluster}
    finally:
        shutdown(RAY_NS)


def pool(node: str) -> Any:
    from kvshare.actors.deploy import get_pool

    return get_pool(node, RAY_NS)


def loc(node: str) -> str:
    return f"node:{node}"


def blocks(n: int, layout: Any, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, layout.bytes_per_block), dtype=np.uint8)


def write(actor: Any, ns: str, hs: list[bytes], data: np.ndarray) -> list[str]:
    """Store ``data`` through the pool's data plane (the object-store path); "" = stored."""
    import ray

    from kvshare.tiers.base import block_checksum

    sums = [block_checksum(d) for d in data]
    return list(ray.get(actor.transfer_write_blocks.remote(ns, hs, data, sums)))


def test_blocks_on_two_nodes_show_up_within_1s(kv: dict[str, Any]) -> None:
    import ray

    from kvshare.tiers.base import block_checksum
    from kvshare.tiers.host import HostSlab
    from kvshare.transfer.base import MISSING
    from kvshare.types import Tier

    client, layout = kv["client"], kv["layout"]
    hs = hashes(10, "two-nodes")
    data = blocks(10, layout, 1)
    # node A: object-store path, the first 8 blocks
    assert write(pool(kv["a"]), "m", hs[:8], data[:8]) == [""] * 8  # stored
    t_a = wait_for(lambda: client.match("m", hs).prefix_for(loc(kv["a"])) == 8, 1.0)
    # node B: shared-memory path (reserve, write into the slab, commit), the first 5 blocks
    pb = pool(kv["b"])
    info = ray.get(pb.slab_info.remote("m", layout.fingerprint()))
    slab = HostSlab.attach(info.name, info.slot_bytes, info.num_slots)
    res = ray.get(pb.transfer_prepare_write.remote("m", hs[:5], "pid:1", 30.0)).blocks
    for r, row in zip(res, data[:5], strict=True):
        slab.view(r.slot)[:] = row
    ray.get(pb.transfer_commit_write.remote("m", "pid:1", [r.lease_id for r in res],
                                            [block_checksum(d) for d in data[:5]]))
    t_b = wait_for(lambda: client.match("m", hs).prefix_for(loc(kv["b"])) == 5, 1.0)
    m = client.match("m", hs)
    assert m.combined_prefix == 8 and m.num_blocks == 10
    assert m.locations[loc(kv["a"])].tier_counts == {Tier.HOST: 8}
    assert m.locations[loc(kv["b"])].tier_counts == {Tier.HOST: 5}
    assert max(t_a, t_b) < 1.0
    # reads: shm (pin, read the slot, unpin) and object store; a holder name is one transfer's
    leases = ray.get(pb.transfer_prepare_read.remote("m", hs[:5], "pid:1#read", 30.0)).blocks
    assert all(np.array_equal(slab.view(le.slot), d) for le, d in zip(leases, data[:5], strict=True))
    ray.get(pb.transfer_finish.remote("m", "pid:1#read", [le.lease_id for le in leases]))
    got = ray.get(pool(kv["a"]).transfer_read_blocks.remote("m", hs[:9]))
    assert got.reasons == ("",) * 8 + (MISSING,) and np.array_equal(got.data[:8], data[:8])
    slab.close()


def test_demoted_blocks_are_advertised_in_the_disk_tier(kv: dict[str, Any]) -> None:

    from kvshare.types import Tier

    client, layout = kv["client"], kv["layout"]
    hs = hashes(24, "demote")  # the host tier has 16 slots, 8 already used
    assert set(write(pool(kv["b"]), "m", hs, blocks(24, layout, 2))) == {""}  # all stored
    wait_for(lambda: client.match("m", hs).prefix_for(loc(kv["b"])) == 24, 1.0)
    counts = client.match("m", hs).locations[loc(kv["b"])].tier_counts
    assert counts[Tier.DISK] > 0 and counts[Tier.HOST] > 0 and sum(counts.values()) == 24


def test_status_sizes_each_tier_from_the_pools_traffic(kv: dict[str, Any]) -> None:
    from kvshare.actors.cli import sizing_lines
    from kvshare.actors.deploy import status

    bb = kv["layout"].bytes_per_block
    st = status(RAY_NS)
    node_b = next(n for n in st["nodes"] if n["node_id"] == kv["b"])
    est = node_b["pool"]["namespaces"]["m"]["sizing"]
    # node B stored 5 blocks, read them back, then stored 24 more: 34 uses, 5 of them repeats
    assert est["blocks"] >= 34 and set(est["tiers"]) == {"host", "disk"}
    host = est["tiers"]["host"]
    assert [c for c, _ in host] == [8 * bb, 16 * bb, 32 * bb, 64 * bb]  # 0.5x..4x of 16 slots
    assert 0 < host[0][1] <= host[-1][1] < 1
    assert any(line.startswith(f"sizing {kv['b'][:12]} m: host ") for line in sizing_lines(st))


def test_bad_input_at_the_actor_boundary_changes_nothing(kv: dict[str, Any]) -> None:
    import ray

    from kvshare.actors.config import index_name

    client, layout = kv["client"], kv["layout"]
    hs = hashes(3, "bad")
    pa_ = pool(kv["a"])
    index = ray.get_actor(index_name(0), namespace=RAY_NS)
    before = (ray.get(pa_.stats.remote())["namespaces"]["m"]["tiers"], client.stats()[0]["locations"])
    with pytest.raises(ValueError, match="KV layout"):
        write(pa_, "m", hs, np.zeros((3, 100), np.uint8))
    with pytest.raises(ValueError, match="fix the worker's KV layout"):
        ray.get(pa_.slab_info.remote("m", "0123456789abcdef"))
    with pytest.raises(KeyError, match="unknown namespace 'nope'"):
        ray.get(pa_.transfer_read_blocks.remote("nope", hs))
    with pytest.raises(ValueError, match="32-byte"):
        ray.get(pa_.transfer_prepare_write.remote("m", [b"x" * 5], "pid:1", 30.0))
    with pytest.raises(KeyError, match="known: \\['m'\\]"):
        ray.get(index.match.remote("nope", hs))
    with pytest.raises(ValueError, match="32-byte"):
        ray.get(index.match.remote("m", [b"short"]))
    with pytest.raises(ValueError, match="list of block hashes"):
        client.match("m", hs[0])
    from kvshare.actors.config import NamespaceSpec
    from kvshare.layout import KVLayout

    other = NamespaceSpec("m", KVLayout(2, 2, 16, "fp16", 16), host_bytes=1 << 20)
    with pytest.raises(ValueError, match="another layout needs another namespace"):
        ray.get(pa_.add_namespace.remote(other))
    after = (ray.get(pa_.stats.remote())["namespaces"]["m"]["tiers"], client.stats()[0]["locations"])
    assert after == before
    assert layout.bytes_per_block == 8192


def test_leases_of_a_dead_holder_are_released(kv: dict[str, Any]) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvshare.transfer.wire import SourceBlock

    @ray.remote(num_cpus=0)
    class Reader:
        def hold(self, pool: Any, hs: list[bytes]) -> int:
            me = ray.get_runtime_context().get_actor_id()
            got = ray.get(pool.transfer_prepare_read.remote("m", hs, me, 60.0))
            return sum(isinstance(b, SourceBlock) for b in got.blocks)

    pa_ = pool(kv["a"])
    reader = Reader.options(scheduling_strategy=NodeAffinitySchedulingStrategy(kv["a"], soft=False)).remote()
    assert ray.get(reader.hold.remote(pa_, hashes(4, "two-nodes"))) == 4
    assert ray.get(pa_.stats.remote())["namespaces"]["m"]["active_leases"] == 4
    ray.kill(reader)
    wait_for(lambda: ray.get(pa_.stats.remote())["namespaces"]["m"]["active_leases"] == 0, 5.0, 0.1)


def test_workers_register_and_match_async(kv: dict[str, Any]) -> None:
    import asyncio

    from kvshare.events import BlockStored, events_to_arrow
    from kvshare.types import Tier
    from kvshare.workers import WorkerInfo, WorkerLoad

    client = kv["client"]
    gen = client.register_worker(WorkerInfo("w-b", kv["b"], ("m",), endpoint="http://w-b"))
    hs = hashes(4, "two-nodes")
    wloc = "worker:w-b"
    ack = client.publish(events_to_arrow(
        BlockStored("m", wloc, Tier.GPU, h, gen, i + 1) for i, h in enumerate(hs)))  # type: ignore[arg-type]
    assert ack.applied == 4 and not ack.resync
    assert client.report_load(WorkerLoad("w-b", queued_prefill_tokens=3))
    assert [w.worker_id for w in client.workers()] == ["w-b"]
    assert client.loads()["w-b"].queued_prefill_tokens == 3
    m = asyncio.run(client.match_async("m", hs))
    assert m.prefix_for(wloc) == 4 and m.locations[wloc].tier_counts == {Tier.GPU: 4}
    from kvshare.actors.index.runs import from_runs

    runs = asyncio.run(client.match_runs_async("m", hs))
    assert from_runs(runs.num_blocks, runs.runs) == m and runs.unavailable == ""  # the run form
    # several queries per actor call answer the same as one per call
    assert client.match_many("m", [hs, hs[:2], hs[1:]], batch=2) == client.match_many("m", [hs, hs[:2], hs[1:]])


def test_index_killed_answers_as_before_within_10s(kv: dict[str, Any]) -> None:
    import ray

    from kvshare.actors.config import index_name

    client = kv["client"]
    hs = hashes(10, "two-nodes")
    before = client.match("m", hs)
    nodes_before = {k: v.prefix_blocks for k, v in before.locations.items() if k.startswith("node:")}
    epoch = client.epoch()
    ray.kill(ray.get_actor(index_name(0), namespace=RAY_NS), no_restart=False)

    def answers_as_before() -> bool:  # from the restarted instance (ray.kill is asynchronous)
        try:
            restarted = client.epoch() != epoch
        except Exception:
            return False
        nodes = {k: v.prefix_blocks for k, v in client.match("m", hs).locations.items()
                 if k.startswith("node:")}
        return restarted and nodes == nodes_before

    assert wait_for(answers_as_before, 10.0, 0.1) < 10.0
    assert client.match("m", hs).combined_prefix == before.combined_prefix


def test_pool_restart_ignores_stale_events_and_readvertises_disk(kv: dict[str, Any]) -> None:
    import ray

    from kvshare.events import BlockStored, events_to_arrow
    from kvshare.types import Tier

    client = kv["client"]
    hs = hashes(24, "demote")
    pb = pool(kv["b"])
    old = ray.get(pb.ready.remote())["generation"]
    old_slab = ray.get(pb.slab_info.remote("m")).name
    before = client.match("m", hs).locations[loc(kv["b"])]
    on_disk = before.tier_counts[Tier.DISK]
    ray.kill(pb, no_restart=False)
    wait_for(lambda: _generation(kv["b"]) > old, 20.0, 0.2)
    # the restarted pool lost its shm slab but its disk blocks come back, with the new generation
    wait_for(lambda: client.match("m", hs).locations.get(loc(kv["b"])) is not None
             and sum(client.lookup("m", hs)[i].get(loc(kv["b"])) == Tier.DISK for i in range(24)) == on_disk, 5.0)
    assert Tier.HOST not in {t for h in client.lookup("m", hs) for k, t in h.items() if k == loc(kv["b"])}
    new_slab = ray.get(pool(kv["b"]).slab_info.remote("m")).name
    assert new_slab != old_slab and os.path.exists(f"/dev/shm/{new_slab}")
    assert not os.path.exists(f"/dev/shm/{old_slab}")  # the stale segment was removed
    stale = [BlockStored("m", loc(kv["b"]), Tier.HOST, h, old, 10_000 + i)  # type: ignore[arg-type]
             for i, h in enumerate(hashes(3, "stale"))]
    ack = client.publish(events_to_arrow(stale))
    assert ack.stale == 3 and ack.applied == 0
    assert client.match("m", hashes(3, "stale")).combined_prefix == 0


def _generation(node: str) -> int:
    import ray

    try:
        return int(ray.get(pool(node).ready.remote(), timeout=5)["generation"])
    except Exception:
        return -1


def test_node_removed_its_entries_go_within_5s_and_new_nodes_get_a_pool(kv: dict[str, Any]) -> None:
    import ray

    from kvshare.actors.config import index_name

    client, cluster = kv["client"], kv["cluster"]
    hs = hashes(24, "demote")
    b = loc(kv["b"])
    assert b in client.match("m", hs).locations
    # the index (restarted by the test above) runs on the head: removing a node cannot take it
    head = cluster.head_node.node_id
    assert ray.get(ray.get_actor(index_name(0), namespace=RAY_NS).ready.remote())["node"] == head
    victim = next(n for n in cluster.worker_nodes if n.node_id == kv["b"])
    cluster.remove_node(victim)
    assert wait_for(lambda: b not in client.match("m", hs).locations, 5.0) < 5.0
    assert "w-b" not in [w.worker_id for w in client.workers()]
    for _ in range(10):  # and it stays gone
        assert b not in client.match("m", hs).locations and b not in client.match("m", hashes(10, "two-nodes")).locations
        time.sleep(0.1)
    new = cluster.add_node(num_cpus=1, object_store_memory=300 * 2**20)
    wait_for(lambda: _generation(new.node_id) > 0, 60.0, 0.3)  # a new node: process start under load
    assert ray.get(pool(new.node_id).ready.remote())["namespaces"] == ["m"]


def test_sharded_index_client_agrees_with_one_index(kv: dict[str, Any]) -> None:
    import asyncio

    import ray

    from kvshare.actors.config import IndexConfig
    from kvshare.actors.index.actor import GlobalIndexActor
    from kvshare.actors.index.client import IndexClient
    from kvshare.actors.index.global_index import GlobalIndex
    from kvshare.events import BlockRemoved, BlockStored, events_to_arrow
    from kvshare.types import Tier

    shards = [GlobalIndexActor.options(namespace="kvs-test-shards").remote(IndexConfig(i, 3))
              for i in range(3)]
    client, local = IndexClient(shards), GlobalIndex()
    for ix in (client, local):
        ix.declare_namespace("m")
    hs = hashes(40, "shards")
    locs = ["node:x", "node:y"]
    gens = {loc: client.new_generation(loc) for loc in locs}
    for loc in locs:
        local.fence(loc, gens[loc])
    batches = [
        [BlockStored("m", "node:x", Tier.HOST, h, gens["node:x"], i + 1) for i, h in enumerate(hs[:30])],
        [BlockStored("m", "node:y", Tier.DISK, h, gens["node:y"], i + 1) for i, h in enumerate(hs[:12])],
        [BlockRemoved("m", "node:x", Tier.HOST, hs[20], gens["node:x"], 31)],
    ]
    for evs in batches:
        batch = events_to_arrow(evs)  # type: ignore[arg-type]
        assert client.publish(batch).resync == () and local.apply_arrow(batch).resync == ()
    assert client.match("m", hs) == local.match("m", hs)
    assert asyncio.run(client.match_async("m", hs)) == local.match("m", hs)
    from kvshare.actors.index.runs import from_runs

    runs = asyncio.run(client.match_runs_async("m", hs))
    assert from_runs(runs.num_blocks, runs.runs) == local.match("m", hs)
    assert client.match_many("m", [hs, hs[:5]], batch=2) == [local.match("m", hs), local.match("m", hs[:5])]
    assert client.match("m", hs).prefix_for("node:x") == 20  # type: ignore[arg-type]
    assert client.drop_location("node:y") == 12
    assert client.match("m", hs).prefix_for("node:y") == 0  # type: ignore[arg-type]
    for s in shards:
        ray.kill(s)


def test_the_disk_tier_is_flagged_only_where_nothing_is_read_back(kv: dict[str, Any]) -> None:
    """What each tier is worth (kvshare.pool.value), fed by the worker SDK's real stores and
    loads on this node's pool: two more namespaces (8 host, 64 disk blocks), one workload each.

    ``cold``: every prompt is new; blocks are demoted to disk as the host tier fills and
    nothing is read back after demotion, so the disk tier only costs (its writes) and is
    flagged. ``warm``: four prompts of four blocks (twice the host tier) are loaded again and
    again, each load reading its blocks back from disk: the disk tier saves more prefill (at
    the worker's reported speed, through the index, as the router's cost model prices it)
    than its writes and reads cost, and is not flagged.
    """
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvshare.actors.config import NamespaceSpec
    from kvshare.actors.deploy import deploy, status
    from kvshare.actors.metrics import ClusterCollector, cluster_registry
    from kvshare.actors.tier_value import value_lines, value_rows
    from kvshare.router.web.view import cluster_view

    layout, speed = kv["layout"], 1000.0  # tokens/s: a 16-token block saves 16 ms of prefill
    bb, bt = layout.bytes_per_block, layout.block_tokens
    deploy(namespaces=[NamespaceSpec(ns, layout, host_bytes=8 * bb, disk_bytes=64 * bb)
                       for ns in ("cold", "warm")], ray_namespace=RAY_NS)
    cold, warm = (sdk_client(layout, ns, RAY_NS) for ns in ("cold", "warm"))
    try:
        for i in range(24):  # 48 blocks through an 8-block host tier: 40 go to disk
            store(cold, prompt(i, 2, bt), i)
        for i in range(100, 106):  # new prompts: nothing there, nothing read back
            assert load(cold, prompt(i, 2, bt), wait_s=0) == 0
        warm_prompts = [prompt(200 + i, 4, bt) for i in range(4)]
        for i, toks in enumerate(warm_prompts):
            store(warm, toks, 200 + i)
        served = sum(load(warm, toks)
                     for _ in range(4) for toks in warm_prompts)
        assert served == 4 * 4 * 4
    finally:
        cold.close()
        warm.close()
    report_speed(kv["client"], "w-value", ("cold", "warm"), speed)
    st = status(RAY_NS)
    assert st["prefill_tokens_per_s"] == {"cold": speed, "warm": speed}
    rows = {(r["namespace"], r["tier"]): r for r in value_rows(st)}
    cold_disk, warm_disk = rows[("cold", "disk")], rows[("warm", "disk")]
    print("\n".join(value_lines(st)))  # the figures the report quotes (pytest -s)

    # cold: disk written (40 blocks demoted), never read: net < 0, flagged with the fix
    w = cold_disk["window"]
    assert w["tokens"] == 0 and w["bytes_in"] >= 40 * bb
    assert w["write_s"] > 0 and w["net_s"] < 0
    assert cold_disk["verdict"].startswith("disk: 0.0% of lookups hit, 0 s saved, ")
    assert cold_disk["verdict"].endswith("s spent writing: consider --disk-gb 0 or a larger "
                                         "host tier (--host-gb)")
    # warm: most loads came back from disk, each block hit saving 16 ms of prefill
    w = warm_disk["window"]
    assert w["tokens"] >= 32 * bt and w["saved_s"] == pytest.approx(w["tokens"] / speed)
    assert w["write_s"] > 0 and w["read_s"] > 0 and w["net_s"] > 0
    assert warm_disk["verdict"] == "" and warm_disk["total"]["net_s"] > 0
    # its host tier served nothing (every load reached back past it, to disk): flagged, and
    # the fix is a larger host tier, not a smaller one
    assert rows[("warm", "host")]["verdict"].startswith("host: 0.0% of lookups hit")
    assert "consider a larger --host-gb" in rows[("warm", "host")]["verdict"]
    lines = value_lines(st)
    assert any(line == f"  ! {cold_disk['verdict']}" for line in lines)
    assert not any("! disk" in line and "warm" in line for line in lines)

    # Prometheus: the same verdicts, and the figures per span
    report_speed(kv["client"], "w-value", ("cold", "warm"), speed)  # fresh within its ttl
    text = generate_latest(cluster_registry(ClusterCollector(ray_namespace=RAY_NS))).decode()
    kv["client"].unregister_worker("w-value")
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    flagged = {(s.labels["namespace"], s.labels["tier"]): s.value for s in samples
               if s.name == "kvshare_tier_value_flagged"}
    assert flagged[("cold", "disk")] == 1 and flagged[("warm", "disk")] == 0
    net = {s.labels["namespace"]: s.value for s in samples
           if s.name == "kvshare_tier_value_net_seconds" and s.labels["tier"] == "disk"
           and s.labels["span"] == "total"}
    assert net["cold"] < 0 < net["warm"]

    # the live page's data
    page = {(r["namespace"], r["tier"]): r["verdict"]
            for n in cluster_view(st)["nodes"] for r in n["value"]}
    assert page[("cold", "disk")] == cold_disk["verdict"] and page[("warm", "disk")] == ""
