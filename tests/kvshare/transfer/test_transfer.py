"""Transports in one process (no Ray): one conformance suite run against shm, nixl and objstore.

Sources are real pools over named /dev/shm slabs (and disk), served by BlockServer through
LocalControl; NIXL runs for real (two UCX agents in this process).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvshare.layout import KVLayout
from kvshare.match import build_match
from kvshare.tiers.disk import DiskStore
from kvshare.tiers.host import HostSlab
from kvshare.transfer.base import (
    CORRUPT,
    DEADLINE,
    MISSING,
    NIXL_UNAVAILABLE,
    SLOT_REUSED,
    Transport,
    TransportUnavailable,
)
from kvshare.transfer.holder.local import make_local_pool, make_local_source
from kvshare.transfer.holder.server import BlockServer
from kvshare.transfer.nixl_agent import make_agent
from kvshare.transfer.node_api import TransferService
from kvshare.transfer.probe import TransportBandwidths, parse_overrides, probe
from kvshare.transfer.reader.control import LocalControl
from kvshare.transfer.reader.fetch import PeerFetcher
from kvshare.transfer.reader.nixl import NixlTransport
from kvshare.transfer.reader.objstore import ObjStoreTransport
from kvshare.transfer.reader.shm import ShmTransport
from kvshare.transfer.wire import Ready, Reply, SlotReply
from kvshare.types import BlockHash, Location, Tier, node_location

LAYOUT = KVLayout(1, 1, 8, "fp32", 64)  # 4 KiB blocks
B = LAYOUT.bytes_per_block
NODE = "ut-a"


def h(i: int, tag: int = 0) -> BlockHash:
    return BlockHash(i.to_bytes(4, "little") + bytes([tag]) * 28)


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, B, dtype=np.uint8)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BlockServer]:
    disk = tmp_path_factory.mktemp("disk")
    src = make_local_source(
        f"ut{os.getpid()}", NODE, LAYOUT, 1200, disk_dir=str(disk), disk_blocks=64
    )
    for i in range(1000):
        assert src.pool.put(h(i), payload(i))
    yield src
    src.close()
    src.pool.close()


@pytest.fixture(scope="module")
def transports() -> Iterator[dict[str, Transport]]:
    ts: dict[str, Transport] = {
        "shm": ShmTransport(NODE, verify=True),
        "nixl": NixlTransport(f"ut{os.getpid()}/reader/0"),
        "objstore": ObjStoreTransport(),
    }
    yield ts
    for t in ts.values():
        t.close()


NAMES = ["shm", "nixl", "objstore"]


def consistent(src: BlockServer) -> None:
    st = src.pool.stats()
    assert st["active_leases"] == 0 and st["pinned_blocks"] == 0, st


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 64, 1000])
def test_read_batches_byte_identical(source: BlockServer, transports: dict[str, Transport], name: str, n: int) -> None:
    dest = np.zeros((n, B), np.uint8)
    res = transports[name].read(LocalControl(source), [h(i) for i in range(n)], list(dest))
    assert res.ok and res.num_ok == n and res.nbytes == n * B
    assert all(np.array_equal(dest[i], payload(i)) for i in range(n))
    consistent(source)


@pytest.mark.parametrize("name", NAMES)
def test_mixed_batch_reports_exactly_the_missing(source: BlockServer, transports: dict[str, Transport], name: str) -> None:
    ids = [3, 9999, 5, 8888, 7]
    dest = np.zeros((len(ids), B), np.uint8)
    res = transports[name].read(LocalControl(source), [h(i) for i in ids], list(dest))
    assert res.misses() == {h(9999): MISSING, h(8888): MISSING}
    c = transports[name].counters
    assert c["miss_missing"] >= 2 and c["blocks_ok"] >= 3 and c["bytes"] >= 3 * B
    for k in (0, 2, 4):
        assert np.array_equal(dest[k], payload(ids[k]))
    consistent(source)


@pytest.mark.parametrize("name", NAMES)
def test_flipped_byte_in_slab_is_corrupt_and_dropped(source: BlockServer, transports: dict[str, Transport], name: str) -> None:
    victim = h(1000 + NAMES.index(name), 7)
    assert source.pool.put(victim, payload(5))
    lease = source.pool.pin([victim], "test")[0]
    assert lease is not None and lease.tier == Tier.HOST
    source.pool.unpin([lease.lease_id])
    slab = source.pool.store(Tier.HOST)
    assert isinstance(slab, HostSlab)
    slab.array[lease.slot, 17] ^= 0xFF  # a bit rot in shared memory
    dest = np.zeros((2, B), np.uint8)
    res = transports[name].read(LocalControl(source), [h(0), victim], list(dest))
    assert res.misses() == {victim: CORRUPT}
    assert victim not in source.pool  # the reader reported it; the pool re-verified and dropped it
    consistent(source)


@pytest.mark.parametrize("name", NAMES)
def test_flipped_byte_in_disk_file_is_corrupt(tmp_path: Path, transports: dict[str, Transport], name: str) -> None:
    src = make_local_source(f"ud{os.getpid()}{name}", NODE, LAYOUT, 4, disk_dir=str(tmp_path), disk_blocks=8, nixl=name == "nixl")
    try:
        for i in range(6):  # 4 host slots: the first two are demoted to disk
            assert src.pool.put(h(i), payload(i))
        assert src.pool.tier_of(h(0)) == Tier.DISK
        disk = src.pool.store(Tier.DISK)
        assert isinstance(disk, DiskStore)
        files = sorted(tmp_path.glob("slot-*.blk"))
        with open(files[0], "r+b") as f:
            f.seek(-5, os.SEEK_END)
            b = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([b[0] ^ 0x55]))
        dest = np.zeros((4, B), np.uint8)
        ids = [0, 1, 4, 5]
        res = transports[name].read(LocalControl(src), [h(i) for i in ids], list(dest))
        assert res.misses() == {h(0): CORRUPT} and res.num_ok == 3
        assert all(np.array_equal(dest[k], payload(ids[k])) for k in (1, 2, 3))
        st = src.pool.stats()
        assert st["tiers"]["disk"]["corrupt"] == 1 and st["active_leases"] == 0
    finally:
        src.close()
        src.pool.close()


@pytest.mark.parametrize("name", NAMES)
def test_one_millisecond_deadline(source: BlockServer, transports: dict[str, Transport], name: str) -> None:
    dest = np.zeros((1000, B), np.uint8)
    res = transports[name].read(LocalControl(source), [h(i) for i in range(1000)], list(dest), deadline_s=0.001)
    assert res.reasons().get(DEADLINE, 0) > 0 and set(res.reasons()) == {DEADLINE}
    for o, row, i in zip(res.outcomes, dest, range(1000), strict=True):
        if o.ok:  # whatever made it is exact
            assert np.array_equal(row, payload(i))
    consistent(source)


@pytest.mark.parametrize("name", NAMES)
def test_write_then_read_back(source: BlockServer, transports: dict[str, Transport], name: str) -> None:
    tag = 10 + NAMES.index(name)
    hs = [h(i, tag) for i in range(20)] + [h(0)]  # the last one is already present
    res = transports[name].write(LocalControl(source), hs, [payload(i + 50) for i in range(20)] + [payload(0)])
    assert res.ok, res.reasons()
    for i in range(20):
        got = source.pool.get(hs[i])
        assert got is not None and np.array_equal(got, payload(i + 50))
    consistent(source)
    source.pool.remove(hs[:-1])


def test_shm_straight_copies_move_the_slots_bytes(source: BlockServer) -> None:
    """``copy`` instead of buffers: a read hands the caller the slab rows of exactly the blocks
    it holds (the missing one is a miss), a write fills the reserved slots from the caller."""
    shm = ShmTransport(NODE, verify=True)
    seen: dict[int, np.ndarray] = {}

    def take(rows: np.ndarray, pos: list[int], slots: list[int]) -> None:
        seen.update({p: rows[s].copy() for p, s in zip(pos, slots, strict=True)})

    hs = [h(3), h(4000), h(5)]
    res = shm.wait(shm.submit_read(LocalControl(source), hs, list(np.empty((3, B), np.uint8)),
                                   deadline_s=5.0, copy=take))
    assert res.misses() == {h(4000): MISSING} and set(seen) == {0, 2}
    assert np.array_equal(seen[0], payload(3)) and np.array_equal(seen[2], payload(5))

    def give(rows: np.ndarray, pos: list[int], slots: list[int]) -> None:
        for p, s in zip(pos, slots, strict=True):
            rows[s] = payload(700 + p)

    new = [h(i, 30) for i in range(3)]
    res = shm.wait(shm.submit_write(LocalControl(source), new, list(np.empty((3, B), np.uint8)),
                                    deadline_s=5.0, copy=give))
    assert res.ok, res.reasons()
    for i in range(3):  # the pool verifies its checksums on this read
        got = source.pool.get(new[i])
        assert got is not None and np.array_equal(got, payload(700 + i))
    consistent(source)
    source.pool.remove(new)
    shm.close()


def test_bad_input_names_the_fix(source: BlockServer, transports: dict[str, Transport]) -> None:
    for t in transports.values():
        with pytest.raises(ValueError, match="one buffer per block"):
            t.read(LocalControl(source), [h(0), h(1)], [np.zeros(B, np.uint8)])
        with pytest.raises(ValueError, match="check the KV layout"):
            t.read(LocalControl(source), [h(0)], [np.zeros(B - 1, np.uint8)])
    consistent(source)


def test_nixl_failing_to_initialise_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "sm,self")  # no tcp: UCX cannot create the agent's endpoints
    with pytest.raises(TransportUnavailable) as err:
        make_agent("ut-broken")
    assert err.value.reason == NIXL_UNAVAILABLE


def test_nixl_not_installed_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # import fails as if not installed
    with pytest.raises(TransportUnavailable, match="not importable"):
        NixlTransport("ut-missing")


def test_fetch_falls_back_to_objstore_when_source_has_no_nixl(transports: dict[str, Transport]) -> None:
    """Node A holds blocks but its NIXL failed; node B fetches, keeps a copy, unpins."""
    a = make_local_source(f"uf{os.getpid()}", "ut-fa", LAYOUT, 64, nixl=False)
    b = make_local_source(f"uf{os.getpid()}", "ut-fb", LAYOUT, 64, nixl=False)
    try:
        for i in range(8):
            a.pool.put(h(i), payload(i))
        controls: dict[Location, LocalControl] = {node_location("ut-fa"): LocalControl(a), node_location("ut-fb"): LocalControl(b)}
        shm_b = ShmTransport("ut-fb")
        fetcher = PeerFetcher(
            "ut-fb", a.pool.config.namespace, controls.get,
            {"shm": shm_b, "nixl": transports["nixl"], "objstore": transports["objstore"]},
        )
        loc = node_location("ut-fa")
        match = build_match([{loc: Tier.HOST}] * 8 + [{}])
        dest = np.zeros((9, B), np.uint8)
        res = fetcher.fetch([h(i) for i in range(9)], list(dest), match=match, keep_local=True)
        assert res.prefix_ok == 8 and res.reasons() == {MISSING: 1}
        assert set(res.served_by[:8]) == {f"{loc}/objstore"}
        assert res.kept_local == 8 and all(h(i) in b.pool for i in range(8))
        assert all(np.array_equal(dest[i], payload(i)) for i in range(8))
        consistent(a)
        consistent(b)
        # next time node B serves itself over shared memory
        res2 = fetcher.fetch([h(i) for i in range(8)], list(dest[:8]), match=build_match([{loc: Tier.HOST, node_location("ut-fb"): Tier.HOST}] * 8))
        assert res2.ok and set(res2.served_by) == {f"{node_location('ut-fb')}/shm"}
        shm_b.close()
    finally:
        for s in (a, b):
            s.close()
            s.pool.close()


@pytest.mark.parametrize(("shared_epochs", "straight"), [(True, False), (False, False), (True, True)])
def test_shm_read_whose_lease_expired_during_the_copy_is_a_miss(shared_epochs: bool,
                                                                straight: bool) -> None:
    """The epoch re-check: leases expire mid-copy and the slots are reused -> slot_reused.

    With shared epochs the reader checks them itself; without, the pool's ``finish`` reply says.
    ``straight``: the slots are copied by the caller's ``copy`` (slab -> its own memory, as
    vLLM's pages are loaded), and the check after that copy still catches the reuse.
    """
    import dataclasses

    from kvshare.pool.tiered import TieredBlockPool
    from kvshare.pool.types import PoolConfig, TierSpec

    now = [0.0]
    ns = f"ue{os.getpid()}"
    slab = HostSlab(B, 4, f"kvshare-{ns}-ut-e-0")
    pool = TieredBlockPool(
        PoolConfig(ns, LAYOUT, (TierSpec(Tier.HOST, 4 * B),), lease_ttl_s=1.0),
        {Tier.HOST: slab}, clock=lambda: now[0],
    )
    src = BlockServer(pool, "ut-e", nixl=False)

    class SlowReader(LocalControl):
        def prepare_read(self, hashes: Sequence[BlockHash], holder: str, ttl_s: float) -> Reply[SlotReply]:
            prep = super().prepare_read(hashes, holder, ttl_s).get(0)
            if not shared_epochs:
                assert prep.slab is not None
                prep = dataclasses.replace(prep, slab=dataclasses.replace(prep.slab, epochs=""))
            now[0] += 100.0  # the reader stalled past its lease: it expired...
            for i in range(4):  # ...and writers reused every slot before the copy ended
                pool.put(h(100 + i), payload(100 + i))
            return Ready(prep)

    try:
        for i in range(4):
            assert pool.put(h(i), payload(i))
        dest = np.zeros((2, B), np.uint8)
        got: list[int] = []
        shm = ShmTransport("ut-e")
        copy = (lambda rows, pos, slots: got.extend(pos)) if straight else None
        res = shm.wait(shm.submit_read(SlowReader(src), [h(0), h(1)], list(dest), deadline_s=5.0,
                                       copy=copy))
        assert res.misses() == {h(0): SLOT_REUSED, h(1): SLOT_REUSED}
        assert got == ([0, 1] if straight else [])
        assert pool.stats()["active_leases"] == 0
    finally:
        src.close()
        pool.close()


def test_fetch_tries_another_holder_when_the_first_is_dead(transports: dict[str, Transport]) -> None:
    ns = f"ug{os.getpid()}"
    alive = make_local_source(ns, "ut-ga", LAYOUT, 16, nixl=True)
    try:
        for i in range(4):
            alive.pool.put(h(i), payload(i))
        dead, good = node_location("ut-gz"), node_location("ut-ga")
        controls = {good: LocalControl(alive)}  # ut-gz's pool is gone: no control
        fetcher = PeerFetcher("ut-gb", ns, controls.get, {"nixl": transports["nixl"], "objstore": transports["objstore"]})
        dest = np.zeros((4, B), np.uint8)
        res = fetcher.fetch([h(i) for i in range(4)], list(dest), match=build_match([{dead: Tier.HOST, good: Tier.HOST}] * 4))
        assert res.ok and set(res.served_by) == {f"{good}/nixl"}
        assert all(np.array_equal(dest[i], payload(i)) for i in range(4))
        consistent(alive)
    finally:
        alive.close()
        alive.pool.close()


def test_probe_measures_and_overrides(source: BlockServer, transports: dict[str, Transport]) -> None:
    dest = np.zeros((4, B), np.uint8)
    measured = probe(transports, LocalControl(source), list(dest), repeats=2)
    assert set(measured) == set(NAMES) and all(v > 0 for v in measured.values())
    bw = TransportBandwidths(measured, overrides={"objstore": 1e15})
    assert bw.rank(NAMES)[0] == "objstore" and bw.get("nixl") == measured["nixl"]
    with pytest.raises(ValueError, match=">= 0"):
        TransportBandwidths({}, {"nixl": -1.0})
    assert parse_overrides("nixl=10, objstore=1.5") == {"nixl": 10e9, "objstore": 1.5e9}
    with pytest.raises(ValueError, match="transport=GBps"):
        parse_overrides("nixl:10")
    consistent(source)


def test_node_measures_its_peers_and_config_overrides_win() -> None:
    """Node A's TransferService probes itself (shm) and node B (nixl, objstore)."""
    a = TransferService("ut-pa", bandwidth_overrides={"objstore": 123.0})
    b = TransferService("ut-pb")
    pools = [make_local_pool(f"up{os.getpid()}", n, LAYOUT, 16) for n in ("ut-pa", "ut-pb")]
    try:
        sa, sb = a.add_pool(pools[0]), b.add_pool(pools[1])
        got = a.measure(f"up{os.getpid()}", {"ut-pa": LocalControl(sa), "ut-pb": LocalControl(sb)})
        assert got["shm"] > 0 and got["nixl"] > 0 and got["objstore"] == 123.0
        assert a.per_node["ut-pb"]["objstore"] > 0 and set(a.per_node["ut-pa"]) == {"shm"}
        consistent(sa)
        consistent(sb)
    finally:
        a.close()
        b.close()
        for p in pools:
            p.close()


