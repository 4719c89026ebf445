"""KV events of an engine with several KV-cache groups (a sliding-window hybrid under vLLM's
hybrid allocator) -> share blocks, without an engine: vLLM's own event classes and encoder,
the shapes vLLM 0.32 publishes (a sliding group lists only the pages a hit can use, with the
whole token range). A share block is resident only while every group it needs holds it."""

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

PAGE, BLOCK = 32, 64  # 2 vLLM pages per share block; a window of 128 needs 4 pages
TOKENS = list(range(1000, 1000 + 8 * PAGE))  # 4 share blocks
PAGES = [10_000 + i for i in range(8)]  # vLLM's page hashes: the same in every group
SLIDING = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128}
FULL = {"kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None}


def stored(group: int, first: int, n: int, medium: str = "GPU", keep: tuple[int, ...] = (),
           **spec: Any) -> BlockStored:
    """Pages ``first..first+n-1`` cached (``keep``: a sliding group's kept ones only)."""
    hashes = PAGES[first:first + n] if not keep else [PAGES[i] for i in keep]
    return BlockStored(block_hashes=hashes, parent_block_hash=PAGES[first - 1] if first else None,
                       token_ids=TOKENS[first * PAGE:(first + n) * PAGE], block_size=PAGE,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group, **spec)


def removed(group: int, *pages: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=[PAGES[i] for i in pages], medium=medium, group_idx=group)


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


def test_a_prompt_is_resident_while_the_sliding_group_keeps_its_last_window() -> None:
    sb, h = tracker(), shares()
    # Gemma 2 under vLLM's hybrid allocator: group 0 sliding (keeps pages 4-7), group 1 full
    got = apply(sb, stored(0, 0, 8, keep=(4, 5, 6, 7), **SLIDING), stored(1, 0, 8, **FULL))
    assert sorted(got) == sorted((x, None, Tier.GPU) for x in h)
    assert sb.counters["kv_cache_groups"] == 2 and sb.counters["sliding_pages"] == 4
    assert apply(sb, stored(1, 0, 8, **FULL)) == []  # known pages: nothing changes
    # the sliding group evicts a page of the window: no cut is usable any more
    got = apply(sb, removed(0, 4))
    assert sorted(got) == sorted((x, Tier.GPU, None) for x in h)
    # a later window (decode went on: pages 4-7 of a longer chain) makes the prefix usable
    apply(sb, stored(0, 4, 4, keep=(4, 5, 6, 7), **SLIDING))
    assert set(sb.inventory()) == set(h)
    # the full group evicts block 3: the window ending at block 2 is not held (pages 2, 3)
    apply(sb, removed(1, 7))
    assert sb.inventory() == {}


def test_a_short_chain_needs_only_the_pages_it_has() -> None:
    sb, h = tracker(), shares()
    got = apply(sb, stored(0, 0, 2, **SLIDING), stored(1, 0, 2, **FULL))
    assert got == [(h[0], None, Tier.GPU)]  # 64 tokens: inside one window


def test_the_fastest_tier_every_group_holds_is_the_blocks_tier() -> None:
    sb, h = tracker(), shares()
    apply(sb, stored(0, 0, 4, **SLIDING), stored(1, 0, 4, **FULL))
    apply(sb, stored(0, 0, 4, medium="CPU", **SLIDING), stored(1, 0, 4, medium="CPU", **FULL))
    assert sb.inventory() == {h[0]: Tier.GPU, h[1]: Tier.GPU}
    got = apply(sb, removed(0, 0, 1, 2, 3))  # the GPU's sliding pages go; vLLM's CPU keeps all
    assert sorted(got) == sorted([(h[0], Tier.GPU, Tier.HOST), (h[1], Tier.GPU, Tier.HOST)])


def test_groups_without_kv_are_not_required_and_clear_empties_all() -> None:
    sb, h = tracker(), shares()
    mamba = {"kv_cache_spec_kind": "mamba", "kv_cache_spec_sliding_window": None}
    apply(sb, stored(1, 0, 2, **mamba))
    got = apply(sb, stored(0, 0, 2, **FULL))
    assert got == [(h[0], None, Tier.GPU)] and sb.counters["other_group_pages"] == 2
    apply(sb, stored(2, 0, 4, **SLIDING), stored(0, 2, 2, **FULL))
    assert set(sb.inventory()) == {h[0], h[1]}
    assert sorted(apply(sb, AllBlocksCleared())) == sorted((x, Tier.GPU, None) for x in h[:2])
    assert sb.inventory() == {} and len(sb) == 0


def test_pages_removed_before_any_share_block_is_made_of_them() -> None:
    sb = tracker()
    apply(sb, stored(0, 0, 1, **FULL))  # one page: half a share block
    assert apply(sb, removed(0, 0)) == []
    assert sb.num_pages() == 0
