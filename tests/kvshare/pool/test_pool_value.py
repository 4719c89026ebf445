"""What each tier is worth: the ledger's window and since-start figures, pricing, verdicts,
and a real pool (host slab + disk files) feeding it through its own reads, writes and moves."""

from __future__ import annotations

from pathlib import Path

import pytest
from pool_helpers import BB, LAYOUT, FakeClock, data, h, make_pool

from kvshare.pool.value import (
    HITS,
    REMOTE,
    TierWorth,
    ValueConfig,
    ValueLedger,
    assess,
    namespace_worth,
    verdict,
)


def ledger(clock: FakeClock) -> ValueLedger:
    return ValueLedger(["host", "disk", REMOTE], ValueConfig(window_s=300.0, buckets=30), clock)


def test_the_window_forgets_what_the_total_keeps() -> None:
    clock = FakeClock()
    v = ledger(clock)
    v.add("disk", HITS, 5)
    v.moved("disk", 4 * BB, 0.5, into=True)
    clock.advance(200)
    v.add("disk", HITS, 2)
    fig = v.figures()
    disk = fig["tiers"]["disk"]  # type: ignore[index]
    assert disk["window"]["hits"] == 7 and disk["total"]["hits"] == 7
    assert disk["window"]["write_s"] == 0.5 and disk["window"]["bytes_in"] == 4 * BB
    clock.advance(150)  # 350 s after the first figures: only the second hits are in the window
    fig = v.figures()
    disk = fig["tiers"]["disk"]  # type: ignore[index]
    assert disk["window"] == {"lookups": 0, "hits": 2, "bytes_in": 0, "write_s": 0,
                              "bytes_out": 0, "read_s": 0}
    assert disk["total"]["hits"] == 7 and disk["total"]["write_s"] == 0.5
    assert fig["since_s"] == 350 and 290 <= fig["window_s"] <= 300  # type: ignore[operator]
    clock.advance(10_000)  # a long idle spell empties the window, not the total
    disk = v.figures()["tiers"]["disk"]  # type: ignore[index]
    assert disk["window"]["hits"] == 0 and disk["total"]["hits"] == 7


def test_a_young_ledger_reports_its_own_age_as_the_window() -> None:
    clock = FakeClock()
    v = ledger(clock)
    clock.advance(42)
    assert v.figures()["window_s"] == 42


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window_s > 0"):
        ValueConfig(window_s=0)
    with pytest.raises(ValueError, match="buckets >= 2"):
        ValueConfig(buckets=1)


def test_saved_seconds_are_tokens_at_the_measured_speed_less_time_spent() -> None:
    counts = {"lookups": 1000, "hits": 4, "bytes_in": 10 * BB, "write_s": 31.0,
              "bytes_out": 0, "read_s": 0.0}
    w = assess("disk", counts, lookups=1000, block_tokens=50, prefill_tokens_per_s=1000)
    assert w.tokens == 200 and w.saved_s == pytest.approx(0.2) and w.hit_share == 0.004
    assert w.net_s == pytest.approx(0.2 - 31.0)
    assert verdict(w) == ("disk: 0.4% of lookups hit, 0.2 s saved, 31 s spent writing: "
                          "consider --disk-gb 0 or a larger host tier (--host-gb)")
    unknown = assess("disk", counts, 1000, 50, prefill_tokens_per_s=0)
    assert unknown.saved_s is None and unknown.net_s is None and verdict(unknown) == ""


def test_only_a_busy_tier_that_does_not_pay_is_flagged() -> None:
    paying = TierWorth("disk", 800, 0.5, 0.8, 0.3, 0.1, BB, BB)
    assert paying.net_s == pytest.approx(0.4) and verdict(paying) == ""
    idle = TierWorth("disk", 0, 0.0, 0.0, 0.0, 0.0, 0, 0)
    assert verdict(idle) == ""  # nothing happened: nothing to judge
    even = TierWorth("host", 0, 0.0, 0.0, 0.0, 0.0, BB, 0)  # written, never read: net 0
    assert verdict(even).startswith("host: 0.0% of lookups hit, 0 s saved, 0 s spent writing: "
                                    "consider a smaller --host-gb")
    pulls = TierWorth(REMOTE, 16, 0.1, 0.01, 0.0, 0.5, 0, BB)
    assert verdict(pulls).startswith("remote: 10.0% of lookups hit, 0.01 s saved, 0.5 s spent "
                                     "reading: pulls cost more than recomputing")


def test_a_real_pool_charges_moves_to_the_lower_tier(tmp_path: Path) -> None:
    """Host 2 slots, disk 8: four blocks stored, two demoted (disk writes, timed), one read
    back (a disk hit; the promotion is a timed disk read), one missed; lookups are the
    block uses (4 stores, 2 pins)."""
    clock = FakeClock()
    pool = make_pool(tmp_path, host=2, disk=8, clock=clock)
    for i in range(4):
        assert pool.put(h(i), data(i))
    assert pool.tier_of(h(0)).value == "disk"  # type: ignore[union-attr]
    (lease,) = pool.pin([h(0)], "r", promote=True)
    assert lease is not None
    pool.unpin([lease.lease_id])
    assert pool.pin([h(99)], "r") == [None]
    value = pool.stats()["value"]
    host, disk = value["tiers"]["host"]["total"], value["tiers"]["disk"]["total"]
    assert host["lookups"] == 6 and disk["hits"] == 1 and host["hits"] == 0
    assert host["bytes_in"] == 4 * BB and host["write_s"] > 0  # put() copies into the slab
    # 2 demoted on the way in, 1 more to make room for the promotion: 3 disk writes
    assert disk["bytes_in"] == 3 * BB and disk["write_s"] > 0
    assert disk["bytes_out"] == BB and disk["read_s"] > 0
    worth = namespace_worth(value, LAYOUT.block_tokens, prefill_tokens_per_s=1600)
    assert worth["disk"]["total"].tokens == 16 and worth["disk"]["total"].saved_s == 0.01
    assert worth["disk"]["total"].hit_share == 1 / 6
    pool.close()


def test_remote_readers_count_as_remote_pulls(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, host=4)
    pool.put(h(1), data(1))
    (lease,) = pool.pin([h(1)], "peer", remote=True)
    assert lease is not None
    assert pool.read_into(lease, bytearray(BB), remote=True).ok
    pool.unpin([lease.lease_id])
    pool.note_pull(0.25)
    tiers = pool.stats()["value"]["tiers"]
    assert tiers[REMOTE]["total"]["hits"] == 1 and tiers["host"]["total"]["hits"] == 0
    assert tiers[REMOTE]["total"]["bytes_out"] == BB and tiers[REMOTE]["total"]["read_s"] >= 0.25
    assert tiers["host"]["total"]["lookups"] == 2  # the store, the pin
    pool.close()
