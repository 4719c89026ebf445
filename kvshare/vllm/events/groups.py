"""Share blocks of an engine with several KV-cache groups (a sliding-window hybrid under vLLM's
hybrid allocator), from its page events.

vLLM publishes each group's pages separately (``group_idx``; store events also carry the
group's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``). Page hashes are the same
in every group (they depend on the tokens only). A full-attention group caches every page of a
prompt, so its own :class:`~kvshare.vllm.events.share_blocks.ShareBlocks` rebuilds the share
hashes from its chain. A sliding group caches only the pages a hit can use (vLLM 0.32: the last
window of what it computed; its store events list those pages' hashes with the whole token
range), so it is tracked as a set of page hashes, placed by the full group's chain.

A hit that ends at share block ``s`` needs ``s`` and every block before it in the full group
and, in each sliding group of window ``W``, the ``ceil((W - 1) / page)`` pages before the cut
(as vLLM's sliding-window manager counts). So a share block is resident in a tier **only when
every group it needs holds it there**: the full group holds it, and some cut at or after it
has its window in every sliding group. The index's prefix match then finds the engine's
longest usable hit; a shorter prompt that shares only the start of a resident prefix may find
blocks vLLM cannot hit at that cut (its sliding pages there were never kept): a routing miss,
never a wrong token. Groups of other kinds (Mamba state, chunked attention, ...) are counted
(``other_group_pages``) and not required: kvshare refuses those models at start. A model
without a full-attention group (every layer sliding) has no chain to place pages by: nothing
is published for it.

With one group (MHA, or a hybrid whose allocator is off) the changes are that group's own.
Several groups cost a recomputation over the resident blocks per event (``O(blocks x
window pages)``).
"""

from __future__ import annotations

from typing import Any

from kvshare.hasher import Hasher
from kvshare.types import BlockHash, Tier
from kvshare.vllm.events.share_blocks import MEDIUM_TIERS, Change, ShareBlocks
from kvshare.vllm.events.wire import PagesRemoved, PagesStored, VllmHash

KV_KINDS = ("full_attention", "sliding_window", "mla_attention")
"""vLLM ``kv_cache_spec_kind`` values whose pages hold share-block KV (None: not sent,
taken as full attention: events from a vLLM that predates the field)."""


