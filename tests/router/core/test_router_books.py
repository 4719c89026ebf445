"""The router's books in C (``kvshare._native._pending``, ``kvshare._native._ready``) hold and answer exactly as
the Python books they stand in for (``router/pending.py``, ``router/ready.py``: the reference).

Random sequences over one and two namespaces, a small hash pool (blocks recorded again, by
other locations, twice in one call), a clock that stands still or jumps past the TTL, and caps
small enough to evict, and locations forgotten (a worker's cache emptied): after every step
both books have the same size and give the same answers (pending: ``match_runs`` and ``match``; ready: every entry in drop order,
``run_from`` and ``extend``). Where the books are not built these tests skip, unless
``KVSHARE_REQUIRE_NATIVE=1``.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.router.core.pending import PendingBlocks, pending_blocks
from kvshare.router.core.ready import ReadyBlocks, ready_blocks
from kvshare.router.core.sources import SourceRuns
from kvshare.types import BlockHash, Location, Tier, WorkerId

if os.environ.get("KVSHARE_REQUIRE_NATIVE") == "1":  # (as tests/test_cost_scan_native.py)
    import kvshare.router.core.pending_native as pending_native
    import kvshare.router.core.ready_native as ready_native
else:  # the books are optional (setup.py builds them where a C compiler is found)
    pending_native = pytest.importorskip("kvshare.router.core.pending_native")
    ready_native = pytest.importorskip("kvshare.router.core.ready_native")


def test_the_factories_give_the_c_books_where_built() -> None:
    assert isinstance(pending_blocks(), pending_native.NativePending)
    assert isinstance(ready_blocks(), ready_native.NativeReady)
    assert type(pending_blocks(native=False)) is PendingBlocks
    assert type(ready_blocks(native=False)) is ReadyBlocks


def pool_of(seed: int, size: int) -> list[BlockHash]:
    """Block hashes of 32 bytes (and a few of 16, as xxh3's) that share their first bytes."""
    return [BlockHash(bytes([seed % 256, i]) * 8 + (b"" if i % 7 == 0 else bytes(16)))
            for i in range(size)]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(["a", "ab"]), st.sampled_from([5, 30, 1_000_000]))
def test_pending_book_answers_as_the_python_one(seed: int, names: str, cap: int) -> None:
    rng = random.Random(seed)
    now = [100.0]

    def clock() -> float:
        return now[0]

    fast = pending_native.NativePending(5.0, clock, cap)
    ref = PendingBlocks(5.0, clock, cap)
    pool = pool_of(seed, 30)
    locs = [Location(f"worker:w{i}") for i in range(5)]
    for _ in range(80):
        now[0] += rng.choice((0.0, 0.0, 0.01, 0.5, 2.0, 4.99, 6.0))
        start = rng.randrange(len(pool))
        hashes = pool[start:start + rng.randrange(0, 12)]
        if rng.random() < 0.3:  # a prompt that diverges after a shared prefix
            hashes = hashes[:3] + rng.sample(pool, 4)
        if rng.random() < 0.1:  # a block twice in one call
            hashes = hashes + hashes[:2]
        ns, loc = rng.choice(names), rng.choice(locs)
        tier = rng.choice((Tier.GPU, Tier.GPU, Tier.HOST))
        fast.add(ns, loc, hashes, tier)
        ref.add(ns, loc, hashes, tier)
        assert len(fast) == len(ref)
        if rng.random() < 0.15:  # a worker's cache emptied (or one never sent anything)
            gone = rng.choice([*locs, Location("worker:w9")])
            fast.forget(gone)
            ref.forget(gone)
            assert len(fast) == len(ref)
            q = pool[rng.randrange(len(pool)):][:rng.randrange(1, 16)]
            assert all(gone not in (loc for loc, _ in holders)
                       for holders, _ in fast.match_runs(rng.choice(names), q).runs)
        for _ in range(3):
            q = pool[rng.randrange(len(pool)):][:rng.randrange(1, 16)]
            qns = rng.choice("abc")
            assert fast.match_runs(qns, q) == ref.match_runs(qns, q)
            assert fast.match(qns, q) == ref.match(qns, q)
        assert len(fast) == len(ref)


def test_pending_book_defaults_and_clock_as_the_python_one() -> None:
    now = [0.0]
    fast = pending_native.NativePending(2.0, lambda: 0.0)
    fast._clock = lambda: now[0]  # (as tests replace PendingBlocks._clock)
    h = [BlockHash(b"x" * 32), BlockHash(b"y" * 32)]
    fast.add("ns", Location("worker:w0"), h)
    assert fast.match_runs("ns", h).runs == [((("worker:w0", Tier.GPU.rank),), 2)]
    now[0] = 2.5  # past the TTL: nothing pending, and the entries are gone
    assert fast.match_runs("ns", h).runs == []
    assert len(fast) == 0
    with pytest.raises(ValueError):
        pending_native.NativePending(0.0)


def held(ready: ReadyBlocks) -> list[tuple[str, bytes, str, float, bool]]:
    """The Python book's entries in the order they are dropped (namespaces merged by call)."""
    rows = [(entry[2], i, ns, h, entry[0], entry[1], entry[3]) for ns, at in ready._at.items()
            for i, (h, entry) in enumerate(at.items())]
    return [(ns, h, w, t, p) for _, _, ns, h, w, t, p in sorted(rows)]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from(["a", "ab"]), st.sampled_from([6, 25, 1_000_000]))
def test_ready_book_answers_as_the_python_one(seed: int, names: str, cap: int) -> None:
    rng = random.Random(seed)
    fast, ref = ready_native.NativeReady(cap), ReadyBlocks(cap)
    pool = pool_of(seed, 24)
    workers = [WorkerId(f"w{i}") for i in range(4)]
    now = 0.0
    for _ in range(60):
        now += rng.choice((0.0, 0.05, 0.3, 1.0))
        ns, w = rng.choice(names), rng.choice(workers)
        start = rng.randrange(len(pool))
        hashes = pool[start:start + rng.randrange(0, 10)]
        if rng.random() < 0.2:  # a hash twice in one call
            hashes = hashes + hashes[:2]
        ready_s = now + rng.choice((0.0, 0.1, 0.5, 2.0))
        stored_from = rng.choice((0, 0, 1, 3, 20, -1))
        fast.add(ns, w, hashes, ready_s, now, stored_from=stored_from)
        ref.add(ns, w, hashes, ready_s, now, stored_from=stored_from)
        assert len(fast) == len(ref)
        assert fast.entries() == held(ref)
        if rng.random() < 0.15:  # a worker's engine restarted (or one never recorded)
            gone = rng.choice([*workers, WorkerId("w9")])
            fast.forget(gone)
            ref.forget(gone)
            assert fast.entries() == held(ref)
            assert all(entry[2] != gone for entry in fast.entries())
        for _ in range(3):
            q = pool[rng.randrange(len(pool)):][:rng.randrange(1, 12)]
            qns, qw = rng.choice("abc"), rng.choice([*workers, WorkerId("w9")])
            s = rng.randrange(len(q) + 1)
            assert fast.run_from(qns, q, s) == ref.run_from(qns, q, s)
            runs: SourceRuns = rng.choice(((), ((0, 1),), ((4, 2),), ((1, 1), (4, 1))))
            start_s = now + rng.choice((0.0, 0.2, 1.0, 3.0))
            assert fast.extend(runs, qns, q, qw, now, start_s) == ref.extend(
                runs, qns, q, qw, now, start_s)
