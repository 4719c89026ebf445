"""The data plane on a real Ray cluster (head + 2 nodes): deployed NodePoolActors serve blocks.

Reader actors play inference workers: ``reader_a`` on node A (same node as pool A: shm) and
``reader_b`` on node B (nixl, nixl_push, objstore). Faults are injected for real: bytes flipped in pool
A's /dev/shm slab and in its disk files, a 1 ms deadline, a NIXL agent that cannot start
(``UCX_TLS=sm,self``), and a node removed from the cluster. After every scenario both pools
must be consistent: no lease or pin left, no reserved-but-uncommitted slot.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvshare.layout import KVLayout
from kvshare.transfer.base import (
    CORRUPT,
    DEADLINE,
    HOLDER_DEAD,
    MISSING,
    NIXL_UNAVAILABLE,
    Transport,
    TransportUnavailable,
)
from kvshare.transfer.node_api import TransferEndpoints

pytestmark = pytest.mark.cluster

RAY_NS = "kvs-test-transfer"
NS = "xfer"  # 16 KiB blocks, room for 1,100 in host
SMALL = "xfer-small"  # 8 host slots + 64 on disk: blocks get demoted
LAYOUT = KVLayout(2, 2, 16, "fp32", 32)
B = LAYOUT.bytes_per_block


def bhash(tag: str, seed: int) -> bytes:
    return hashlib.sha256(f"{tag}/{seed}".encode()).digest()


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, B, dtype=np.uint8)


class Reader:
    """A worker process on some node that reads/writes pools through every transport."""

    def __init__(self, tag: str) -> None:
        import ray

        from kvshare.transfer.reader.nixl import NixlTransport
        from kvshare.transfer.reader.objstore import ObjStoreTransport
        from kvshare.transfer.reader.shm import ShmTransport

        self.node = ray.get_runtime_context().get_node_id()
        self.dest = np.zeros((1000, B), np.uint8)
        self.transports: dict[str, Transport] = {
            "shm": ShmTransport(self.node, holder=f"pid:{os.getpid()}"),
            "objstore": ObjStoreTransport(f"pid:{os.getpid()}"),
        }
        self.nixl_error = ""
        try:
            nixl = NixlTransport(f"{NS}/{self.node[:12]}/{tag}-{os.getpid()}")
            nixl.register(self.dest)
            self.transports["nixl"] = nixl
            from kvshare.transfer.reader.nixl_push import NixlPushTransport

            push = NixlPushTransport(f"{NS}/{self.node[:12]}/{tag}-push-{os.getpid()}")
            push.register(self.dest)
            self.transports["nixl_push"] = push
        except TransportUnavailable as exc:
            self.nixl_error = str(exc)
        self.pending: Any = None

    def info(self) -> dict[str, str]:
        return {"node": self.node, "nixl_error": self.nixl_error}

    def write(self, name: str, pool: Any, ns: str, tag: str, seeds: list[int]) -> list[str]:
        from kvshare.transfer.reader.control import ActorControl

        res = self.transports[name].write(
            ActorControl(pool, ns), [bhash(tag, s) for s in seeds], [payload(s) for s in seeds]
        )
        return [o.reason for o in res.outcomes]

    def read(self, name: str, pool: Any, ns: str, tag: str, seeds: list[int],
             deadline_s: float = 10.0) -> list[tuple[str, bool]]:
        """Per block: (reason, bytes identical to what was written)."""
        self.submit(name, pool, ns, tag, seeds, deadline_s)
        return self.collect()

    def submit(self, name: str, pool: Any, ns: str, tag: str, seeds: list[int],
               deadline_s: float = 10.0) -> None:
        from kvshare.transfer.reader.control import ActorControl

        self.dest[: len(seeds)] = 0
        t = self.transports[name].submit_read(
            ActorControl(pool, ns), [bhash(tag, s) for s in seeds], list(self.dest[: len(seeds)]),
            deadline_s=deadline_s,
        )
        self.pending = (name, t, seeds)

    def collect(self) -> list[tuple[str, bool]]:
        name, t, seeds = self.pending
        res = self.transports[name].wait(t)
        return [(o.reason, bool(np.array_equal(self.dest[i], payload(s))))
                for i, (o, s) in enumerate(zip(res.outcomes, seeds, strict=True))]

    def fetch(self, tag: str, seeds: list[int], keep_local: bool) -> dict[str, Any]:
        """Peer fetch planned from the index, as the worker SDK does it."""
        from kvshare.actors.deploy import get_index_client, get_pool
        from kvshare.transfer.reader.control import ActorControl
        from kvshare.transfer.reader.fetch import PeerFetcher
        from kvshare.types import parse_location

        def control(loc: Any) -> Any:
            try:
                return ActorControl(get_pool(parse_location(loc)[1], RAY_NS), NS)
            except Exception:
                return None

        fetcher = PeerFetcher(self.node, NS, control, self.transports, index=get_index_client(RAY_NS))
        hs = [bhash(tag, s) for s in seeds]
        res = fetcher.fetch(hs, list(self.dest[: len(hs)]), keep_local=keep_local)
        return {
            "reasons": [o.reason for o in res.outcomes],
            "served_by": list(res.served_by),
            "kept": res.kept_local,
            "identical": [bool(np.array_equal(self.dest[i], payload(s))) for i, s in enumerate(seeds)],
        }


class SmallPool(TransferEndpoints):
    """A test-only pool actor (TieredBlockPool + TransferService) for nodes we break."""

    def __init__(self, ns: str, blocks: int) -> None:
        import ray

        from kvshare.transfer.holder.local import make_local_pool
        from kvshare.transfer.node_api import TransferService

        node = ray.get_runtime_context().get_node_id()
        self.transfer = TransferService(node)
        self.pool = make_local_pool(ns, node, LAYOUT, blocks)
        self.transfer.add_pool(self.pool)

    def stats(self) -> dict[str, Any]:
        return {**self.pool.stats(), "nixl_error": self.transfer.nixl_errors()}

    def close(self) -> None:
        self.transfer.close()
        self.pool.close()


@pytest.fixture(scope="module")
def kv(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray
    import ray.cloudpickle

    from kvshare.actors.config import NamespaceSpec
    from kvshare.actors.deploy import deploy, get_pool, shutdown
    from kvshare.tiers.host import remove_stale_segments

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    disk = str(tmp_path_factory.mktemp("disk"))
    deploy(namespaces=[NamespaceSpec(NS, LAYOUT, 1100 * B), NamespaceSpec(SMALL, LAYOUT, 8 * B, 64 * B)],
           disk_dir=disk, ray_namespace=RAY_NS)
    nodes = {key: n["NodeID"] for n in ray.nodes() for key in ("node_0", "node_1")
             if n["Alive"] and key in n["Resources"]}
    reader = ray.remote(num_cpus=0)(Reader)
    ra = reader.options(resources={"node_0": 0.1}).remote("ra")
    rb = reader.options(resources={"node_1": 0.1}).remote("rb")
    env = {
        "a": nodes["node_0"], "b": nodes["node_1"], "disk": disk, "cluster": ray_cluster,
        "pa": get_pool(nodes["node_0"], RAY_NS), "pb": get_pool(nodes["node_1"], RAY_NS),
        "ra": ra, "rb": rb,
    }
    assert ray.get(ra.info.remote())["node"] == env["a"]
    # 1,000 blocks written on node A over shared memory by the worker there
    assert set(ray.get(ra.write.remote("shm", env["pa"], NS, "base", list(range(1000))))) == {""}
    try:
        yield env
    finally:
        node_ids = [n["NodeID"] for n in ray.nodes()]
        shutdown(RAY_NS)
        for ns in (NS, SMALL, "xfer-nonixl", "xfer-dies", "xfer-bwenv", "kvshare-probe"):  # slabs of pools that were killed
            for node_id in node_ids:
                remove_stale_segments(ns, node_id)
                for path in glob.glob(f"/dev/shm/kvshare-{ns}-{node_id}-*.epochs"):
                    os.unlink(path)


def assert_consistent(pool: Any, ns: str = NS, wait_s: float = 2.0) -> None:
    """No lease, no pin, no reserved-but-uncommitted slot in any tier (within ``wait_s``: a
    shared-memory reader sends its unpin without waiting for the reply)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        st = ray.get(pool.stats.remote())
        st = st["namespaces"][ns] if "namespaces" in st else st
        ok = st["active_leases"] == 0 and st["pinned_blocks"] == 0 and all(
            t["used_slots"] == t["blocks"] for t in st["tiers"].values())
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert ok, st