class GroupedShareBlocks:
    """Share blocks over KV-cache groups (see the module docstring); the same queries and
    event methods as one :class:`ShareBlocks`."""

    def __init__(self, hasher: Hasher, page_tokens: int) -> None:
        self.hasher = hasher
        self.page_tokens = page_tokens
        self.groups: dict[int, ShareBlocks] = {0: ShareBlocks(hasher, page_tokens, 0)}
        self.sliding: dict[int, tuple[int, dict[Tier, set[VllmHash]]]] = {}
        self.kinds: dict[int, tuple[str | None, int | None]] = {}
        self._tiers: dict[BlockHash, Tier] = {}  # the combined tier of each resident block
        self._other = 0  # pages of groups that hold no share-block KV

    @property
    def combined(self) -> bool:
        return len(self.groups) + len(self.sliding) > 1

    # ------------------------------------------------------------------ queries
    @property
    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for sb in self.groups.values():
            for k, v in sb.counters.items():
                if k != "other_groups":
                    out[k] = out.get(k, 0) + v
        out["kv_cache_groups"] = len(self.groups) + len(self.sliding)
        out["sliding_pages"] = sum(len(p) for _, tiers in self.sliding.values()
                                   for p in tiers.values())
        out["other_group_pages"] = self._other
        return out

    def inventory(self) -> dict[BlockHash, Tier]:
        if not self.combined:
            return next(iter(self.groups.values())).inventory() if self.groups else {}
        return dict(self._tiers)

    def __len__(self) -> int:
        return len(self.inventory())

    def num_pages(self) -> int:
        return sum(sb.num_pages() for sb in self.groups.values()) + self.counters["sliding_pages"]

    # ------------------------------------------------------------------ events
    def stored(self, ev: PagesStored) -> list[Change]:
        g = ev.group_idx
        if g not in self.kinds:
            self._learn(g, ev.spec_kind, ev.sliding_window)
        if g in self.sliding:
            tier = MEDIUM_TIERS.get(ev.medium.upper())
            if tier is None:
                return []
            self.sliding[g][1].setdefault(tier, set()).update(ev.block_hashes)
            return self._recompute()
        sb = self.groups.get(g)
        if sb is None:
            self._other += len(ev.block_hashes)
            return []
        changes = sb.stored(ev)
        return self._recompute() if self.combined else changes

    def removed(self, ev: PagesRemoved) -> list[Change]:
        g = ev.group_idx
        if g in self.sliding:
            tier = MEDIUM_TIERS.get(ev.medium.upper())
            held = self.sliding[g][1].get(tier) if tier is not None else None
            if held is None:
                return []
            held.difference_update(ev.block_hashes)
            return self._recompute()
        sb = self.groups.get(g)
        if sb is None:
            self._other += len(ev.block_hashes)
            return []
        changes = sb.removed(ev)
        return self._recompute() if self.combined else changes

    def cleared(self) -> list[Change]:
        if not self.combined:
            return next(iter(self.groups.values())).cleared() if self.groups else []
        for sb in self.groups.values():
            sb.cleared()
        for _, tiers in self.sliding.values():
            tiers.clear()
        return self._recompute()

    # ------------------------------------------------------------------ internals
    def _learn(self, g: int, kind: str | None, window: int | None) -> None:
        """Group ``g``'s first store event: which kind of group it is."""
        self.kinds[g] = (kind, window)
        placeholder = self.groups.get(0)
        if g != 0 and 0 not in self.kinds and placeholder is not None \
                and not placeholder.num_pages():
            del self.groups[0]  # the placeholder for group 0 never saw an event
        if kind is not None and kind not in KV_KINDS:  # state, not share-block KV
            self.groups.pop(g, None)
        elif kind == "sliding_window" and window:
            self.groups.pop(g, None)
            self.sliding[g] = (int(window), {})
        elif g not in self.groups:
            self.groups[g] = ShareBlocks(self.hasher, self.page_tokens, g)

    def _recompute(self) -> list[Change]:
        """The combined inventory from the groups' state; the changes from the last one."""
        new: dict[BlockHash, Tier] = {}
        fulls = list(self.groups.values())
        if fulls:
            for tier in Tier:
                for share in self._resident(fulls, tier):
                    cur = new.get(share)
                    if cur is None or tier.rank < cur.rank:
                        new[share] = tier
        old, self._tiers = self._tiers, new
        out: list[Change] = [(h, t, new.get(h)) for h, t in old.items() if new.get(h) != t]
        out += [(h, None, t) for h, t in new.items() if h not in old]
        return out

    def _resident(self, fulls: list[ShareBlocks], tier: Tier) -> set[BlockHash]:
        """Share blocks resident in ``tier``: held by every full group, and before (or at) a
        cut whose window every sliding group holds there."""
        first = fulls[0]
        members = first.members(tier)
        held = [h for h in members if all(h in sb.members(tier) for sb in fulls[1:])]
        windows = [(-(-(w - 1) // self.page_tokens), tiers.get(tier, set()))
                   for w, tiers in self.sliding.values()]
        out: set[BlockHash] = set()
        for share in held:
            if share in out or not self._cut_ok(first, tier, members[share][-1], windows):
                continue
            cur: BlockHash | None = share  # this cut and every block before it
            while cur is not None and cur not in out and cur in members:
                out.add(cur)
                parent = first.page_parent(tier, members[cur][0])
                cur = None if parent is None else first.share_ending(tier, parent)
        return {h for h in out if all(h in sb.members(tier) for sb in fulls[1:])}

    @staticmethod
    def _cut_ok(full: ShareBlocks, tier: Tier, last: VllmHash,
                windows: list[tuple[int, set[VllmHash]]]) -> bool:
        """Whether every sliding group holds the window's pages before the cut after ``last``."""
        for need, pages in windows:
            vh: VllmHash | None = last
            for _ in range(need):
                if vh is None:
                    break  # the chain starts inside the window: fewer pages needed
                if vh not in pages:
                    return False
                vh = full.page_parent(tier, vh)
        return True

    def stats(self) -> dict[str, Any]:
        return {"groups": {g: {"kind": k, "window": w} for g, (k, w) in self.kinds.items()}}