class CountingControl(LocalControl):
    """LocalControl counting the pool round trips a reader waits on (prepare_read)."""

    def __init__(self, source: BlockServer) -> None:
        super().__init__(source)
        self.prepares = 0

    def prepare_read(self, hashes: Sequence[BlockHash], holder: str, ttl_s: float,
                     verify: bool = False, nixl: bool = False) -> Reply[SlotReply]:
        self.prepares += 1
        return super().prepare_read(hashes, holder, ttl_s, verify, nixl)


def test_blocks_whose_slots_are_known_are_read_with_no_round_trip() -> None:
    """What a transport wrote (committed) or read before, it reads again with no pool call:
    the same bytes, counted as hits by the pool (touch); once the pool gives a slot to another
    block the read goes the usual way and is still right (a miss, or the block re-learned)."""
    src = make_local_source(f"uk{os.getpid()}", "ut-k", LAYOUT, 4, nixl=False)
    ctl = CountingControl(src)
    shm = ShmTransport("ut-k")
    try:
        mine = [h(i, 7) for i in range(3)]
        assert shm.write(ctl, mine, [payload(i) for i in range(3)]).ok
        hits = src.pool.stats()["tiers"]["host"]["hits"]
        dest = np.zeros((3, B), np.uint8)
        res = shm.read(ctl, mine, list(dest))
        assert res.ok and ctl.prepares == 0 and shm.fast_reads == 1
        assert all((dest[i] == payload(i)).all() for i in range(3))
        assert src.pool.stats()["tiers"]["host"]["hits"] == hits + 3
        src.pool.put(h(9, 7), payload(9))  # another writer's block: learned on first read
        assert shm.read(ctl, [h(9, 7)], [np.zeros(B, np.uint8)]).ok and ctl.prepares == 1
        assert shm.read(ctl, [h(9, 7)], [np.zeros(B, np.uint8)]).ok and ctl.prepares == 1
        for i in range(4):  # four new blocks in a 4-slot pool: every known slot reused
            src.pool.put(h(20 + i, 7), payload(20 + i))
        dest[:] = 0
        res = shm.read(ctl, mine, list(dest))
        assert ctl.prepares == 2 and set(res.misses()) == set(mine)  # evicted: misses, no bytes
        consistent(src)
    finally:
        shm.close()
        src.close()
        src.pool.close()


