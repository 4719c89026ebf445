"""NodePool without Ray, publishing into an in-process GlobalIndex."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvshare.actors.config import NamespaceSpec, PoolSettings
from kvshare.actors.index.global_index import GlobalIndex
from kvshare.actors.node_pool import NodePool
from kvshare.layout import KVLayout
from kvshare.tiers.base import block_checksum
from kvshare.transfer.base import MISSING
from kvshare.transfer.wire import PRESENT, SourceBlock
from kvshare.types import Location, Tier

LAYOUT = KVLayout(2, 2, 16, "fp32", 16)  # 8 KiB blocks
BB = LAYOUT.bytes_per_block


def hashes(n: int, salt: str = "np") -> list[bytes]:
    return [hashlib.sha256(f"{salt}{i}".encode()).digest() for i in range(n)]


def write(node: NodePool, ns: str, hs: list[bytes], data: np.ndarray) -> list[str]:
    """Store ``data[i]`` under ``hs[i]`` through the data plane transports use."""
    return node.transfer_write_blocks(ns, hs, data, [block_checksum(d) for d in data])


@pytest.fixture
def settings(tmp_path: Any) -> PoolSettings:
    spec = NamespaceSpec("m", LAYOUT, host_bytes=8 * BB, disk_bytes=32 * BB)
    # batched publishing (these tests drive flush() themselves); publish_on_commit has its own
    return PoolSettings(namespaces=(spec,), disk_dir=str(tmp_path), publish_on_commit=False)


@pytest.fixture
def index() -> GlobalIndex:
    return GlobalIndex()


@pytest.fixture
def node(settings: PoolSettings, index: GlobalIndex) -> Iterator[NodePool]:
    pool = NodePool(f"t{os.getpid()}", settings, index, background=False)
    try:
        yield pool
    finally:
        pool.close()


def test_writes_are_published_and_read_back(node: NodePool, index: GlobalIndex) -> None:
    hs = hashes(12)  # more than the 8 host slots: the head is demoted to disk
    data = np.random.default_rng(0).integers(0, 255, (12, BB), dtype=np.uint8)
    assert write(node, "m", hs, data) == [""] * 12  # stored
    assert write(node, "m", hs[:1], data[:1]) == [PRESENT]
    node.flush()
    m = index.match("m", hs)
    counts = m.locations[Location(node.location)].tier_counts
    assert m.prefix_for(Location(node.location)) == 12 and counts[Tier.DISK] > 0
    got = node.transfer_read_blocks("m", hs + hashes(1, "other"))
    assert got.reasons == ("",) * 12 + (MISSING,) and np.array_equal(got.data[:12], data)
    info = node.slab_info("m", LAYOUT.fingerprint())
    assert info is not None and info.name.endswith(f"-{node.generation}") and info.num_slots == 8


def test_a_committed_write_is_in_the_index_when_the_commit_returns(
    settings: PoolSettings, index: GlobalIndex
) -> None:
    """Read-after-write: with ``publish_on_commit`` (the default) no publish round is needed
    between a writer's commit and the next lookup; without it the blocks wait for the next
    round."""
    hs = hashes(3, "raw")
    data = np.ones((3, BB), np.uint8)
    for on_commit in (True, False):
        s = PoolSettings(namespaces=settings.namespaces, disk_dir=settings.disk_dir,
                         publish_on_commit=on_commit)
        node = NodePool(f"raw{on_commit}", s, index, background=False)
        try:
            assert write(node, "m", hs, data) == [""] * 3
            held = index.match("m", hs).prefix_for(Location(node.location))
            assert held == (3 if on_commit else 0)
        finally:
            node.close()


def test_restart_republishes_disk_blocks_under_a_new_generation(
    settings: PoolSettings, index: GlobalIndex
) -> None:
    first = NodePool("restart", settings, index, background=False)
    hs = hashes(12, "r")
    write(first, "m", hs, np.zeros((12, BB), np.uint8))
    first.flush()
    on_disk = sum(h.get(Location(first.location)) == Tier.DISK for h in index.lookup("m", hs))
    first.close()
    second = NodePool("restart", settings, index, background=False)  # same node, same disk
    try:
        assert second.generation > first.generation
        loc = Location(second.location)
        tiers = [h.get(loc) for h in index.lookup("m", hs)]
        assert tiers.count(Tier.DISK) == on_disk and Tier.HOST not in tiers
    finally:
        second.close()


def test_a_sequence_gap_triggers_a_resync(node: NodePool, index: GlobalIndex) -> None:
    hs = hashes(4, "gap")
    write(node, "m", hs[:2], np.zeros((2, BB), np.uint8))
    node._pools["m"].take_events()  # lost on the way: the index never sees them
    write(node, "m", hs[2:], np.zeros((2, BB), np.uint8))
    node.flush()  # the index sees a gap, asks for the inventory, the pool sends it
    assert index.match("m", hs).prefix_for(Location(node.location)) == 4
    assert node.counters["republishes"] >= 2 and not index.needs_resync("m", node.location)


def test_bad_input_is_refused(node: NodePool) -> None:
    with pytest.raises(KeyError, match="known: \\['m'\\]"):
        node.transfer_prepare_write("other", hashes(1), "pid:1", 10.0)
    with pytest.raises(ValueError, match="KV layout"):
        write(node, "m", hashes(2), np.zeros((2, BB - 1), np.uint8))
    with pytest.raises(ValueError, match="fix the worker's KV layout"):
        node.slab_info("m", KVLayout(2, 2, 16, "fp16", 16).fingerprint())
    with pytest.raises(ValueError, match="holder"):
        node.transfer_prepare_read("m", hashes(1), "", 10.0)
    assert node.stats()["namespaces"]["m"]["tiers"]["host"]["blocks"] == 0


def test_dead_pid_holders_lose_their_leases(node: NodePool) -> None:
    hs = hashes(2, "lease")
    write(node, "m", hs, np.zeros((2, BB), np.uint8))
    proc = subprocess.Popen(["true"])
    proc.wait()
    dead = proc.pid
    got = node.transfer_prepare_read("m", hs, f"pid:{dead}", 30.0)
    assert all(isinstance(b, SourceBlock) for b in got.blocks)
    assert node.stats()["namespaces"]["m"]["active_leases"] == 2
    assert node.check_holders() == 2
    assert node.stats()["namespaces"]["m"]["active_leases"] == 0


def test_bandwidth_overrides_env_beats_config_and_probe_blocks_stay_private(
    settings: PoolSettings, index: GlobalIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overrides: ``KVSHARE_BANDWIDTH_GBPS`` > PoolSettings.bandwidth_overrides > the probe. The
    probe reads blocks of the private probe namespace: never in the index or the pool stats."""
    from dataclasses import replace

    from kvshare.transfer.probe import PROBE_NAMESPACE
    from kvshare.transfer.reader.control import LocalControl

    with pytest.raises(ValueError, match="shm, nixl or objstore"):
        replace(settings, bandwidth_overrides={"carrier-pigeon": 1e9})
    monkeypatch.setenv("KVSHARE_BANDWIDTH_GBPS", "nixl=7")
    cfg = replace(settings, bandwidth_overrides={"nixl": 1e9, "objstore": 2.5e9})
    node = NodePool(f"tb{os.getpid()}", cfg, index, background=False)
    try:
        src = node.transfer.source(PROBE_NAMESPACE)
        got = node.transfer.measure(PROBE_NAMESPACE, {node.node_id: LocalControl(src)})
        assert got["shm"] > 0 and got["nixl"] == 7e9 and got["objstore"] == 2.5e9
        exposed = node.transfer_bandwidths()
        assert exposed["transports"] == got and exposed["measured_at"] > 0
        assert exposed["overrides"] == {"nixl": 7e9, "objstore": 2.5e9}
        node.flush()
        assert set(node.stats()["namespaces"]) == {"m"}
        assert PROBE_NAMESPACE not in index.stats()["namespaces"]
    finally:
        node.close()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"kvshare-{PROBE_NAMESPACE}-tb{os.getpid()}")]