def reader_for(kv: dict[str, Any], name: str) -> Any:
    return kv["ra"] if name == "shm" else kv["rb"]


@pytest.mark.parametrize("name", ["shm", "nixl", "nixl_push", "objstore"])
@pytest.mark.parametrize("n", [1, 64, 1000])
def test_blocks_written_on_a_read_byte_identical(kv: dict[str, Any], name: str, n: int) -> None:
    import ray

    out = ray.get(reader_for(kv, name).read.remote(name, kv["pa"], NS, "base", list(range(n))))
    assert out == [("", True)] * n
    assert_consistent(kv["pa"])
    assert_consistent(kv["pb"])


@pytest.mark.parametrize("name", ["shm", "nixl", "nixl_push", "objstore"])
def test_mixed_batch_misses_exactly_the_missing(kv: dict[str, Any], name: str) -> None:
    import ray

    seeds = [0, 5000, 1, 2, 5001, 3]  # 5000/5001 were never written
    out = ray.get(reader_for(kv, name).read.remote(name, kv["pa"], NS, "base", seeds))
    assert [r for r, _ in out] == ["", MISSING, "", "", MISSING, ""]
    assert all(same for (r, same) in out if r == "")
    assert_consistent(kv["pa"])


@pytest.mark.parametrize("name", ["shm", "nixl", "objstore"])
def test_writes_over_each_transport_land_whole(kv: dict[str, Any], name: str) -> None:
    import ray

    tag = f"w-{name}"
    assert ray.get(reader_for(kv, name).write.remote(name, kv["pa"], NS, tag, list(range(40)))) == [""] * 40
    out = ray.get(kv["rb"].read.remote("objstore", kv["pa"], NS, tag, list(range(40))))
    assert out == [("", True)] * 40
    assert_consistent(kv["pa"])


