"""GlobalIndex without Ray: matching, tiers, generations, sequence gaps, drops, workers."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.actors.index.arrow_io import read_snapshot, write_snapshot
from kvshare.actors.index.global_index import GlobalIndex
from kvshare.events import AllCleared, BlockRemoved, BlockStored, events_to_arrow
from kvshare.match import build_match
from kvshare.types import BlockHash, Location, Tier
from kvshare.workers import WorkerInfo, WorkerLoad

A, B = Location("node:a"), Location("node:b")


def hashes(n: int, salt: str = "p") -> list[BlockHash]:
    return [BlockHash(hashlib.sha256(f"{salt}{i}".encode()).digest()) for i in range(n)]


class Publisher:
    """A pool's event stream: one location, one generation, consecutive seqs."""

    def __init__(self, index: GlobalIndex, loc: Location, ns: str = "m") -> None:
        self.index, self.loc, self.ns = index, loc, ns
        self.gen = index.new_generation(loc)
        self.seq = 0

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def stored(self, hs: list[BlockHash], tier: Tier = Tier.HOST) -> list[BlockStored]:
        return [BlockStored(self.ns, self.loc, tier, h, self.gen, self._next()) for h in hs]

    def removed(self, hs: list[BlockHash], tier: Tier = Tier.HOST) -> list[BlockRemoved]:
        return [BlockRemoved(self.ns, self.loc, tier, h, self.gen, self._next()) for h in hs]

    def send(self, events: list) -> object:  # type: ignore[type-arg]
        return self.index.apply_arrow(events_to_arrow(events))


@pytest.fixture
def index() -> GlobalIndex:
    idx = GlobalIndex()
    idx.declare_namespace("m")
    return idx


def test_two_nodes_prefixes_and_tiers(index: GlobalIndex) -> None:
    hs = hashes(10)
    a, b = Publisher(index, A), Publisher(index, B)
    a.send(a.stored(hs[:6]))
    b.send(b.stored(hs[:3], Tier.DISK) + b.stored(hs[4:8]))
    m = index.match("m", hs)
    assert m.num_blocks == 10 and m.combined_prefix == 8
    assert m.prefix_for(A) == 6 and m.locations[A].tier_counts == {Tier.HOST: 6}
    assert m.prefix_for(B) == 3 and m.locations[B].tier_counts == {Tier.DISK: 3}
    assert m.locations[B].tiers[3] is None and m.locations[B].tiers[4] == Tier.HOST
    assert m.usable_prefix([A, B]) == 8
    assert m == build_match(index.lookup("m", hs))


def test_demotion_keeps_the_new_tier_and_wrong_tier_removal_is_ignored(index: GlobalIndex) -> None:
    hs = hashes(3)
    a = Publisher(index, A)
    a.send(a.stored(hs))
    a.send(a.stored(hs[:1], Tier.DISK) + a.removed(hs[:1], Tier.HOST))  # demoted
    assert index.lookup("m", hs[:1]) == [{A: Tier.DISK}]
    a.send(a.removed(hs[1:2], Tier.DISK))  # it is on host: ignored
    assert index.lookup("m", hs[1:2]) == [{A: Tier.HOST}]
    a.send(a.removed(hs[2:], Tier.HOST))
    assert index.match("m", hs).combined_prefix == 2
    assert index.lookup("m", hs[2:]) == [{}]


def test_events_of_an_older_generation_are_ignored(index: GlobalIndex) -> None:
    hs = hashes(4)
    old = Publisher(index, A)
    late = old.stored(hs[2:])  # still in flight when the pool restarts
    old.send(old.stored(hs[:2]))
    new = Publisher(index, A)  # restart: new generation, old entries dropped
    assert new.gen > old.gen
    assert index.match("m", hs).combined_prefix == 0
    ack = old.send(late)
    assert ack.stale == 2 and ack.applied == 0  # type: ignore[attr-defined]
    new.send(new.stored(hs[:1]))
    assert index.lookup("m", hs[:3]) == [{A: Tier.HOST}, {}, {}]


