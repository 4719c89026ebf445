"""Share blocks of an engine with several KV-cache groups (a sliding-window hybrid under vLLM's
hybrid allocator), from its page events.

vLLM publishes each group's pages separately (``group_idx``; store events also carry the
group's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``). The page hashes are the
same in every group (they depend on the tokens only), so each group's own
:class:`~kvshare.vllm.events.share_blocks.ShareBlocks` rebuilds the same share hashes. A share
block is kvshare's whole block (every layer, DESIGN "canonical block format"), so it is
resident in a tier **only when every group that holds KV (full attention, sliding window,
MLA) holds it there**: its tier at this worker is the slowest of the groups' best tiers. A
sliding group drops the pages behind its window first, so a long prompt's early blocks leave
the gpu tier as soon as vLLM evicts them from that group, although vLLM's own prefix hit
still reaches them (it needs only the last window's pages): the index under-reports such an
engine, never over-reports it. Groups of other kinds (Mamba state, chunked attention, ...)
are counted (``other_group_pages``) and not required: kvshare refuses those models at start.

With one group (MHA, or a hybrid whose allocator is off) the changes are that group's own.
"""

from __future__ import annotations

from kvshare.hasher import Hasher
from kvshare.types import BlockHash, Tier
from kvshare.vllm.events.share_blocks import Change, ShareBlocks
from kvshare.vllm.events.wire import PagesRemoved, PagesStored

KV_KINDS = ("full_attention", "sliding_window", "mla_attention")
"""vLLM ``kv_cache_spec_kind`` values whose pages hold share-block KV (None: not sent,
taken as KV: events from a vLLM that predates the field)."""


class GroupedShareBlocks:
    """:class:`ShareBlocks` per KV-cache group, combined (see the module docstring); the same
    queries and event methods as one :class:`ShareBlocks`."""

    def __init__(self, hasher: Hasher, page_tokens: int) -> None:
        self.hasher = hasher
        self.page_tokens = page_tokens
        self.groups: dict[int, ShareBlocks] = {0: ShareBlocks(hasher, page_tokens, 0)}
        self.kinds: dict[int, tuple[str | None, int | None]] = {}
        self._tiers: dict[BlockHash, Tier] = {}  # the combined tier of each resident block
        self._other = 0  # pages of groups that hold no share-block KV

    # ------------------------------------------------------------------ queries
    @property
    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for sb in self.groups.values():
            for k, v in sb.counters.items():
                if k != "other_groups":
                    out[k] = out.get(k, 0) + v
        out["kv_cache_groups"] = len(self.groups)
        out["other_group_pages"] = self._other
        return out

    def inventory(self) -> dict[BlockHash, Tier]:
        if len(self.groups) == 1:
            return next(iter(self.groups.values())).inventory()
        return dict(self._tiers)

    def __len__(self) -> int:
        return len(self.inventory())

    def num_pages(self) -> int:
        return sum(sb.num_pages() for sb in self.groups.values())

    # ------------------------------------------------------------------ events
    def stored(self, ev: PagesStored) -> list[Change]:
        g = ev.group_idx
        out = self._learn(g, ev.spec_kind, ev.sliding_window) if g not in self.kinds else []
        sb = self.groups.get(g)
        if sb is None:
            self._other += len(ev.block_hashes)
            return out
        return out + self._combine(sb.stored(ev))

    def removed(self, ev: PagesRemoved) -> list[Change]:
        sb = self.groups.get(ev.group_idx)
        if sb is None:
            self._other += len(ev.block_hashes)
            return []
        return self._combine(sb.removed(ev))

    def cleared(self) -> list[Change]:
        if len(self.groups) == 1:
            return next(iter(self.groups.values())).cleared()
        for sb in self.groups.values():
            sb.cleared()
        return self._drop_all()

    # ------------------------------------------------------------------ internals
    def _learn(self, g: int, kind: str | None, window: int | None) -> list[Change]:
        """Group ``g``'s first store event: track it if it holds KV (from now on a block is
        resident only in every such group: blocks a new group does not hold yet leave)."""
        self.kinds[g] = (kind, window)
        if kind is not None and kind not in KV_KINDS:  # state, not share-block KV
            sb = self.groups.pop(g, None)
            if sb is None:
                return []
            if self.groups:
                return self._drop_all()
            gone: list[Change] = [(h, t, None) for h, t in sb.inventory().items()]
            return gone
        if g in self.groups:
            return []
        placeholder = self.groups.get(0)
        if 0 not in self.kinds and placeholder is not None and not placeholder.num_pages():
            del self.groups[0]  # the placeholder for group 0 never saw an event
        out = self._drop_all() if self.groups else []
        self.groups[g] = ShareBlocks(self.hasher, self.page_tokens, g)
        return out

    def _drop_all(self) -> list[Change]:
        """Every resident block leaves (combined inventory emptied)."""
        inv = self.inventory()
        self._tiers = {}
        out: list[Change] = [(h, t, None) for h, t in inv.items()]
        return out

    def _combined(self, share: BlockHash) -> Tier | None:
        worst: Tier | None = None
        for sb in self.groups.values():
            t = sb.tier_of(share)
            if t is None:
                return None
            if worst is None or t.rank > worst.rank:
                worst = t
        return worst

    def _combine(self, changes: list[Change]) -> list[Change]:
        if len(self.groups) == 1:
            return changes
        out: list[Change] = []
        for share, _old, _new in changes:
            before = self._tiers.get(share)
            after = self._combined(share)
            if after is None:
                self._tiers.pop(share, None)
            else:
                self._tiers[share] = after
            if before != after:
                out.append((share, before, after))
        return out
