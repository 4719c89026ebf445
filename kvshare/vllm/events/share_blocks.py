"""vLLM pages -> kvshare share blocks (plain class, no ZMQ, no Ray).

vLLM hashes its pages (``block_size`` tokens) with its own scheme; kvshare's index holds share
blocks of ``block_tokens = k * block_size`` tokens hashed by the namespace's
:class:`~kvshare.hasher.Hasher`. From
the pages' token ids and parent chain, :class:`ShareBlocks` rebuilds each share block's
kvshare hash, and keeps the rule that **a share block is resident only while all k of its
pages are**: it appears when its last page arrives with the k-1 before it present, and goes
when any of them is removed.

Chains start at a page with no parent; its extra keys carry vLLM's ``cache_salt`` (the
tenant salt the gateway passed), which selects the namespace root (``hasher.root_for(salt)``). LoRA
names and multimodal / prompt-embeds keys join the share block's hash as extra keys
(:func:`share_extra`), so blocks of another adapter or image never match. A page whose parent
this tracker does not know (it missed events) is an orphan and is skipped, with its chain:
a miss, never a wrong hash.

Pages are tracked per medium (vLLM's GPU cache, its CPU/disk offload), each medium being one
tier; a share block's tier at the worker is the fastest medium holding it. Changes come back
as ``(share_hash, old_tier | None, new_tier | None)`` transitions for the publisher.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from typing import Any, NamedTuple

import msgspec
import numpy as np

from kvshare.hasher import Hasher
from kvshare.hashing import tokens_to_u32le
from kvshare.types import BlockHash, Tier
from kvshare.vllm.events.wire import PagesRemoved, PagesStored, VllmHash

MEDIUM_TIERS: dict[str, Tier] = {"GPU": Tier.GPU, "CPU": Tier.HOST, "CPU_PINNED": Tier.HOST,
                                 "STORAGE": Tier.DISK, "DISK": Tier.DISK}
"""vLLM's (and SGLang's) ``medium`` -> the worker's kvshare tier (vLLM's CPU offload and
SGLang's HiCache host pool, ``CPU_PINNED``, are the host tier)."""

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
    pages = list(page_keys)
    if lora_name is None and not any(pages):
        return None
    return _encoder.encode([lora_name, [list(k) for k in pages]])


class _Page(NamedTuple):
    """One tracked vLLM page. A tuple of atomic values: the cyclic GC leaves it alone."""

    parent: VllmHash | None
    tokens: bytes  # u32 little-endian
    pos: int  # page index in its sequence
    base: BlockHash | None  # hash the page's share block chains from; None: unknown
    keys: tuple[Any, ...]  # vLLM's extra keys of the page, without the cache salt


