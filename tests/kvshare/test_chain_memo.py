"""The verified block memo (kvshare._native._chain.ChainMemo behind ``Hasher(memo_blocks=...)``): the
same hashes as the plain chain on every prompt, whatever the memo holds, and the same decisions
from a router that keeps one.

A memoised block is answered only when its parent digest and ids equal a kept block's, so the
tests make the cheap fingerprint useless on purpose (``fingerprint_bits=0``: one set, every
entry a fingerprint collision) and check that the answers still equal the plain chain's.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kvshare import hashing
from kvshare.hasher import Hasher
from kvshare.hashing import _field, block_hashes, namespace_root

ROOT = namespace_root("m", "layout", "")
BT = 16


@pytest.fixture
def memo_type() -> type:
    memo = getattr(hashing._chain, "ChainMemo", None)
    if memo is None:
        pytest.skip("kvshare._native._chain not built (or built before ChainMemo): no memo to check")
    return memo  # type: ignore[no-any-return]


def _conversations(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts sharing system prompts and earlier turns, each with its own tail; some differ
    from an earlier prompt in one id only (first/last of a block, or the partial block)."""
    systems = [[rng.randrange(50_000) for _ in range(rng.choice((BT, 3 * BT, 5 * BT + 3)))]
               for _ in range(4)]
    out: list[list[int]] = []
    for i in range(n):
        if out and i % 5 == 4:  # an earlier prompt with one id changed
            ids = list(rng.choice(out))
            pos = rng.choice([0, BT - 1, BT, len(ids) - 1, len(ids) // 2])
            ids[pos] = (ids[pos] + 1) % 50_000
        elif out and i % 3 == 0:  # the next turn of an earlier prompt
            ids = rng.choice(out) + [rng.randrange(2**32) for _ in range(rng.randrange(1, 3 * BT))]
        else:
            ids = rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randrange(4 * BT))]
        out.append(ids)
    return out


@pytest.mark.parametrize("bits, capacity", [(64, 4096), (64, 8), (0, 64), (3, 16)])
def test_memo_hashes_equal_the_plain_chain(memo_type: type, bits: int, capacity: int) -> None:
    """Shared prefixes, next turns, one-id changes, other parents, eviction (a small memo) and
    fingerprints that all collide (bits 0): every answer is the plain chain's."""
    memo = memo_type(BT, capacity, _field(b""), bits)
    rng = random.Random(bits * 1000 + capacity)
    other = namespace_root("m", "layout", "tenant-b")
    for ids in _conversations(rng, 120):
        for root in (ROOT, other):
            want = block_hashes(root, ids, BT)
            assert memo.chain(bytes(root), ids) == want
            assert memo.chain(bytes(root), tuple(ids)) == want  # and again, from the memo
    stats = memo.stats()
    assert stats["hits"] > 0 and stats["misses"] > 0 and stats["blocks"] <= stats["capacity"]


@pytest.mark.parametrize("bits", [64, 0])
def test_packed_ids_hash_as_the_same_ids_in_a_list(memo_type: type, bits: int) -> None:
    """``chain_packed`` on a numpy uint32 array, an ``array("I")`` and their bytes gives the
    list's chain (sharing one memo with ``chain``, so hits cross the two forms); a buffer whose
    length is not whole u32 ids is refused."""
    import array

    import numpy as np

    memo = memo_type(BT, 64, _field(b""), bits)
    for ids in _conversations(random.Random(11 + bits), 60):
        want = block_hashes(ROOT, ids, BT)
        packed = np.asarray(ids, dtype=np.uint32)
        assert memo.chain_packed(bytes(ROOT), packed) == want
        assert memo.chain_packed(bytes(ROOT), array.array("I", ids)) == want
        assert memo.chain_packed(bytes(ROOT), packed.tobytes()) == want
        assert memo.chain(bytes(ROOT), ids) == want
    assert memo.stats()["hits"] > 0
    with pytest.raises(ValueError, match="4 bytes each"):
        memo.chain_packed(bytes(ROOT), b"\0" * (4 * BT + 1))
    with pytest.raises(ValueError, match="32 bytes"):
        memo.chain_packed(b"short", b"\0" * 4 * BT)


def test_a_kept_block_is_not_taken_for_another_parent_or_ids(memo_type: type) -> None:
    """With every block in one set, a block with the same ids under another parent, and one
    id off under the same parent, are hashed, not answered from the memo."""
    memo = memo_type(BT, 4, _field(b""), 0)
    ids = list(range(BT))
    first = memo.chain(bytes(ROOT), ids)
    other = namespace_root("m", "layout", "x")
    assert memo.chain(bytes(other), ids) == block_hashes(other, ids, BT) != first
    changed = [*ids[:-1], ids[-1] + 1]
    assert memo.chain(bytes(ROOT), changed) == block_hashes(ROOT, changed, BT) != first
    assert memo.stats()["hits"] == 0
    assert memo.chain(bytes(ROOT), ids) == first and memo.stats()["hits"] == 1


def test_memo_refuses_bad_ids_as_the_hasher_does(memo_type: type) -> None:
    """Bad ids are refused whether or not their blocks were kept (the ids are always read)."""
    hasher = Hasher("m", "layout", BT, memo_blocks=64)
    ids = list(range(3 * BT))
    hasher.hashes(ids)
    for bad in ([*ids[:BT], -1, *ids[BT + 1:]], [*ids, 2**32], [*ids[:5], "7", *ids[6:]]):
        with pytest.raises((ValueError, TypeError)) as memo_err:
            hasher.hashes(bad)
        with pytest.raises((ValueError, TypeError)) as plain_err:
            block_hashes(hasher.root, bad, BT)
        assert type(memo_err.value) is type(plain_err.value)
        assert str(memo_err.value) == str(plain_err.value)
    with pytest.raises(ValueError, match="capacity"):
        Hasher("m", "layout", BT, memo_blocks=-1)