@pytest.mark.parametrize("name", ["nixl", "nixl_push", "objstore"])
def test_flipped_byte_in_slab_is_a_corrupt_miss(kv: dict[str, Any], name: str) -> None:
    import ray

    from kvshare.tiers.host import HostSlab
    from kvshare.transfer.base import call
    from kvshare.transfer.reader.control import ActorControl

    tag = f"rot-{name}"
    ray.get(kv["ra"].write.remote("shm", kv["pa"], NS, tag, [0, 1, 2]))
    ctl = ActorControl(kv["pa"], NS)
    prep = call(ctl.prepare_read([bhash(tag, 1)], f"test-rot-{name}", 5.0), 5.0)
    call(ctl.finish(f"test-rot-{name}", []), 5.0)
    assert prep.slab is not None
    slab = HostSlab.attach(prep.slab.name, prep.slab.slot_bytes, prep.slab.num_slots)
    slab.array[prep.blocks[0].slot, 100] ^= 0x01  # type: ignore[union-attr]
    slab.close()
    out = ray.get(kv["rb"].read.remote(name, kv["pa"], NS, tag, [0, 1, 2]))
    assert [r for r, _ in out] == ["", CORRUPT, ""] and out[0][1] and out[2][1]
    # the reader reported it: pool A re-verified the block and dropped it
    again = ray.get(kv["rb"].read.remote("objstore", kv["pa"], NS, tag, [1]))
    assert again == [(MISSING, False)]
    assert_consistent(kv["pa"])


@pytest.mark.parametrize("name", ["shm", "nixl", "nixl_push", "objstore"])
def test_flipped_byte_in_disk_file_is_a_corrupt_miss(kv: dict[str, Any], name: str) -> None:
    import ray

    tag = f"disk-{name}"
    ra = kv["ra"]
    for first in range(0, 16, 4):  # a batch must fit in the 8 host slots; older ones go to disk
        assert ray.get(ra.write.remote("shm", kv["pa"], SMALL, tag, list(range(first, first + 4)))) == [""] * 4
    files = glob.glob(os.path.join(kv["disk"], kv["a"], SMALL, "slot-*.blk"))
    victim = None
    for path in files:
        with open(path, "rb") as f:
            head = f.read(44)
        for s in range(16):
            if head[12:44] == bhash(tag, s):
                victim, vpath = s, path
    assert victim is not None, "no block of this test was demoted to disk"
    with open(vpath, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x80]))
    reader = ra if name == "shm" else kv["rb"]
    out = ray.get(reader.read.remote(name, kv["pa"], SMALL, tag, [victim]))
    assert out == [(CORRUPT, False)]
    st = ray.get(kv["pa"].stats.remote())["namespaces"][SMALL]
    assert st["tiers"]["disk"]["corrupt"] + st["tiers"]["host"]["corrupt"] >= 1
    assert_consistent(kv["pa"], SMALL)