class ShareBlocks:
    """Which kvshare share blocks one vLLM engine holds, from its page events."""

    def __init__(self, hasher: Hasher, page_tokens: int, group: int = 0) -> None:
        block_tokens = hasher.block_tokens
        if page_tokens <= 0 or block_tokens <= 0 or block_tokens % page_tokens:
            raise ValueError(
                f"kvshare block_tokens ({block_tokens}) must be a positive multiple of vLLM's "
                f"block_size ({page_tokens}): pick --block-size dividing the namespace's blocks"
            )
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.k = block_tokens // page_tokens
        self.hasher = hasher
        self.group = group  # the KV-cache group whose pages this tracks (others: counted)
        self._pages: dict[Tier, dict[VllmHash, _Page]] = {}
        # resident share block -> its pages (first..last); a page -> the share blocks it is in
        self._members: dict[Tier, dict[BlockHash, tuple[VllmHash, ...]]] = {}
        self._in: dict[Tier, dict[VllmHash, BlockHash | tuple[BlockHash, ...]]] = {}
        self._tiers: dict[BlockHash, Tier | tuple[Tier, ...]] = {}
        self.counters = dict.fromkeys(
            ("pages_stored", "pages_removed", "orphan_pages", "partial_pages", "other_groups",
             "unknown_media", "shares_stored", "shares_removed"), 0)

    # ------------------------------------------------------------------ queries
    def inventory(self) -> dict[BlockHash, Tier]:
        """Every resident share block and its best tier."""
        return {h: t if isinstance(t, Tier) else _best(t) for h, t in self._tiers.items()}

    def tier_of(self, share: BlockHash) -> Tier | None:
        """The share block's best tier in this tracker (None: not resident)."""
        t = self._tiers.get(share)
        return t if t is None or isinstance(t, Tier) else _best(t)

    def members(self, tier: Tier) -> dict[BlockHash, tuple[VllmHash, ...]]:
        """The share blocks resident in ``tier``, each with its pages (first..last)."""
        return self._members.get(tier, {})

    def page_parent(self, tier: Tier, vh: VllmHash) -> VllmHash | None:
        """The page before ``vh`` in its chain (None: ``vh`` starts it or is not tracked)."""
        page = self._pages.get(tier, {}).get(vh)
        return None if page is None else page.parent

    def share_ending(self, tier: Tier, vh: VllmHash) -> BlockHash | None:
        """The resident share block whose last page is ``vh``."""
        return self._share_ending(tier, vh)

    def __len__(self) -> int:
        return len(self._tiers)

    def num_pages(self) -> int:
        return sum(len(p) for p in self._pages.values())

    # ------------------------------------------------------------------ events
    def stored(self, ev: PagesStored) -> list[Change]:
        n = len(ev.block_hashes)
        tier = self._tier(ev.medium, ev.group_idx, n)
        if tier is None or n == 0:
            return []
        if ev.block_size != self.page_tokens or len(ev.token_ids) != n * self.page_tokens:
            self.counters["partial_pages"] += n  # partial pages never make share blocks
            return []
        pages = self._pages.setdefault(tier, {})
        k = self.k
        parent = ev.parent
        base: BlockHash | None
        head: list[tuple[VllmHash, _Page]] | None = []
        if parent is None:
            pos, base = 0, self.hasher.root_for(_salt_of(ev))
        else:
            prev = pages.get(parent)
            if prev is None:
                self.counters["orphan_pages"] += n
                return []
            pos = prev.pos + 1
            # the pages of the share block this event continues (they come before ours)
            head = self._chain(pages, parent, pos % k)
            if head is None:
                base = None
            elif pos % k:
                base = head[0][1].base
            else:
                base = self._share_ending(tier, parent)
        toks = tokens_to_u32le(ev.token_ids)
        keys: list[tuple[Any, ...]] | None = None if ev.extra_keys is None else [
            split_page_keys(ev.lora_name, e)[1] for e in ev.extra_keys]
        head = head or []
        r0 = len(head)
        hashes = self._hash(base, head, toks, keys, ev.lora_name)
        # page i's share block chains from bases[(r0 + i) // k] (None: the chain is unknown)
        bases = None if base is None else [base, *hashes]
        hs, step = ev.block_hashes, 4 * self.page_tokens
        if pages.keys().isdisjoint(hs):  # all new (the common case): one bulk insert
            new_page, no_keys = tuple.__new__, [()] * n if keys is None else keys
            pages.update(zip(hs, [new_page(_Page, (
                p, toks[i * step:(i + 1) * step], pos + i,
                None if bases is None else bases[(r0 + i) // k], no_keys[i]))
                for i, p in enumerate((parent, *hs[:-1]))], strict=True))
            added = n
        else:
            added = self._store_pages(pages, ev, toks, keys, pos, bases, r0)
        self.counters["pages_stored"] += added
        if not hashes:
            return []
        names = [vh for vh, _ in head] + list(ev.block_hashes)
        return self._register(tier, hashes, names)

    def _store_pages(self, pages: dict[VllmHash, _Page], ev: PagesStored, toks: bytes,
                     keys: list[tuple[Any, ...]] | None, pos: int,
                     bases: list[BlockHash] | None, r0: int) -> int:
        """Track the event's pages one by one (some are tracked already); returns how many
        are new."""
        step, k, added, parent = 4 * self.page_tokens, self.k, 0, ev.parent
        for i, vh in enumerate(ev.block_hashes):
            pbase = None if bases is None else bases[(r0 + i) // k]
            old = pages.get(vh)
            if old is None:
                pages[vh] = _Page(parent, toks[i * step:(i + 1) * step], pos + i, pbase,
                                  () if keys is None else keys[i])
                added += 1
            elif old.base is None and pbase is not None:  # re-reported with its chain known
                pages[vh] = old._replace(base=pbase)
            parent = vh
        return added

    def removed(self, ev: PagesRemoved) -> list[Change]:
        tier = self._tier(ev.medium, ev.group_idx, len(ev.block_hashes))
        pages = self._pages.get(tier) if tier is not None else None
        if pages is None or tier is None:
            return []
        # (pages stored but no share block made of them yet: neither map has the tier)
        members, inside = self._members.get(tier, {}), self._in.get(tier, {})
        out: list[Change] = []
        gone = [vh for vh in ev.block_hashes if pages.pop(vh, None) is not None]  # tracked ones
        self.counters["pages_removed"] += len(gone)
        for shares in map(inside.pop, gone, repeat(None)):
            if shares is None:
                continue
            for share in (shares,) if isinstance(shares, bytes) else shares:
                if members.pop(share, None) is not None:
                    self._drop_tier(share, tier, out)
        return out

    def cleared(self) -> list[Change]:
        """Everything gone (vLLM's ``AllBlocksCleared``, or a restart)."""
        out: list[Change] = [(h, t, None) for h, t in self.inventory().items()]
        self.counters["shares_removed"] += len(out)
        self._pages.clear()
        self._members.clear()
        self._in.clear()
        self._tiers.clear()
        return out

    # ------------------------------------------------------------------ internals
    def _tier(self, medium: str, group: int, n: int) -> Tier | None:
        if group != self.group:
            self.counters["other_groups"] += n  # another KV-cache group's (events/groups.py)
            return None
        tier = MEDIUM_TIERS.get(medium.upper())
        if tier is None:
            self.counters["unknown_media"] += n
        return tier

    @staticmethod
    def _chain(pages: dict[VllmHash, _Page], last: VllmHash,
               n: int) -> list[tuple[VllmHash, _Page]] | None:
        """The ``n`` pages ending at ``last`` (oldest first); None if one is not tracked."""
        out: list[tuple[VllmHash, _Page]] = []
        cur: VllmHash | None = last
        while len(out) < n:
            page = pages.get(cur) if cur is not None else None
            if page is None:
                return None
            out.append((cur, page))  # type: ignore[arg-type]
            cur = page.parent
        out.reverse()
        return out

    def _share_ending(self, tier: Tier, vh: VllmHash) -> BlockHash | None:
        """The resident share block whose last page is ``vh`` (the base of the next one)."""
        shares = self._in.get(tier, {}).get(vh)
        members = self._members.get(tier, {})
        for share in () if shares is None else (shares,) if isinstance(shares, bytes) else shares:
            m = members.get(share)
            if m is not None and m[-1] == vh:
                return share
        return None

    def _hash(self, base: BlockHash | None, head: list[tuple[VllmHash, _Page]], toks: bytes,
              keys: list[tuple[Any, ...]] | None, lora_name: str | None) -> list[BlockHash]:
        """kvshare hashes of the full share blocks of the pages ``head`` (tracked pages of the
        share block the event continues, from its boundary) followed by the event's pages
        (``toks``, their extra ``keys``), chaining from ``base``, in one chain call."""
        k, page = self.k, self.page_tokens
        full = (len(head) + len(toks) // (4 * page)) // k
        if not full or base is None:
            return []
        data = b"".join([*(p.tokens for _, p in head), toks]) if head else toks
        tokens = np.frombuffer(data, dtype="<u4", count=full * k * page)
        page_keys = [p.keys for _, p in head] + (keys or [()] * (len(toks) // (4 * page)))
        if lora_name is None and not any(page_keys):  # plain text (the common case)
            return self.hasher.hashes(tokens, parent=base)
        extras = [share_extra(lora_name, page_keys[j * k:(j + 1) * k]) for j in range(full)]
        return self.hasher.hashes(tokens, parent=base, extra_keys=None if all(
            e is None for e in extras) else extras)

    def _register(self, tier: Tier, hashes: list[BlockHash],
                  names: list[VllmHash]) -> list[Change]:
        """Make share block ``j`` (pages ``names[j*k:(j+1)*k]``) resident unless it is."""
        k = self.k
        members = self._members.setdefault(tier, {})
        inside = self._in.setdefault(tier, {})
        out: list[Change] = []
        for j, share in enumerate(hashes):
            if share in members:
                continue
            group = tuple(names[j * k:(j + 1) * k])
            members[share] = group
            if inside.keys().isdisjoint(group):  # pages in no other share block (common)
                inside.update(zip(group, repeat(share)))
            else:
                for vh in group:
                    cur = inside.get(vh)
                    inside[vh] = share if cur is None else (
                        (cur, share) if isinstance(cur, bytes) else (*cur, share))
            self._add_tier(share, tier, out)
        return out

    def _add_tier(self, share: BlockHash, tier: Tier, out: list[Change]) -> None:
        cur = self._tiers.get(share)
        if cur is None:
            self._tiers[share] = tier
            out.append((share, None, tier))
            self.counters["shares_stored"] += 1
            return
        tiers = (cur,) if isinstance(cur, Tier) else cur
        if tier in tiers:
            return
        old = _best(tiers)
        self._tiers[share] = (*tiers, tier)
        if _best((*tiers, tier)) != old:
            out.append((share, old, tier))

    def _drop_tier(self, share: BlockHash, tier: Tier, out: list[Change]) -> None:
        cur = self._tiers.get(share)
        if cur is None:
            return
        tiers = (cur,) if isinstance(cur, Tier) else cur
        if tier not in tiers:
            return
        rest = tuple(t for t in tiers if t != tier)
        old, new = _best(tiers), _best(rest) if rest else None
        if not rest:
            del self._tiers[share]
            self.counters["shares_removed"] += 1
        else:
            self._tiers[share] = rest[0] if len(rest) == 1 else rest
        if new != old:
            out.append((share, old, new))


def _best(tiers: tuple[Tier, ...]) -> Tier:
    return min(tiers, key=lambda t: t.rank)


def _salt_of(ev: PagesStored) -> str:
    if ev.cache_salt:  # SGLang's
        return ev.cache_salt
    if not ev.extra_keys:
        return ""
    return split_page_keys(ev.lora_name, ev.extra_keys[0])[0]