def test_sequence_gap_asks_for_resync_and_inventory_replaces(index: GlobalIndex) -> None:
    hs = hashes(6)
    a = Publisher(index, A)
    a.send(a.stored(hs[:2]))
    a.stored(hs[2:3])  # lost on the way
    ack = a.send(a.stored(hs[3:4]))
    assert ack.resync == (("m", A),)  # type: ignore[attr-defined]
    inventory = events_to_arrow(BlockStored("m", A, Tier.HOST, h, a.gen, 0) for h in hs[:4])
    assert index.replace_inventory(A, a.gen, inventory, a.seq)
    assert not index.needs_resync("m", A)
    assert index.match("m", hs).prefix_for(A) == 4
    dup = BlockStored("m", A, Tier.HOST, hs[5], a.gen, a.seq)  # already covered: duplicate
    assert index.apply([dup]).applied == 0
    ack = a.send(a.stored(hs[4:5]))
    assert ack.resync == () and index.match("m", hs).prefix_for(A) == 5  # type: ignore[attr-defined]


def test_stale_inventory_is_refused(index: GlobalIndex) -> None:
    old = Publisher(index, A)
    Publisher(index, A)
    inv = events_to_arrow([BlockStored("m", A, Tier.HOST, hashes(1)[0], old.gen, 0)])
    assert not index.replace_inventory(A, old.gen, inv, 1)
    assert index.locations() == {}


def test_drop_location_and_node_with_its_workers(index: GlobalIndex) -> None:
    hs = hashes(4)
    a, b = Publisher(index, A), Publisher(index, B)
    a.send(a.stored(hs))
    b.send(b.stored(hs))
    gen = index.register_worker(WorkerInfo("w1", "a", ("m",)))
    wloc = Location("worker:w1")
    index.apply([BlockStored("m", wloc, Tier.GPU, h, gen, i + 1) for i, h in enumerate(hs)])
    assert index.drop_node("a") == 8
    assert set(index.match("m", hs).locations) == {B}
    assert index.workers() == []
    late = a.stored(hs)  # the dead pool's last events arrive late: ignored
    assert a.send(late).stale == 4  # type: ignore[attr-defined]
    assert index.drop_location(B, up_to_generation=b.gen - 1) == 0  # B restarted since: kept
    assert index.drop_location(B, up_to_generation=b.gen) == 4
    assert index.match("m", hs).combined_prefix == 0


def test_all_cleared(index: GlobalIndex) -> None:
    hs = hashes(3)
    a, b = Publisher(index, A), Publisher(index, B)
    a.send(a.stored(hs))
    b.send(b.stored(hs))
    index.apply([AllCleared("m", A, a.gen, a.seq + 1)])
    assert set(index.match("m", hs).locations) == {B}


def test_bad_input_is_refused_and_changes_nothing(index: GlobalIndex) -> None:
    hs = hashes(2)
    a = Publisher(index, A)
    a.send(a.stored(hs))
    before = index.stats()
    with pytest.raises(KeyError, match="known: \\['m'\\]"):
        index.match("nope", hs)
    with pytest.raises(ValueError, match="32-byte"):
        index.match("m", [hs[0], b"short"])
    with pytest.raises(ValueError, match="list of block hashes"):
        index.match("m", hs[0])
    with pytest.raises(ValueError, match="malformed"):
        index.new_generation("pool-a")
    with pytest.raises(ValueError, match="32-byte hashes, not 16"):
        index.declare_namespace("m", hash_size=16)
    with pytest.raises(ValueError, match="RecordBatch"):
        index.apply_arrow({"hash": hs})  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="unknown namespace"):
        index.register_worker(WorkerInfo("w", "a", ("other",)))
    with pytest.raises(ValueError, match="worker_id"):
        index.register_worker(WorkerInfo("", "a", ("m",)))
    assert index.stats() == before


