"""Property tests (hypothesis state machine) for TieredBlockPool's invariants:
never over capacity, committed blocks read back identical, pinned blocks never evicted,
every block in exactly one tier, and leases that always end."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from pool_helpers import BB, FakeClock, data, h, make_pool

from kvshare.pool.types import AlreadyPresent, InFlightWrite, NoSpace, ReadLease, Reserved

HOST_SLOTS, DISK_SLOTS, TTL = 2, 3, 10.0
blocks = st.integers(0, 6)
holders = st.sampled_from(["w1", "w2"])


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvs-prop-")
        self.clock = FakeClock()
        self.pool = make_pool(Path(self.dir), host=HOST_SLOTS, disk=DISK_SLOTS, clock=self.clock,
                              lease_ttl_s=TTL, demote_min_hits=0)
        self.reserved: dict[int, tuple[int, str, float]] = {}  # lease -> (block, holder, deadline)
        self.pins: dict[int, tuple[int, str, float]] = {}
        self.leases: dict[int, ReadLease] = {}

    def teardown(self) -> None:
        self.pool.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _alive(self, table: dict[int, tuple[int, str, float]]) -> dict[int, tuple[int, str, float]]:
        now = self.clock()
        return {lid: v for lid, v in table.items() if v[2] > now}

    # ------------------------------------------------------------ writes
    @rule(i=blocks)
    def put(self, i: int) -> None:
        if self.pool.put(h(i), data(i)):
            assert h(i) in self.pool

    @rule(ids=st.lists(blocks, min_size=2, max_size=4))
    def put_many(self, ids: list[int]) -> None:
        for i in ids:
            self.put(i)

    @rule(i=blocks, holder=holders)
    def reserve(self, i: int, holder: str) -> None:
        was_present = h(i) in self.pool
        (res,) = self.pool.reserve([h(i)], holder)
        if was_present:
            assert isinstance(res, AlreadyPresent)
        if isinstance(res, Reserved):
            self.reserved[res.lease_id] = (i, holder, self.clock() + TTL)
        else:
            assert isinstance(res, AlreadyPresent | InFlightWrite | NoSpace)

    @precondition(lambda self: self.reserved)
    @rule(pick=st.data())
    def write_and_commit(self, pick: st.DataObject) -> None:
        lid = pick.draw(st.sampled_from(sorted(self.reserved)))
        i, _, deadline = self.reserved.pop(lid)
        if deadline <= self.clock():
            try:
                self.pool.commit([lid])
            except KeyError:
                return
            raise AssertionError("an expired reservation was committed")
        self.pool.write(lid, data(i))
        assert self.pool.commit([lid]) == [h(i)]
        assert h(i) in self.pool

    @precondition(lambda self: self.reserved)
    @rule(pick=st.data())
    def abort(self, pick: st.DataObject) -> None:
        lid = pick.draw(st.sampled_from(sorted(self.reserved)))
        i, _, _ = self.reserved.pop(lid)
        self.pool.abort([lid])
        assert self.pool.tier_of(h(i)) is None or h(i) in self.pool

    # ------------------------------------------------------------ reads
    @rule(i=blocks, holder=holders, promote=st.booleans())
    def pin(self, i: int, holder: str, promote: bool) -> None:
        (lease,) = self.pool.pin([h(i)], holder, promote=promote)
        if lease is not None:
            self.pins[lease.lease_id] = (i, holder, self.clock() + TTL)
            self.leases[lease.lease_id] = lease
            self._read(lease, i)

    def _read(self, lease: ReadLease, i: int) -> None:
        out = np.empty(BB, dtype=np.uint8)
        res = self.pool.read_into(lease, out)
        assert res.ok, res.reason
        assert np.array_equal(out, data(i))  # committed blocks read back identical

    @precondition(lambda self: self._alive(self.pins))
    @rule(pick=st.data())
    def read_pinned(self, pick: st.DataObject) -> None:
        lid = pick.draw(st.sampled_from(sorted(self._alive(self.pins))))
        self._read(self.leases[lid], self.pins[lid][0])

    @precondition(lambda self: self.pins)
    @rule(pick=st.data())
    def unpin(self, pick: st.DataObject) -> None:
        lid = pick.draw(st.sampled_from(sorted(self.pins)))
        del self.pins[lid]
        self.pool.unpin([lid])

    @rule(i=blocks)
    def get(self, i: int) -> None:
        out = self.pool.get(h(i))
        assert out is None or np.array_equal(out, data(i))

    # ------------------------------------------------------------ admin and time
    @rule(seconds=st.floats(0.0, 0.6 * TTL))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(holder=holders)
    def release_holder(self, holder: str) -> None:
        alive = [lid for lid, v in {**self._alive(self.pins), **self._alive(self.reserved)}.items()
                 if v[1] == holder]
        assert self.pool.release_holder(holder) >= len(alive)
        self.pins = {k: v for k, v in self.pins.items() if v[1] != holder}
        self.reserved = {k: v for k, v in self.reserved.items() if v[1] != holder}

    @rule(i=blocks)
    def remove(self, i: int) -> None:
        self.pool.remove([h(i)])

    @rule()
    def clear(self) -> None:
        self.pool.clear()

    @rule()
    def maintain(self) -> None:
        self.pool.maintain()

    # ------------------------------------------------------------ invariants
    @invariant()
    def never_over_capacity(self) -> None:
        tiers = self.pool.stats()["tiers"]
        for name, cap in (("host", HOST_SLOTS), ("disk", DISK_SLOTS)):
            assert tiers[name]["capacity_slots"] == cap
            assert tiers[name]["blocks"] <= tiers[name]["used_slots"] <= cap

    @invariant()
    def nothing_reads_as_corrupt(self) -> None:
        # no fault is injected here, so a checksum failure means the pool mangled bytes
        assert all(t["corrupt"] == 0 for t in self.pool.stats()["tiers"].values())

    @invariant()
    def every_block_in_exactly_one_tier(self) -> None:
        inventory = self.pool.inventory()
        assert len({b for b, _ in inventory}) == len(inventory) == len(self.pool)
        for b, tier in inventory:
            assert self.pool.tier_of(b) == tier

    @invariant()
    def pinned_blocks_are_never_evicted(self) -> None:
        for lid, (i, _, _) in self._alive(self.pins).items():
            assert h(i) in self.pool, f"block {i} is pinned but gone"
            assert self.pool.tier_of(h(i)) == self.leases[lid].tier, f"pinned block {i} moved"

    @invariant()
    def leases_end(self) -> None:
        self.pool.expire_leases()
        alive = len(self._alive(self.pins)) + len(self._alive(self.reserved))
        assert self.pool.stats()["active_leases"] == alive


PoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase
