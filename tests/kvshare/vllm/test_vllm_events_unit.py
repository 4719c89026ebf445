"""vLLM's KV events -> kvshare share blocks, without an engine: vLLM's own event classes and
msgpack encoder make the payloads; the share hashes must be the ones the router computes."""

from __future__ import annotations

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
from kvshare.vllm.events.share_blocks import ShareBlocks  # noqa: E402
from kvshare.vllm.events.wire import (  # noqa: E402
    AllPagesCleared,
    MalformedEvents,
    PagesRemoved,
    PagesStored,
    decode_batch,
)

PAGE, BLOCK = 32, 128  # 4 vLLM pages per share block
BIG = 2**64 - 7  # vLLM's u64 block hashes exceed 2**63


def root(salt: str) -> bytes:
    return namespace_root("model-x", "layout-y", salt)


def encode(*events: object) -> bytes:
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=list(events)))


def stored(hashes: list[int], parent: int | None, tokens: list[int], salt: str = "",
           medium: str = "GPU", lora: str | None = None) -> BlockStored:
    extra: list[tuple[object, ...] | None] = [None] * len(hashes)
    first = ([lora] if lora else []) + ([salt] if salt and parent is None else [])
    if lora:
        extra = [(lora,)] * len(hashes)
    if first:
        extra[0] = tuple(first)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=PAGE, lora_id=None, medium=medium, lora_name=lora,
                       extra_keys=extra if any(extra) else None, group_idx=0)


def tracker() -> ShareBlocks:
    return ShareBlocks(Hasher("model-x", "layout-y", BLOCK), PAGE)


def apply(sb: ShareBlocks, payload: bytes) -> list[tuple[bytes, Tier | None, Tier | None]]:
    out = []
    for ev in decode_batch(payload)[1]:
        if isinstance(ev, PagesStored):
            out += sb.stored(ev)
        elif isinstance(ev, PagesRemoved):
            out += sb.removed(ev)
        elif isinstance(ev, AllPagesCleared):
            out += sb.cleared()
    return out


TOKENS = list(range(1000, 1000 + 10 * PAGE))  # 10 pages = 2 full share blocks + 2 pages


def test_share_hashes_from_events_are_the_routers_hashes_across_batches() -> None:
    sb = tracker()
    pages = [BIG - i for i in range(10)]
    # the prompt arrives in two batches (prefill chunks), split inside a share block
    apply(sb, encode(stored(pages[:6], None, TOKENS[:6 * PAGE], salt="acme")))
    apply(sb, encode(stored(pages[6:], pages[5], TOKENS[6 * PAGE:])))
    want = block_hashes(root("acme"), TOKENS, BLOCK)
    assert len(want) == 2
    assert sb.inventory() == {h: Tier.GPU for h in want}
    # another tenant's salt roots another chain: never the same hashes
    assert not set(block_hashes(root(""), TOKENS, BLOCK)) & set(sb.inventory())


def test_a_share_block_goes_when_any_of_its_pages_is_evicted_and_comes_back() -> None:
    sb = tracker()
    pages = [10 + i for i in range(8)]
    apply(sb, encode(stored(pages, None, TOKENS[:8 * PAGE])))
    b0, b1 = block_hashes(root(""), TOKENS[:8 * PAGE], BLOCK)
    changes = apply(sb, encode(BlockRemoved(block_hashes=[pages[5]], medium="GPU")))
    assert changes == [(b1, Tier.GPU, None)]
    assert set(sb.inventory()) == {b0}
    # vLLM recomputes page 5 and re-reports the pages after it: the block is back
    apply(sb, encode(stored(pages[5:], pages[4], TOKENS[5 * PAGE:8 * PAGE])))
    assert set(sb.inventory()) == {b0, b1}
    assert apply(sb, encode(AllBlocksCleared())) and not sb.inventory()


def test_orphans_partial_pages_lora_and_offload_tiers() -> None:
    sb = tracker()
    # a page whose parent was never seen (missed events): skipped, no hash invented
    assert apply(sb, encode(stored([1, 2, 3, 4], 999, TOKENS[:4 * PAGE]))) == []
    assert sb.counters["orphan_pages"] == 4
    # a partial page (fewer tokens than block_size) never makes a share block
    ev = BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=TOKENS[:10],
                     block_size=10, lora_id=None, medium="GPU", lora_name=None)
    assert apply(sb, encode(ev)) == [] and sb.counters["partial_pages"] == 1
    # a LoRA adapter's blocks hash differently from the base model's
    apply(sb, encode(stored([20, 21, 22, 23], None, TOKENS[:4 * PAGE], lora="sql")))
    (plain,) = block_hashes(root(""), TOKENS[:4 * PAGE], BLOCK)
    assert plain not in sb.inventory() and len(sb) == 1
    # vLLM's CPU offload is the worker's host tier; GPU wins while both hold it
    apply(sb, encode(stored([30, 31, 32, 33], None, TOKENS[:4 * PAGE], medium="CPU")))
    assert sb.inventory()[plain] == Tier.HOST
    apply(sb, encode(stored([30, 31, 32, 33], None, TOKENS[:4 * PAGE])))
    assert sb.inventory()[plain] == Tier.GPU
    changes = apply(sb, encode(BlockRemoved(block_hashes=[30], medium="GPU")))
    assert changes == [(plain, Tier.GPU, Tier.HOST)]