@pytest.mark.parametrize("name", ["shm", "nixl", "nixl_push", "objstore"])
def test_one_millisecond_deadline_misses_and_releases(kv: dict[str, Any], name: str) -> None:
    import ray

    out = ray.get(reader_for(kv, name).read.remote(name, kv["pa"], NS, "base", list(range(1000)), 0.001))
    assert {r for r, _ in out} == {DEADLINE}
    assert_consistent(kv["pa"])  # a prepare still queued behind finish pins nothing


def test_peer_fetch_pins_pulls_verifies_and_keeps_a_local_copy(kv: dict[str, Any]) -> None:
    import ray

    from kvshare.types import node_location

    rb = kv["rb"]
    tag = "fetch"
    ray.get(kv["ra"].write.remote("shm", kv["pa"], NS, tag, list(range(32))))
    indexed_at(kv["a"], tag, 32)  # events reach the index (publish interval 50 ms)
    first = ray.get(rb.fetch.remote(tag, list(range(32)) + [999999], True))
    assert first["reasons"] == [""] * 32 + [MISSING] and all(first["identical"][:32])
    assert set(first["served_by"][:32]) == {f"{node_location(kv['a'])}/nixl"}
    assert first["kept"] == 32
    assert_consistent(kv["pa"])
    assert_consistent(kv["pb"])
    indexed_at(kv["b"], tag, 32)  # the kept copies reach the index too
    second = ray.get(rb.fetch.remote(tag, list(range(32)), False))
    assert second["reasons"] == [""] * 32 and all(second["identical"])
    assert set(second["served_by"]) == {f"{node_location(kv['b'])}/shm"}  # now local


def indexed_at(node: str, tag: str, n: int, timeout_s: float = 30.0) -> None:
    """Wait until the index lists blocks ``bhash(tag, 0..n-1)`` in ``node``'s pool."""
    from kvshare.actors.deploy import get_index_client
    from kvshare.types import BlockHash, node_location

    index, loc = get_index_client(RAY_NS), node_location(node)
    hs = [BlockHash(bhash(tag, s)) for s in range(n)]
    deadline = time.monotonic() + timeout_s
    while not all(loc in held for held in index.lookup(NS, hs)):
        assert time.monotonic() < deadline, f"{tag} blocks not indexed at {loc} in {timeout_s} s"
        time.sleep(0.05)


def wait_probed(timeout_s: float = 180.0) -> list[dict[str, Any]]:
    """The alive nodes' status entries once each shows shm, nixl and objstore above 0 (the
    probes warm up and repeat in the background: at load ~30 two nodes were still at 0 after
    60 s, so the bound is generous; a quiet machine passes in seconds)."""
    from kvshare.actors.deploy import status

    deadline = time.monotonic() + timeout_s
    while True:
        nodes = [n for n in status(RAY_NS)["nodes"] if n["alive"] and "pool" in n]
        ok = len(nodes) == 3 and all(
            n.get("bandwidth_bytes_per_s", {}).get(t, 0.0) > 0 for n in nodes for t in ("shm", "nixl", "objstore"))
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert ok, [(n["node_id"][:8], n.get("bandwidth_bytes_per_s")) for n in nodes]
    return nodes