def test_hasher_with_memo_equals_without(memo_type: type) -> None:
    """Every input form and option of ``Hasher.hashes`` gives the same hashes with a memo."""
    import array

    import numpy as np

    plain, kept = Hasher("m", "layout", BT), Hasher("m", "layout", BT, memo_blocks=256)
    assert kept.memo is not None and plain.memo is None
    rng = random.Random(7)
    for ids in _conversations(rng, 40):
        assert kept.hashes(ids) == plain.hashes(ids)
        assert kept.hashes(ids, salt="acme") == plain.hashes(ids, salt="acme")
        assert kept.hashes(np.asarray(ids, dtype=np.uint32)) == plain.hashes(ids)
        assert kept.hashes(array.array("I", ids)) == plain.hashes(ids)
        # not packed as little-endian u32 (big-endian, strided, int64): converted, same hashes
        assert kept.hashes(np.asarray(ids, dtype=">u4")) == plain.hashes(ids)
        assert kept.hashes(np.repeat(np.asarray(ids, dtype=np.uint32), 2)[::2]) == plain.hashes(ids)
        assert kept.hashes(np.asarray(ids, dtype=np.int64)) == plain.hashes(ids)
        parent = plain.hashes(ids[:BT])[0] if len(ids) >= BT else None
        assert kept.hashes(ids[BT:], parent=parent) == plain.hashes(ids[BT:], parent=parent)
        extra = [b"lora"] * (len(ids) // BT)
        assert kept.hashes(ids, extra_keys=extra) == plain.hashes(ids, extra_keys=extra)
    assert kept.memo.stats()["hits"] > 0


def test_router_decisions_are_the_same_with_and_without_the_memo(memo_type: type) -> None:
    """Two routers, one keeping a memo: the same prompts get the same hashes and decisions."""
    from kvshare.router.core.embed import CacheAwareRouter, RouterConfig
    from kvshare.router.core.workers_view import StaticWorkers
    from kvshare.types import NodeId, WorkerId
    from kvshare.workers import WorkerInfo

    infos = [WorkerInfo(WorkerId(f"w{i}"), NodeId(f"n{i % 2}"), ("ns",), f"http://w{i}")
             for i in range(4)]
    routers = [CacheAwareRouter(None, StaticWorkers(infos),
                                RouterConfig(namespace="ns", block_tokens=BT, hash_memo_blocks=m))
               for m in (0, 512)]
    assert routers[0].hasher.memo is None and routers[1].hasher.memo is not None

    async def decide(router: CacheAwareRouter, prompts: list[list[int]]) -> list[object]:
        # one clock per router, stepped per decision: the policy's ready blocks, the pending
        # blocks and the in-flight load read the time, which must not differ between the two
        now = [1000.0]
        core = router.core
        core.policy.clock = core.pending._clock = core.inflight._clock = lambda: now[0]
        out = []
        for ids in prompts:
            now[0] += 0.01
            r = await router.route(token_ids=ids)
            out.append((r.hashes, r.decision))
        return out

    prompts = _conversations(random.Random(3), 60)
    got = [asyncio.run(decide(r, prompts)) for r in routers]
    assert got[0] == got[1]
    # the same prompts handed over packed (numpy uint32): the same hashes and decisions
    import numpy as np

    packed_router = CacheAwareRouter(None, StaticWorkers(infos), RouterConfig(
        namespace="ns", block_tokens=BT, hash_memo_blocks=512))
    packed = [np.asarray(ids, dtype=np.uint32) for ids in prompts]
    assert asyncio.run(decide(packed_router, packed)) == got[0]  # type: ignore[arg-type]
    assert routers[1].hasher.memo.stats()["hits"] > 0  # type: ignore[union-attr]


def test_fast_ids_keeps_lists_and_packed_ids_and_packs_other_arrays() -> None:
    """A list and packed ids are kept as they are; a tokenizer's int64 array is packed (same
    hashes), with the conversion's clear errors for ids outside u32 and for a 2-D array."""
    import array

    import numpy as np

    from kvshare.hashing import fast_ids

    ids = [5, 0, 2**32 - 1, 7] * BT
    as_list, u32, arr = list(ids), np.asarray(ids, dtype=np.uint32), array.array("I", ids)
    assert fast_ids(as_list) is as_list and fast_ids(u32) is u32 and fast_ids(arr) is arr
    assert fast_ids(tuple(ids)) == ids and type(fast_ids(tuple(ids))) is list
    wide = fast_ids(np.asarray(ids, dtype=np.int64))
    assert isinstance(wide, np.ndarray) and wide.dtype == np.dtype("<u4")
    hasher = Hasher("m", "layout", BT, memo_blocks=64)
    assert hasher.hashes(wide) == hasher.hashes(ids) == block_hashes(hasher.root, ids, BT)
    with pytest.raises(ValueError, match="-1 is outside"):
        fast_ids(np.asarray([1, -1], dtype=np.int64))
    with pytest.raises(ValueError, match="1-D"):
        fast_ids(np.asarray([ids], dtype=np.int64))