def test_both_encodings_decode_and_bad_payloads_raise_malformed() -> None:
    tokens = TOKENS[:PAGE]
    as_map = encode(stored([BIG], None, tokens), BlockRemoved(block_hashes=[BIG], medium="GPU"))
    as_array = msgspec.msgpack.encode([2.0, [
        ["BlockStored", [BIG], None, tokens, PAGE, None, "GPU"],
        ["BlockRemoved", [BIG], "GPU"], ["AllBlocksCleared"], ["SomethingNew", 1]]])
    m = decode_batch(as_map)[1]
    a = decode_batch(as_array)[1]
    assert m[0] == a[0] and m[1] == a[1]
    assert isinstance(m[0], PagesStored) and m[0].block_hashes == (BIG,)
    assert isinstance(a[2], AllPagesCleared) and a[3] is None  # unknown type: None
    for bad in (b"\xc1", msgspec.msgpack.encode({"x": 1}), msgspec.msgpack.encode([1.0, [
            {"type": "BlockStored", "block_hashes": ["nope"]}]])):
        with pytest.raises(MalformedEvents):
            decode_batch(bad)


def test_batches_of_known_events_decode_alike_in_either_encoding_in_any_order() -> None:
    tokens = TOKENS[:PAGE]
    as_map = encode(stored([BIG], None, tokens), BlockRemoved(block_hashes=[BIG], medium="GPU"),
                    AllBlocksCleared())
    as_array = msgspec.msgpack.encode([2.0, [
        ["BlockStored", [BIG], None, tokens, PAGE, None, "GPU"], ["BlockRemoved", [BIG], "GPU"],
        ["AllBlocksCleared"]]])
    want = decode_batch(as_map)[1]
    assert [type(e) for e in want] == [PagesStored, PagesRemoved, AllPagesCleared]
    for payload in (as_array, as_map, as_array, as_array, as_map):  # one C call each, whichever first
        assert decode_batch(payload)[1] == want


def test_sglangs_events_decode_and_its_host_pool_is_the_host_tier() -> None:
    """SGLang 0.5.23 publishes vLLM's wire format (tagged maps, ``omit_defaults``: optional
    fields left out when None) with fields of its own (``cache_salt``, ``session_id``) and its
    HiCache host pool as medium ``CPU_PINNED``."""
    sb = tracker()
    page = {"type": "BlockStored", "block_hashes": [40, 41, 42, 43], "parent_block_hash": None,
            "token_ids": TOKENS[:4 * PAGE], "block_size": PAGE, "lora_id": None,
            "medium": "CPU_PINNED", "session_id": "s"}
    payload = msgspec.msgpack.encode([2.0, [page], 0])
    (plain,) = block_hashes(root(""), TOKENS[:4 * PAGE], BLOCK)
    apply(sb, payload)
    assert sb.inventory() == {plain: Tier.HOST}
    apply(sb, msgspec.msgpack.encode([3.0, [{**page, "medium": "GPU"}], 0]))
    assert sb.inventory() == {plain: Tier.GPU}


def test_a_salted_sglang_prefix_is_a_block_of_that_tenant_only() -> None:
    """SGLang sends the storing request's salt as ``cache_salt`` (vLLM: in the first page's
    extra keys): the share block is the one a gateway computes for that tenant's prompt, not
    the unsalted one (where an unsalted prompt would be routed to a cache it cannot hit)."""
    sb = tracker()
    page = {"type": "BlockStored", "block_hashes": [50, 51, 52, 53], "parent_block_hash": None,
            "token_ids": TOKENS[:4 * PAGE], "block_size": PAGE, "medium": "GPU",
            "cache_salt": "acme", "session_id": "s"}
    apply(sb, msgspec.msgpack.encode([2.0, [page], 0]))
    (salted,) = block_hashes(root("acme"), TOKENS[:4 * PAGE], BLOCK)
    (plain,) = block_hashes(root(""), TOKENS[:4 * PAGE], BLOCK)
    assert salted != plain and sb.inventory() == {salted: Tier.GPU}
    # the rest of the chain continues the salted block (the salt is read where a chain starts)
    more = {**page, "block_hashes": [54, 55, 56, 57], "parent_block_hash": 53,
            "token_ids": TOKENS[4 * PAGE:8 * PAGE]}
    apply(sb, msgspec.msgpack.encode([3.0, [more], 0]))
    assert set(sb.inventory()) == set(block_hashes(root("acme"), TOKENS[:8 * PAGE], BLOCK))