def test_deploy_probes_every_node_in_the_background(kv: dict[str, Any]) -> None:
    """The watcher had every pool probe its peers after deploy: status shows GB/s per node and
    transport, deploy.bandwidths the same in bytes/s, and the router's cost model takes them."""
    from kvshare.actors.deploy import bandwidths, measured_bandwidths, status
    from kvshare.cost import Bandwidths
    from kvshare.transfer.probe import PROBE_NAMESPACE

    nodes = wait_probed()
    per_node = bandwidths(RAY_NS)
    for n in nodes:
        assert set(n["bandwidth"]["per_node"]) == {m["node_id"] for m in nodes}
        assert set(per_node[n["node_id"]]) == set(n["bandwidth_bytes_per_s"])  # same transports
        assert all(v > 1e6 for v in per_node[n["node_id"]].values())
    cluster = measured_bandwidths(RAY_NS)
    assert set(cluster) == {"shm", "nixl", "objstore"}
    assert Bandwidths.from_measured(cluster).remote == max(cluster["nixl"], cluster["objstore"])
    # probe blocks live in a private namespace: not in the index, not in the pools' stats
    st = status(RAY_NS)
    assert all(PROBE_NAMESPACE not in shard["namespaces"] for shard in st["index"])
    assert all(set(n["pool"]["namespaces"]) == {NS, SMALL} for n in nodes)