def test_a_known_slot_reused_during_the_copy_is_read_the_usual_way() -> None:
    """The epoch check after the copy: a slot given to another block while a known-slot read
    copies it sends the batch the usual way, so the caller gets the right bytes or a miss,
    never the other block's."""
    src = make_local_source(f"ur{os.getpid()}", "ut-r", LAYOUT, 2, nixl=False)
    ctl = CountingControl(src)
    shm = ShmTransport("ut-r")
    try:
        ours = [h(1, 8), h(2, 8)]
        assert shm.write(ctl, ours, [payload(1), payload(2)]).ok
        reused: list[int] = []

        def copy(rows: np.ndarray, positions: list[int], slots: list[int]) -> None:
            if not reused:  # the first (known-slot) copy: writers take both slots meanwhile
                reused.extend(slots)
                src.pool.put(h(3, 8), payload(3))
                src.pool.put(h(4, 8), payload(4))
        res = shm.wait(shm.submit_read(ctl, ours, list(np.zeros((2, B), np.uint8)),
                                       deadline_s=5.0, copy=copy))
        assert reused and ctl.prepares == 1 and shm.fast_reads == 0
        assert set(res.misses()) == set(ours)
        consistent(src)
    finally:
        shm.close()
        src.close()
        src.pool.close()


HOLD_EPOCHS = """
import sys, time
from kvshare.transfer.epochs import SharedEpochs
e = SharedEpochs(sys.argv[1], 4, create=True, directory=sys.argv[2])
print("created", flush=True)
time.sleep(60)
"""


def test_a_reader_tells_a_dead_pool_from_a_live_one_by_its_epochs_file(tmp_path: Path) -> None:
    """The creator's lock on its epochs file lives exactly as long as its process: a killed
    pool (SIGKILL, no clean-up) reads as dead at once, so known-slot reads stop there."""
    import signal
    import subprocess

    from kvshare.transfer.epochs import SharedEpochs

    name = f"kvshare-live{os.getpid()}-n-0.epochs"
    pool = subprocess.Popen([sys.executable, "-c", HOLD_EPOCHS, name, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert pool.stdout is not None and pool.stdout.readline().strip() == "created"
        reader = SharedEpochs(name, 4, create=False, directory=str(tmp_path))
        assert reader.owner_alive() and reader.owner_alive()  # (the test leaves no lock behind)
        pool.send_signal(signal.SIGKILL)
        pool.wait()
        assert not reader.owner_alive()
        reader.close()
    finally:
        pool.kill()
        pool.wait()
