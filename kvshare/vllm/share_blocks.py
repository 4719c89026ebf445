"""vLLM pages -> kvshare share blocks (plain class, no ZMQ, no Ray).

vLLM hashes its pages (``block_size`` tokens) with its own scheme; kvshare's index holds share
blocks of ``block_tokens = k * block_size`` tokens hashed with :mod:`kvshare.hashing`. From
the pages' token ids and parent chain, :class:`ShareBlocks` rebuilds each share block's
kvshare hash, and keeps the rule that **a share block is resident only while all k of its
pages are**: it appears when its last page arrives with the k-1 before it present, and goes
when any of them is removed.

Chains start at a page with no parent; its extra keys carry vLLM's ``cache_salt`` (the
tenant salt the gateway passed), which selects the namespace root (``root_for(salt)``). LoRA
names and multimodal / prompt-embeds keys join the share block's hash as extra keys
(:func:`share_extra`), so blocks of another adapter or image never match. A page whose parent
this tracker does not know (it missed events) is an orphan and is skipped, with its chain:
a miss, never a wrong hash.

Pages are tracked per medium (vLLM's GPU cache, its CPU/disk offload), each medium being one
tier; a share block's tier at the worker is the fastest medium holding it. Changes come back
as ``(share_hash, old_tier | None, new_tier | None)`` transitions for the publisher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import numpy as np

from kvshare.hashing import DEFAULT_HASH_FN, HashFn, block_hashes
from kvshare.types import BlockHash, Tier
from kvshare.vllm.event_wire import PagesRemoved, PagesStored, VllmHash

MEDIUM_TIERS: dict[str, Tier] = {"GPU": Tier.GPU, "CPU": Tier.HOST, "STORAGE": Tier.DISK,
                                 "DISK": Tier.DISK}
"""vLLM ``medium`` -> the worker's kvshare tier (vLLM's CPU offload is the host tier)."""

Change = tuple[BlockHash, Tier | None, Tier | None]
"""A share block's best tier at this worker went from ``old`` to ``new`` (None = absent)."""

_encoder = msgspec.msgpack.Encoder()


def split_page_keys(lora_name: str | None, keys: tuple[Any, ...] | None) -> tuple[str, tuple[Any, ...]]:
    """vLLM's untagged page keys -> ``(cache_salt or "", the other keys)``.

    vLLM lists, in order: the LoRA name (when the event has one), ``(mm_id, offset)`` pairs,
    the cache salt (first page only, a string), prompt-embeds digests (bytes).
    """
    if not keys:
        return "", ()
    rest = list(keys)
    if lora_name is not None and rest and rest[0] == lora_name:
        rest.pop(0)
    salt = ""
    for i, k in enumerate(rest):
        if isinstance(k, str):
            salt = k
            del rest[i]
            break
    return salt, tuple(rest)


def share_extra(lora_name: str | None, page_keys: Iterable[tuple[Any, ...]]) -> bytes | None:
    """The kvshare extra key of one share block: None for plain text without an adapter (the
    common case), else the msgpack of ``[lora_name, [keys of each page]]``."""
    pages = [list(k) for k in page_keys]
    if lora_name is None and not any(pages):
        return None
    return _encoder.encode([lora_name, pages])


class _Page:
    __slots__ = ("base", "ends", "keys", "parent", "pos", "shares", "tokens")

    def __init__(self, parent: VllmHash | None, tokens: bytes, pos: int, base: BlockHash | None,
                 keys: tuple[Any, ...]) -> None:
        self.parent = parent
        self.tokens = tokens  # u32 little-endian
        self.pos = pos  # page index in its sequence
        self.base = base  # hash the page's share block chains from; None: unknown (orphan)
        self.keys = keys
        self.ends: BlockHash | None = None  # the resident share block this page completes
        self.shares: set[BlockHash] = set()  # share blocks this page is (or was) part of