def test_worker_lease_expires_and_drops_its_entries() -> None:
    now = [0.0]
    index = GlobalIndex(worker_ttl_s=1.0, clock=lambda: now[0])
    index.declare_namespace("m", layout_fingerprint="L1")
    with pytest.raises(ValueError, match="layout"):
        index.register_worker(WorkerInfo("w1", "n1", ("m",), layout_fingerprint="L2"))
    gen = index.register_worker(WorkerInfo("w1", "n1", ("m",), layout_fingerprint="L1"))
    index.register_worker(WorkerInfo("w2", "n2", ("m",), layout_fingerprint="L1"))
    hs = hashes(2)
    index.apply([BlockStored("m", Location("worker:w1"), Tier.GPU, h, gen, i + 1)
                 for i, h in enumerate(hs)])

    def at(t: float) -> None:  # w2 goes on reporting every 100 ms up to t
        while now[0] < t - 1e-9:
            now[0] = min(t, now[0] + 0.1)
            assert index.report_load(WorkerLoad("w2"))

    at(0.8)
    assert index.report_load(WorkerLoad("w1", queued_prefill_tokens=7))
    at(1.5)  # renewed at 0.8: still alive
    assert index.loads()["w1"].queued_prefill_tokens == 7
    assert index.match("m", hs).prefix_for(Location("worker:w1")) == 2
    at(2.0)
    assert index.match("m", hs).combined_prefix == 0
    assert [w.worker_id for w in index.workers()] == ["w2"]
    assert not index.report_load(WorkerLoad("w1"))
    assert index.stats()["workers_expired"] == 1


def test_a_stalled_index_does_not_expire_the_workers_whose_reports_queued_behind_it() -> None:
    """The index's process got no CPU for 5 leases (a loaded host): the first call it runs
    after that must not find every worker expired, since their reports wait in its queue."""
    now = [0.0]
    index = GlobalIndex(worker_ttl_s=1.0, clock=lambda: now[0])
    index.declare_namespace("m")
    gen = index.register_worker(WorkerInfo("w1", "n1", ("m",)))
    index.register_worker(WorkerInfo("w2", "n2", ("m",)))
    index.apply([BlockStored("m", Location("worker:w1"), Tier.GPU, hashes(1)[0], gen, 1)])
    now[0] = 5.0  # nothing ran since 0.0; a router's call comes first in the queue
    assert sorted(w.worker_id for w in index.workers()) == ["w1", "w2"]
    assert index.report_load(WorkerLoad("w1")) and index.report_load(WorkerLoad("w2"))
    assert index.match("m", hashes(1)).prefix_for(Location("worker:w1")) == 1
    assert index.stats()["lease_stalls"] == 1
    for _ in range(15):  # then w1 died: w2 keeps the index listening, w1 expires on time
        now[0] += 0.1
        assert index.report_load(WorkerLoad("w2"))
    assert [w.worker_id for w in index.workers()] == ["w2"]
    assert index.match("m", hashes(1)).combined_prefix == 0


def test_generations_increase(index: GlobalIndex) -> None:
    gens = [index.new_generation(A) for _ in range(5)]
    assert gens == sorted(set(gens))
    index.drop_location(A)
    assert index.new_generation(A) > gens[-1]


def test_snapshot_parquet_roundtrip(index: GlobalIndex, tmp_path: object) -> None:
    hs = hashes(5)
    a, b = Publisher(index, A), Publisher(index, B)
    a.send(a.stored(hs[:4]))
    b.send(b.stored(hs, Tier.DISK))
    path = f"{tmp_path}/index.parquet"
    write_snapshot(index.snapshot(), path)
    fresh = GlobalIndex()
    assert fresh.load_snapshot(read_snapshot(path)) == 9
    assert fresh.match("m", hs) == index.match("m", hs)
    assert fresh.needs_resync("m", A)  # the owner still has to confirm
    a.send(a.stored(hs[4:]))  # the pool continues where the snapshot left off
    assert isinstance(index.snapshot(), pa.Table)


OPS = st.lists(
    st.tuples(st.sampled_from(["store", "remove", "drop"]), st.integers(0, 2),
              st.integers(0, 7), st.sampled_from([Tier.HOST, Tier.DISK, Tier.GPU])),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.booleans())
def test_match_agrees_with_a_reference_model(ops: list[tuple[str, int, int, Tier]], arrow: bool) -> None:
    index = GlobalIndex()
    index.declare_namespace("m")
    hs = hashes(8, "prop")
    locs = [Location(f"node:n{i}") for i in range(3)]
    pubs = [Publisher(index, loc) for loc in locs]
    model: dict[bytes, dict[Location, Tier]] = {h: {} for h in hs}
    for op, li, hi, tier in ops:
        pub, h = pubs[li], hs[hi]
        if op == "drop":
            index.drop_location(locs[li])
            pubs[li] = Publisher(index, locs[li])
            for holders in model.values():
                holders.pop(locs[li], None)
            continue
        evs = pub.stored([h], tier) if op == "store" else pub.removed([h], tier)
        if arrow:
            pub.send(evs)
        else:
            index.apply(evs)
        if op == "store":
            model[h][locs[li]] = tier
        elif model[h].get(locs[li]) == tier:
            del model[h][locs[li]]
    expected = build_match([model[h] for h in hs])
    assert index.match("m", hs) == expected
    assert index.lookup("m", hs) == [model[h] for h in hs]