def test_auto_remote_picks_the_faster_measured_transport(
    kv: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVShareClient(remote="auto") takes the faster of nixl/objstore as its node's pool
    measured it; KVSHARE_BANDWIDTH_GBPS in the worker's process overrides the measurement."""
    import ray

    from kvshare.actors.deploy import get_pool
    from kvshare.client.sdk import KVShareClient
    from kvshare.types import BlockHash

    wait_probed()
    root = BlockHash(bhash("root", 0))
    monkeypatch.delenv("KVSHARE_BANDWIDTH_GBPS", raising=False)
    client = KVShareClient.connect(NS, LAYOUT, root, ray_namespace=RAY_NS, worker_id="auto-m")
    try:
        bw = ray.get(get_pool(client.node, RAY_NS).transfer_bandwidths.remote())["transports"]
        assert client.auto and set(client.bandwidths) == set(bw) == {"shm", "nixl", "objstore"}
        for got in (client.bandwidths, bw):  # what it chose on, and the pool's figures now
            assert client.remote == ("objstore" if got["objstore"] > got["nixl"] else "nixl")
    finally:
        client.close()
    from kvshare.cost_cut import CostCut

    for env, winner in (("objstore=1000", "objstore"), ("nixl=1000,objstore=0.001", "nixl")):
        monkeypatch.setenv("KVSHARE_BANDWIDTH_GBPS", env)
        cut = CostCut(LAYOUT)
        client = KVShareClient.connect(NS, LAYOUT, root, ray_namespace=RAY_NS,
                                       worker_id=f"auto-{winner}", cut_policy=cut)
        try:
            assert client.remote == winner, (env, client.bandwidths)
            # the worker's cut point now plans with the chosen transport's figure
            assert cut.model.bandwidths.remote == 1000e9
            assert cut.model.bandwidths.host == client.bandwidths["shm"]
        finally:
            client.close()


def test_pool_env_override_beats_its_measurement(kv: dict[str, Any]) -> None:
    """A pool process with KVSHARE_BANDWIDTH_GBPS reports the override, not what it measured."""
    import ray

    from kvshare.transfer.probe import PROBE_NAMESPACE

    env = {"env_vars": {"KVSHARE_BANDWIDTH_GBPS": "nixl=0.001", "NIXL_LOG_LEVEL": "ERROR"}}
    small = ray.remote(num_cpus=0)(SmallPool).options(
        resources={"node_0": 0.1}, runtime_env=env).remote("xfer-bwenv", 8)
    try:
        got = ray.get(small.transfer_measure.remote(PROBE_NAMESPACE, {kv["b"]: kv["pb"]}), timeout=60)
        assert got["nixl"] == 0.001e9 and got["objstore"] > 0
        exposed = ray.get(small.transfer_bandwidths.remote())
        assert exposed["per_node"][kv["b"]]["nixl"] > 0.001e9  # what it measured
        assert exposed["overrides"] == {"nixl": 0.001e9}
    finally:
        ray.get(small.close.remote())
        ray.kill(small)


def test_pool_measures_transports_to_its_peers(kv: dict[str, Any]) -> None:
    """Pool B probes itself (shm) and pool A (nixl, objstore); figures are exposed."""
    import ray

    got = ray.get(kv["pb"].transfer_measure.remote(NS, {kv["a"]: kv["pa"], kv["b"]: kv["pb"]}))
    assert got["shm"] > 0 and got["nixl"] > 0 and got["objstore"] > 0
    exposed = ray.get(kv["pb"].transfer_bandwidths.remote())
    assert exposed["transports"] == got and set(exposed["per_node"][kv["a"]]) == {"nixl", "objstore"}
    assert_consistent(kv["pa"])
    assert_consistent(kv["pb"])


def test_nixl_that_cannot_start_falls_back_to_objstore(kv: dict[str, Any]) -> None:
    """The source's NIXL agent fails (no tcp in UCX_TLS): nixl reads miss, objstore serves."""
    import ray

    env = {"env_vars": {"UCX_TLS": "sm,self", "NIXL_LOG_LEVEL": "ERROR"}}
    small = ray.remote(num_cpus=0)(SmallPool).options(
        resources={"node_0": 0.1}, runtime_env=env).remote("xfer-nonixl", 64)
    try:
        assert "nixl_unavailable" in ray.get(small.stats.remote())["nixl_error"]["xfer-nonixl"]
        rb = kv["rb"]
        assert ray.get(rb.write.remote("objstore", small, "xfer-nonixl", "nn", list(range(8)))) == [""] * 8
        out = ray.get(rb.read.remote("nixl", small, "xfer-nonixl", "nn", list(range(8))))
        assert {r for r, _ in out} == {NIXL_UNAVAILABLE}
        out = ray.get(rb.read.remote("objstore", small, "xfer-nonixl", "nn", list(range(8))))
        assert out == [("", True)] * 8
        assert_consistent(small)
        # and a reader whose own NIXL cannot start has no nixl transport at all
        broken = ray.remote(num_cpus=0)(Reader).options(
            resources={"node_1": 0.1}, runtime_env=env).remote("broken")
        assert "nixl_unavailable" in ray.get(broken.info.remote())["nixl_error"]
        ray.kill(broken)
    finally:
        ray.get(small.close.remote())
        ray.kill(small)


def test_source_node_dies_mid_transfer(kv: dict[str, Any]) -> None:
    """Node X holds blocks; it is removed while B pulls: misses, no wrong bytes, no hang.

    Both sides run UCX over tcp only, where a READ makes progress only while the reader polls:
    the transfer is posted, the node is removed, and only then does the reader poll.
    """
    import ray

    cluster = kv["cluster"]
    env = {"env_vars": {"UCX_TLS": "tcp,self", "NIXL_LOG_LEVEL": "ERROR"}}
    node = cluster.add_node(num_cpus=1, object_store_memory=200 * 2**20, resources={"node_x": 1})
    small = ray.remote(num_cpus=0, max_restarts=0)(SmallPool).options(
        resources={"node_x": 1}, runtime_env=env).remote("xfer-dies", 1000)
    rt = ray.remote(num_cpus=0)(Reader).options(resources={"node_1": 0.1}, runtime_env=env).remote("rt")
    try:
        assert ray.get(rt.write.remote("objstore", small, "xfer-dies", "d", list(range(1000)))) == [""] * 1000
        ray.get(rt.submit.remote("nixl", small, "xfer-dies", "d", list(range(1000)), 10.0))
        cluster.remove_node(node)
        t0 = time.monotonic()
        out = ray.get(rt.collect.remote())
        assert {r for r, _ in out} == {HOLDER_DEAD}, {r for r, _ in out}
        assert time.monotonic() - t0 < 5.0
        for name in ("nixl", "nixl_push", "objstore"):
            out = ray.get(rt.read.remote(name, small, "xfer-dies", "d", list(range(64)), 10.0))
            assert {r for r, _ in out} == {HOLDER_DEAD}, name
        assert time.monotonic() - t0 < 10.0
        assert_consistent(kv["pb"])
    finally:
        ray.kill(rt)


def test_aligned_empty_starts_on_a_huge_page_and_has_the_shape() -> None:
    from kvshare.transfer.reader.nixl import HUGE_PAGE, aligned_empty

    for shape in (1000, (3, B), (17, 4096)):
        a = aligned_empty(shape)
        assert a.ctypes.data % HUGE_PAGE == 0 and a.dtype == np.uint8 and a.flags.c_contiguous
        assert a.shape == ((shape,) if isinstance(shape, int) else shape)
        a.fill(7)
        assert int(a.sum()) == 7 * a.size
    assert aligned_empty(64, align=4096).ctypes.data % 4096 == 0