class ShareBlocks:
    """Which kvshare share blocks one vLLM engine holds, from its page events."""

    def __init__(self, block_tokens: int, page_tokens: int, root_for: Callable[[str], BlockHash],
                 hash_fn: HashFn = DEFAULT_HASH_FN) -> None:
        if page_tokens <= 0 or block_tokens <= 0 or block_tokens % page_tokens:
            raise ValueError(
                f"kvshare block_tokens ({block_tokens}) must be a positive multiple of vLLM's "
                f"block_size ({page_tokens}): pick --block-size dividing the namespace's blocks"
            )
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.k = block_tokens // page_tokens
        self.root_for = root_for
        self.hash_fn = hash_fn
        self._pages: dict[Tier, dict[VllmHash, _Page]] = {}
        self._last: dict[Tier, dict[BlockHash, VllmHash]] = {}  # resident share -> last page
        self._tiers: dict[BlockHash, set[Tier]] = {}
        self.counters = dict.fromkeys(
            ("pages_stored", "pages_removed", "orphan_pages", "partial_pages", "other_groups",
             "unknown_media", "shares_stored", "shares_removed"), 0)

    # ------------------------------------------------------------------ queries
    def inventory(self) -> dict[BlockHash, Tier]:
        """Every resident share block and its best tier."""
        return {h: min(ts, key=lambda t: t.rank) for h, ts in self._tiers.items()}

    def __len__(self) -> int:
        return len(self._tiers)

    def num_pages(self) -> int:
        return sum(len(p) for p in self._pages.values())

    # ------------------------------------------------------------------ events
    def stored(self, ev: PagesStored) -> list[Change]:
        n = len(ev.block_hashes)
        tier = self._tier(ev.medium, ev.group_idx, n)
        if tier is None:
            return []
        if ev.block_size != self.page_tokens or len(ev.token_ids) != n * self.page_tokens:
            self.counters["partial_pages"] += n  # partial pages never make share blocks
            return []
        pages = self._pages.setdefault(tier, {})
        parent = ev.parent
        base: BlockHash | None
        if parent is None:
            pos, base = 0, self.root_for(_salt_of(ev))
        else:
            prev = pages.get(parent)
            if prev is None:
                self.counters["orphan_pages"] += n
                return []
            pos, base = prev.pos + 1, self._next_base(prev)
        toks = np.asarray(ev.token_ids, dtype="<u4").tobytes()
        step = 4 * self.page_tokens
        out: list[Change] = []
        for i, vh in enumerate(ev.block_hashes):
            page = pages.get(vh)
            if page is None:
                keys = () if ev.extra_keys is None else split_page_keys(
                    ev.lora_name, ev.extra_keys[i])[1]
                page = pages[vh] = _Page(parent, toks[i * step:(i + 1) * step], pos, base, keys)
                self.counters["pages_stored"] += 1
            if page.pos % self.k == self.k - 1 and page.ends is None and page.base is not None:
                self._complete(tier, pages, vh, page, ev.lora_name, out)
            parent, pos, base = vh, page.pos + 1, self._next_base(page)
        return out

    def removed(self, ev: PagesRemoved) -> list[Change]:
        tier = self._tier(ev.medium, ev.group_idx, len(ev.block_hashes))
        pages = self._pages.get(tier) if tier is not None else None
        if pages is None or tier is None:
            return []
        last = self._last.setdefault(tier, {})
        out: list[Change] = []
        for vh in ev.block_hashes:
            page = pages.pop(vh, None)
            if page is None:
                continue  # a partial or orphan page we never tracked
            self.counters["pages_removed"] += 1
            for share in page.shares:
                end = last.pop(share, None)
                if end is None:
                    continue  # already gone with another of its pages
                end_page = pages.get(end)
                if end_page is not None:
                    end_page.ends = None  # may complete again when this page comes back
                self._drop_tier(share, tier, out)
        return out

    def cleared(self) -> list[Change]:
        """Everything gone (vLLM's ``AllBlocksCleared``, or a restart)."""
        out: list[Change] = [(h, t, None) for h, t in self.inventory().items()]
        self.counters["shares_removed"] += len(out)
        self._pages.clear()
        self._last.clear()
        self._tiers.clear()
        return out

    # ------------------------------------------------------------------ internals
    def _tier(self, medium: str, group: int, n: int) -> Tier | None:
        if group != 0:
            self.counters["other_groups"] += n  # hybrid models: only group 0 is tracked
            return None
        tier = MEDIUM_TIERS.get(medium.upper())
        if tier is None:
            self.counters["unknown_media"] += n
        return tier

    def _complete(self, tier: Tier, pages: dict[VllmHash, _Page], vh: VllmHash, page: _Page,
                  lora_name: str | None, out: list[Change]) -> None:
        """Make the share block ending at ``page`` if its k-1 earlier pages are present."""
        assert page.base is not None
        chain = [page]
        while len(chain) < self.k:
            parent = chain[-1].parent
            prev = pages.get(parent) if parent is not None else None
            if prev is None:
                return
            chain.append(prev)
        chain.reverse()
        tokens = np.frombuffer(b"".join(p.tokens for p in chain), dtype="<u4")
        extra = share_extra(lora_name, (p.keys for p in chain))
        (share,) = block_hashes(page.base, tokens, self.block_tokens,
                                None if extra is None else [extra], fn=self.hash_fn)
        for p in chain:
            p.shares.add(share)
        page.ends = share
        last = self._last.setdefault(tier, {})
        if share in last:
            return
        last[share] = vh
        tiers = self._tiers.setdefault(share, set())
        old = _best(tiers)
        tiers.add(tier)
        new = _best(tiers)
        if new != old:
            out.append((share, old, new))
            if old is None:
                self.counters["shares_stored"] += 1

    def _next_base(self, page: _Page) -> BlockHash | None:
        """The base of the page after ``page``: the share block ``page`` ends, if it ends one."""
        return page.base if page.pos % self.k != self.k - 1 else page.ends

    def _drop_tier(self, share: BlockHash, tier: Tier, out: list[Change]) -> None:
        tiers = self._tiers.get(share)
        if not tiers or tier not in tiers:
            return
        old = _best(tiers)
        tiers.discard(tier)
        new = _best(tiers)
        if not tiers:
            del self._tiers[share]
        if new != old:
            out.append((share, old, new))
            if new is None:
                self.counters["shares_removed"] += 1


def _best(tiers: set[Tier]) -> Tier | None:
    return min(tiers, key=lambda t: t.rank) if tiers else None


def _salt_of(ev: PagesStored) -> str:
    if not ev.extra_keys:
        return ""
    return split_page_keys(ev.lora_name, ev.extra_keys[0])[0]
