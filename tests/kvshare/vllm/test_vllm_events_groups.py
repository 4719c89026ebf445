"""KV events of an engine with several KV-cache groups (a sliding-window hybrid under vLLM's
hybrid allocator) -> share blocks, without an engine: vLLM's own event classes and encoder.
A share block is resident in a tier only while every KV group holds it there."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm")
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvshare.hasher import Hasher  # noqa: E402
from kvshare.hashing import block_hashes, namespace_root  # noqa: E402
from kvshare.types import Tier  # noqa: E402
from kvshare.vllm.events.groups import GroupedShareBlocks  # noqa: E402
from kvshare.vllm.events.wire import (  # noqa: E402
    AllPagesCleared,
    PagesRemoved,
    PagesStored,
    decode_batch,
)

PAGE, BLOCK = 32, 64  # 2 vLLM pages per share block
TOKENS = list(range(1000, 1000 + 8 * PAGE))  # 4 share blocks
PAGES = [10_000 + i for i in range(8)]  # vLLM's page hashes: the same in every group
SLIDING = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128}
FULL = {"kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None}


def stored(group: int, first: int, n: int, medium: str = "GPU", **spec: Any) -> BlockStored:
    return BlockStored(block_hashes=PAGES[first:first + n],
                       parent_block_hash=PAGES[first - 1] if first else None,
                       token_ids=TOKENS[first * PAGE:(first + n) * PAGE], block_size=PAGE,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group, **spec)


def apply(sb: GroupedShareBlocks, *events: object) -> list[tuple[bytes, Tier | None, Tier | None]]:
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=list(events)))
    out: list[tuple[bytes, Tier | None, Tier | None]] = []
    for ev in decode_batch(payload)[1]:
        if isinstance(ev, PagesStored):
            out += sb.stored(ev)
        elif isinstance(ev, PagesRemoved):
            out += sb.removed(ev)
        elif isinstance(ev, AllPagesCleared):
            out += sb.cleared()
    return out


def shares() -> list[bytes]:
    return [bytes(h) for h in block_hashes(namespace_root("m", "l", ""), TOKENS, BLOCK)]


def tracker() -> GroupedShareBlocks:
    return GroupedShareBlocks(Hasher("m", "l", BLOCK), PAGE)


def test_the_group_fields_are_decoded() -> None:
    ev = decode_batch(msgspec.msgpack.Encoder().encode(
        KVEventBatch(ts=1.0, events=[stored(1, 0, 2, **SLIDING)])))[1][0]
    assert isinstance(ev, PagesStored)
    assert (ev.group_idx, ev.spec_kind, ev.sliding_window) == (1, "sliding_window", 128)


def test_a_block_is_resident_only_while_every_group_holds_it() -> None:
    sb, h = tracker(), shares()
    # vLLM's hybrid order for Gemma 2: group 0 sliding, group 1 full; one batch per step
    got = apply(sb, stored(0, 0, 8, **SLIDING), stored(1, 0, 8, **FULL))
    net = {}
    for share, _old, new in got:  # (the first batch learns the groups: group 0's go, come back)
        net[share] = new
    assert net == dict.fromkeys(h, Tier.GPU) == sb.inventory()
    assert sb.counters["kv_cache_groups"] == 2
    got = apply(sb, stored(0, 0, 8, **SLIDING), stored(1, 0, 8, **FULL))  # known pages: no change
    assert got == []
    # the sliding group evicts the pages of block 0 (behind its window): block 0 leaves
    got = apply(sb, BlockRemoved(block_hashes=PAGES[:1], medium="GPU", group_idx=0))
    assert got == [(h[0], Tier.GPU, None)]
    assert set(sb.inventory()) == set(h[1:])
    # the full group's removal of the same block changes nothing more
    assert apply(sb, BlockRemoved(block_hashes=PAGES[:2], medium="GPU", group_idx=1)) == []


def test_the_slowest_group_sets_the_tier() -> None:
    sb, h = tracker(), shares()
    apply(sb, stored(0, 0, 4, **SLIDING), stored(1, 0, 4, **FULL))
    assert sb.inventory() == {h[0]: Tier.GPU, h[1]: Tier.GPU}
    # vLLM's CPU offload holds the full group's pages too; the GPU drops the sliding ones
    apply(sb, stored(0, 0, 4, medium="CPU", **SLIDING), stored(1, 0, 4, medium="CPU", **FULL))
    got = apply(sb, BlockRemoved(block_hashes=PAGES[:4], medium="GPU", group_idx=0))
    assert sorted(got) == sorted([(h[0], Tier.GPU, Tier.HOST), (h[1], Tier.GPU, Tier.HOST)])


def test_a_group_seen_later_takes_back_what_one_group_published() -> None:
    sb, h = tracker(), shares()
    got = apply(sb, stored(1, 0, 2, **FULL))  # one group only so far: its blocks count
    assert got == [(h[0], None, Tier.GPU)]
    got = apply(sb, stored(0, 2, 2, **SLIDING))  # a second group that lacks block 0
    assert got == [(h[0], Tier.GPU, None)]
    assert sb.inventory() == {}


def test_groups_without_kv_are_not_required_and_clear_empties_all() -> None:
    sb, h = tracker(), shares()
    mamba = {"kv_cache_spec_kind": "mamba", "kv_cache_spec_sliding_window": None}
    apply(sb, stored(1, 0, 2, **mamba))
    got = apply(sb, stored(0, 0, 2, **FULL))
    assert got == [(h[0], None, Tier.GPU)] and sb.counters["other_group_pages"] == 2
    apply(sb, stored(2, 0, 4, **SLIDING))  # a second KV group: required from now on
    assert set(sb.inventory()) == {h[0]}
    apply(sb, stored(0, 2, 2, **FULL))
    apply(sb, BlockRemoved(block_hashes=PAGES[:1], medium="GPU", group_idx=2))
    assert set(sb.inventory()) == {h[1]}
    assert apply(sb, AllBlocksCleared()) == [(h[1], Tier.GPU, None)]
    assert sb.inventory() == {} and len(sb) == 0


def test_pages_removed_before_any_share_block_is_made_of_them() -> None:
    sb = tracker()
    apply(sb, stored(0, 0, 1, **FULL))  # one page: half a share block
    assert apply(sb, BlockRemoved(block_hashes=PAGES[:1], medium="GPU", group_idx=0)) == []
    assert sb.num_pages() == 0