def test_bad_event_batches_change_nothing(index: GlobalIndex) -> None:
    hs = hashes(3)
    a = Publisher(index, A)
    good = a.stored(hs[:2])
    bad_tier = events_to_arrow(good).set_column(3, "tier", pa.array(["host", "ssd"]))
    bad_loc = events_to_arrow(good).set_column(2, "location", pa.array(["node:a", "a"]))
    short = events_to_arrow([BlockStored("m", A, Tier.HOST, BlockHash(h[:16]), a.gen, 1)
                             for h in hs[:1]], hash_size=16)
    for batch, why in ((bad_tier, "unknown tiers"), (bad_loc, "malformed"), (short, "32 bytes")):
        with pytest.raises(ValueError, match=why):
            index.apply_arrow(batch)
    assert index.locations() == {} and index.stats()["applied"] == 0


def test_packed_matches_equal_plain_matches(index: GlobalIndex) -> None:
    from kvshare.actors.index.runs import from_runs

    hs = hashes(12)
    a, b = Publisher(index, A), Publisher(index, B)
    a.send(a.stored(hs[:9]))
    b.send(b.stored(hs[2:5], Tier.DISK) + b.stored(hs[:2]))
    assert from_runs(*index.match_packed("m", b"".join(hs), 32)) == index.match("m", hs)
    assert from_runs(*index.match_packed("m", b"", 32)) == index.match("m", [])
    with pytest.raises(ValueError, match="32-byte"):
        index.match_packed("m", b"".join(h[:16] for h in hs), 16)
    with pytest.raises(ValueError, match="32-byte"):
        index.match_packed("m", b"x" * 33, 32)


def test_wire_queries_answer_like_packed_matches_and_refuse_garbage(index: GlobalIndex) -> None:
    from kvshare.actors.index.wire import decode_answers, decode_runs, encode_queries, encode_query

    hs = hashes(12)
    a, b = Publisher(index, A), Publisher(index, B)
    a.send(a.stored(hs[:9]))
    b.send(b.stored(hs[:4], Tier.DISK))
    blob = b"".join(hs)
    packed = index.match_packed("m", blob, 32)
    assert decode_runs(index.match_query(encode_query("m", blob, 32))) == packed
    queries = [encode_query("m", blob, 32), encode_query("m", blob[:96], 32), encode_query("m", b"", 32)]
    assert decode_answers(index.match_queries(encode_queries(queries))) == [
        packed, index.match_packed("m", blob[:96], 32), index.match_packed("m", b"", 32)]
    assert decode_answers(index.match_queries(b"")) == []
    with pytest.raises(KeyError, match="unknown namespace"):
        index.match_query(encode_query("nope", blob, 32))
    for bad, why in ((b"", "match query"), (b"\x20\xff\x00m", "truncated"),
                     (encode_query("m", blob[:40], 32), "32-byte"), ("m", "match query")):
        with pytest.raises(ValueError, match=why):
            index.match_query(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="truncated"):
        index.match_queries(encode_queries(queries)[:-5] + b"\xff\xff\xff\x7f")


def test_index_service_warm_starts_from_its_snapshot(tmp_path: object) -> None:
    from kvshare.actors.config import IndexConfig
    from kvshare.actors.index.actor import IndexService

    cfg = IndexConfig(snapshot_path=f"{tmp_path}/index.parquet")
    first = IndexService(cfg)
    first.declare_namespace("m")
    a = Publisher(first, A)
    hs = hashes(6)
    a.send(a.stored(hs))
    assert first.save_snapshot() == 6
    second = IndexService(cfg)  # a restart: new epoch, same entries until the pools confirm
    assert second.epoch != first.epoch
    assert second.match("m", hs) == first.match("m", hs)
    assert second.needs_resync("m", A)
