"""The scheduler half of the connector: find cached blocks, plan loads and saves.

Runs in vLLM's EngineCore process and never waits on the network: a prompt's lookup runs on one
of the lookup threads (``get_num_new_matched_tokens`` answers None, "ask again", while it runs,
after waiting at most ``lookup_wait_s``), and a request is held for it only while the lookup
could still save more than the wait costs (:mod:`kvshare.vllm.connector.lookup`; past that it is
scheduled as a miss). Loads over the network are asynchronous (the
request waits in ``WAITING_FOR_REMOTE_KVS`` while the workers copy, other requests keep
running); a load wholly from this node's pool of at most ``sync_local_bytes`` is synchronous:
vLLM schedules the request's suffix at once and the workers copy the prefix from shared memory
just before that step's forward pass (no engine steps spent waiting for the load's report).

Per request: its full blocks' hashes (namespace root from the model keys and the request's
``cache_salt``); what the cluster holds beyond vLLM's own prefix hit, cut by the cost model
(:class:`kvshare.client.sdk.KVShareClient.lookup`), unless that hit leaves the cluster less than
one block to add (then no lookup: vLLM's own hits wait on nothing), or unless the router that
routed the request saw no more held in the cluster than that (:mod:`kvshare.vllm.router_hint`:
a cold prompt waits on no second index query); then, step by step, which new full blocks to
save (blocks the cluster did not hold at lookup, or whose load failed and were recomputed,
once the forward pass has computed them).
A request that had a save issued keeps its pages after it finishes until the workers report
the save done (``request_finished`` returns True; vLLM frees on ``finished_sending``).
Read-after-write: a request that finishes while its saves still run is held in
``request_finished`` (the step that finishes it, before its output leaves the engine) until the
workers mark them ended (:mod:`kvshare.vllm.connector.save_marks`), at most ``SYNC_SAVE_WAIT_S``, when
they come to at most ``sync_save_bytes``; no other step waits for a save, so a prompt's first
token never waits for the prompt's store. The saves of a request with stop strings (which
vLLM's frontend finds, so the engine never sees that answer end) are waited for in the step
that computes them (``SaveSpec.sync``).
Not shared at all (no lookup, load or save): LoRA and multimodal requests, and requests that
opt out (:mod:`kvshare.vllm.connector.opt_out`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence, Set
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

from kvshare.client.types import TRANSPORT_LOCAL, TRANSPORT_SHM, KVClient, Plan
from kvshare.hashing import block_hashes
from kvshare.match import MatchResult
from kvshare.types import BlockHash
from kvshare.vllm.connector.backlog import PrefillBacklog
from kvshare.vllm.connector.config import ModelKeys
from kvshare.vllm.connector.cut_flag import loads_all
from kvshare.vllm.connector.groups import EngineGroups, savable_from
from kvshare.vllm.connector.lookup import Lookups
from kvshare.vllm.connector.metadata import KVShareMetadata, LoadSpec, SaveSpec
from kvshare.vllm.connector.opt_out import shares
from kvshare.vllm.connector.save_marks import SYNC_SAVE_WAIT_S, SaveMarks
from kvshare.vllm.router_hint import decode as decode_hint

log = logging.getLogger(__name__)

MAX_LOADS = 2
"""Load attempts per request (a preempted request may load again once)."""
LOCAL_TRANSPORTS = (TRANSPORT_SHM, TRANSPORT_LOCAL)
"""Transports that never leave this node (candidates for a load inside the forward pass)."""
LOOKUP_WAIT = "lookup_wait_seconds"
LOOKUPS_ANSWERED = "lookups_answered"
"""Counters: seconds requests were held for their lookups, and how many lookups answered."""


@dataclass
class _Req:
    request: Any
    root: BlockHash
    hashes: list[BlockHash]
    lookup: Future[Plan] | None = None
    hit_tokens: int = 0  # prompt tokens the plan brings (capped below the last token)
    saved_upto: int = 0  # blocks [0, saved_upto) are in the cluster or being saved
    sources: dict[str, int] = field(default_factory=dict)
    loading: tuple[int, ...] = ()  # pages of the load in flight
    loads: int = 0  # load attempts; a failed one is never retried (no load/fail loops)
    failed: bool = False
    sync: bool = False  # the load in flight completes inside the step's forward pass
    asked_at: float = 0.0  # when vLLM first asked for this lookup (0: not waiting on one)
    late: Future[Plan] | None = None  # an abandoned lookup: its answer only marks held blocks
    held_tokens: int | None = None  # the router's hint: the cluster held no more than this
    pools: MatchResult | None = None  # the hint's pools answer: plan from it, no lookup
    save_seqs: list[int] = field(default_factory=list)  # its saves' numbers (save_marks)
    saved_blocks: int = 0  # blocks handed to the workers to save
    load_all: bool = False  # the request asked to load every held block (cut_flag)
    load_first: int = 0  # first block of the load in flight (a failed one is saved again)


class SchedulerSide:
    """Plain class behind KVShareConnector's scheduler-role methods (no vLLM imports)."""

    def __init__(self, client: KVClient, keys: ModelKeys, page_tokens: int, *, save: bool = True,
                 lookup_wait_s: float = 0.02, sync_local_bytes: int = 0,
                 lookups: Lookups | None = None, router_hints: bool = True,
                 hint_max_age_s: float = 1.0, sync_save_bytes: int = 0,
                 groups: EngineGroups | None = None) -> None:
        self.client = client
        self.keys = keys
        self.block_tokens = keys.layout.block_tokens
        self.page_tokens = page_tokens
        self.save = save
        self.lookup_wait_s = lookup_wait_s
        self.sync_local_bytes = sync_local_bytes
        self.router_hints = router_hints
        self.hint_max_age_s = hint_max_age_s
        self.sync_save_bytes = sync_save_bytes
        # vLLM's KV-cache groups: with several (a sliding-window hybrid) loads and saves carry
        # every group's pages and loads run asynchronously (vLLM takes a failed load of such
        # an engine per request, failed_recving, not per page)
        self.groups = groups or EngineGroups.single(keys.layout.num_layers)
        self.marks = SaveMarks.create() if save and sync_save_bytes > 0 else None
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadSpec] = []
        self._sending: set[str] = set()
        self._unshared: set[str] = set()  # requests that opted out (no lookup, load or save)
        self.lookups = lookups or Lookups()
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {"kv_cache_groups": len(self.groups.layers)}
        self.backlog = PrefillBacklog()  # tokens still to prefill, for the load report

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] = self.counters.get(key, 0) + n

    # ------------------------------------------------------------------ lookups
    def _state(self, request: Any) -> _Req | None:
        """The request's state; None when it is not shared (LoRA, multimodal, too short)."""
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is not None:
            return st
        if getattr(request, "lora_request", None) is not None:
            self._count("skipped_lora")
            return None
        if getattr(request, "mm_features", None):
            self._count("skipped_multimodal")
            return None
        if rid in self._unshared:
            return None
        try:
            share = shares(getattr(request, "kv_transfer_params", None))
        except ValueError as exc:  # a client's own field: shared as always
            log.info("kvshare: ignoring the share flag of %s: %s", rid, exc)
            self._count("share_flags_malformed")
            share = True
        if not share:  # the client keeps it out of the cluster (kvshare.vllm.connector.opt_out)
            self._unshared.add(rid)
            self._count("skipped_opt_out")
            return None
        root = BlockHash(self.keys.root(getattr(request, "cache_salt", None)))
        tokens = list(request.prompt_token_ids or [])
        st = _Req(request, root, block_hashes(root, tokens, self.block_tokens))
        try:
            st.load_all = loads_all(getattr(request, "kv_transfer_params", None))
        except ValueError as exc:  # a client's own field: the connector's cut
            log.info("kvshare: ignoring the cut flag of %s: %s", rid, exc)
            self._count("cut_flags_malformed")
        if self.router_hints:
            try:
                hint = decode_hint(getattr(request, "kv_transfer_params", None))
            except ValueError as exc:  # a client's own field, not a router's: look up
                log.info("kvshare: ignoring the router hint of %s: %s", rid, exc)
                self._count("router_hints_malformed")
                hint = None
            if hint is not None and not hint.matches(st.hashes):
                # the router hashed the prompt otherwise (another salt or block size)
                log.info("kvshare: ignoring the router hint of %s: its block hashes differ", rid)
                self._count("router_hints_mismatched")
            elif hint is not None:
                st.held_tokens, st.pools = hint.held_tokens, hint.pools
        self._reqs[rid] = st
        return st

    def num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: tokens beyond ``num_computed`` the cluster brings
        (None: ask again, the lookup runs). The rest is the request's prefill backlog."""
        got = self._matched(request, num_computed)
        self.backlog.seen(request.request_id,
                          int(request.num_tokens) - num_computed - (got[0] or 0))
        return got

    def _matched(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is None or not st.hashes or st.failed or st.loads >= MAX_LOADS:
            return 0, False
        most = min(len(st.hashes) * self.block_tokens, int(request.num_tokens) - 1)
        stale: tuple[int, MatchResult | None] | None = None
        if st.held_tokens is not None and st.lookup is None and self._hint_stale(request):
            # queued too long: what was stored since is worth the query, but the old answer
            # stays the fallback should the query not answer at once (no step held for it)
            stale, st.held_tokens, st.pools = (st.held_tokens, st.pools), None, None
            self._count("router_hints_expired")
        reach = most if st.held_tokens is None else min(most, st.held_tokens)
        if st.lookup is None and reach - num_computed < self.block_tokens:
            # The cluster can add less than a block, not worth a wait on the index: vLLM's own
            # cache holds all but part of one block (a turn of a conversation this engine
            # served), or the router's query just now found no more than that (a cold prompt,
            # a turn new beyond what this engine holds: no second query). The blocks vLLM
            # holds were stored when this engine computed (or loaded) them, so they are not
            # saved again; every new block is.
            own = most - num_computed < self.block_tokens
            self._count("lookups_skipped" if own else "lookups_skipped_router")
            st.saved_upto = max(st.saved_upto, num_computed // self.block_tokens)
            return 0, False
        if st.lookup is None and st.pools is not None:
            # the router's own index answer came with the request: plan from it, ask nothing
            self._count("lookups_from_router")
            st.lookup = Future()
            st.lookup.set_result(self._plan_from(st, request.prompt_token_ids, st.pools))
            st.pools = None  # a preempted request looks up for real
        if st.lookup is None:
            self._count("lookups")
            st.asked_at = time.perf_counter()
            st.lookup = self.lookups.submit(self._lookup, request.prompt_token_ids, st.hashes,
                                            st.load_all)
        try:
            plan = st.lookup.result(timeout=self.lookups.wait_s(self.lookup_wait_s))
        except FutureTimeout:
            if stale is not None:
                # The expired hint answers instead of a held step: a stale answer costs at
                # most a recompute (a block evicted since fails to load), never a wrong token.
                self._count("router_hints_expired_used")
                self._answered(st)
                st.late = st.lookup
                held, pools = stale
                if pools is None or min(most, held) - num_computed < self.block_tokens:
                    st.lookup, st.loads = None, MAX_LOADS  # nothing to load: no second query
                    st.saved_upto = max(st.saved_upto, num_computed // self.block_tokens)
                    return 0, False
                plan = self._plan_from(st, request.prompt_token_ids, pools)
                st.lookup = Future()
                st.lookup.set_result(plan)
                return self._planned(st, request, plan, num_computed)
            if self.lookups.worth_waiting(time.perf_counter() - st.asked_at, most - num_computed):
                self._count("lookup_pending")
                return None, False  # vLLM asks again next step: the scheduler does not wait
            # held as long as the lookup could save: a miss now beats a hit later
            self._count("lookups_abandoned")
            self._answered(st)
            st.late, st.lookup = st.lookup, None
            st.loads = MAX_LOADS  # no second lookup for this request
            return 0, False
        except Exception as exc:  # index or pools unreachable: a miss
            log.warning("kvshare lookup failed for %s: %s", request.request_id, exc)
            self._count("lookup_errors")
            plan = Plan(self.client.namespace, len(st.hashes) * self.block_tokens,
                        self.block_tokens, tuple(st.hashes), 0, (), f"lookup failed: {exc}")
        self._answered(st)
        return self._planned(st, request, plan, num_computed)

    def _planned(self, st: _Req, request: Any, plan: Plan,
                 num_computed: int) -> tuple[int | None, bool]:
        """The answer to vLLM for a request whose lookup (or hint) planned ``plan``."""
        st.saved_upto = max(st.saved_upto, plan.available_blocks)
        if "unavailable" in plan.reason:
            self._count("index_unavailable")
        hit = min(plan.load_tokens, int(request.num_tokens) - 1)
        if hit <= num_computed:
            self._count("no_external_hit")
            st.hit_tokens = 0
            return 0, False
        st.hit_tokens = hit
        st.sync = self._sync(plan, hit, hit - num_computed)
        return hit - num_computed, not st.sync

    def _hint_stale(self, request: Any) -> bool:
        """Whether the request has waited ``hint_max_age_s`` or more since it reached the
        engine (vLLM's ``Request.arrival_time``, wall clock, set by this host's frontend): its
        router's snapshot of the cluster is that old at least."""
        arrived = getattr(request, "arrival_time", None)
        return arrived is None or time.time() - float(arrived) >= self.hint_max_age_s

    def _answered(self, st: _Req) -> None:
        """Count how long the request was held for its lookup (first ask to answer: the
        steps vLLM kept it waiting), once per lookup."""
        if st.asked_at:
            with self._lock:
                self.counters[LOOKUP_WAIT] = (self.counters.get(LOOKUP_WAIT, 0.0)
                                              + time.perf_counter() - st.asked_at)
                self.counters[LOOKUPS_ANSWERED] = self.counters.get(LOOKUPS_ANSWERED, 0) + 1
            st.asked_at = 0.0

    def _sync(self, plan: Plan, hit: int, num_external: int) -> bool:
        """Whether the load completes inside the step's forward pass: every block from this
        node's pool (shared memory, no network) and at most ``sync_local_bytes``. vLLM then
        schedules the suffix in the same step (no steps spent waiting for the load to be
        reported); a failed block is still reported (invalid block ids) and recomputed."""
        n_blocks = -(-hit // self.block_tokens)
        return (not self.groups.grouped and 0 < num_external * self.keys.layout.bytes_per_token <= self.sync_local_bytes
                and all(b.transport in LOCAL_TRANSPORTS for b in plan.blocks[:n_blocks]))

    def _plan_from(self, st: _Req, tokens: Sequence[int], pools: MatchResult) -> Plan:
        if st.load_all:
            return self.client.plan_from(tokens, st.hashes, pools, load_all=True)
        return self.client.plan_from(tokens, st.hashes, pools)

    def _lookup(self, tokens: Sequence[int], hashes: Sequence[BlockHash],
                load_all: bool = False) -> Plan:
        t0 = time.perf_counter()
        self._feed_speed()
        try:
            if load_all:
                return self.client.lookup(tokens, hashes, load_all=True)
            return self.client.lookup(tokens, hashes)
        finally:
            with self._lock:
                self.counters["lookup_seconds"] = (self.counters.get("lookup_seconds", 0.0)
                                                   + time.perf_counter() - t0)

    def _feed_speed(self) -> None:
        """Give the client's cut policy this engine's measured prefill speed (a
        :class:`~kvshare.cost_cut.CostCut` prices recomputing with it until it has timings)."""
        tps = self.lookups.speed.tokens_per_s
        use = getattr(getattr(self.client, "cut_policy", None), "use_speed", None)
        if tps > 0 and callable(use):
            use(tps)

    def update_state_after_alloc(self, request: Any, page_ids: Sequence[int],
                                 num_external: int,
                                 group_pages: Sequence[Sequence[int]] = ()) -> None:
        """Plan the asynchronous load of the external tokens into the allocated pages
        (``group_pages``: every KV-cache group's, with several; ``page_ids`` then the
        full-attention group's)."""
        if num_external <= 0:
            return
        st = self._reqs.get(request.request_id)
        if st is None or st.lookup is None or not st.lookup.done() or not st.hit_tokens:
            return
        plan: Plan = st.lookup.result()
        keep = st.hit_tokens - num_external  # vLLM's own prefix hit
        n_blocks = -(-st.hit_tokens // self.block_tokens)
        first = keep // self.block_tokens
        used = replace(plan, blocks=plan.blocks[:n_blocks])
        self._loads.append(LoadSpec(request.request_id, used.to_dict(), first, keep,
                                    tuple(int(p) for p in page_ids), sync=st.sync,
                                    group_pages=_int_lists(group_pages)))
        st.load_first = first
        st.sources = {}
        for b in used.blocks[first:]:
            key = "disk" if b.tier.value == "disk" else (
                "host" if b.transport == "shm" else "p2p")
            st.sources[key] = st.sources.get(key, 0) + self.block_tokens
        st.lookup = None  # a preempted request looks up again
        st.loads += 1
        st.loading = tuple(int(p) for p in page_ids)
        self._count("load_requests")
        self._count("load_tokens", num_external)
        if st.sync:
            self._count("sync_loads")

    def hit_sources(self, request: Any, num_external: int) -> dict[str, int]:
        """Tokens per source (``host``, ``disk``, ``p2p``) summing to ``num_external``."""
        st = self._reqs.get(request.request_id)
        if st is None or not st.sources or num_external <= 0:
            return {}
        out, left = {}, num_external
        for key in ("host", "disk", "p2p"):
            n = min(left, st.sources.get(key, 0))
            if n:
                out[key] = n
                left -= n
        if left and out:
            last = next(reversed(out))
            out[last] += left
        return out

    def update_connector_output(self, finished_recving: set[str], invalid_pages: set[int],
                                failed_recving: Set[str] = frozenset()) -> None:
        """A load that left invalid pages marks its request: vLLM recomputes, we never retry;
        the recomputed blocks are saved again. An asynchronous load ends with its request in
        ``finished_recving``; a synchronous one reports its invalid pages in the step it ran
        (its pages stay the request's until it finishes, so they identify it). With several
        KV-cache groups a failed load names its request (``failed_recving``): vLLM recomputes
        it from its first token and its loaded blocks are saved again."""
        for rid in failed_recving:
            st = self._reqs.get(rid)
            if st is not None:
                st.failed = True
                self._count("failed_loads")
                st.saved_upto = min(st.saved_upto, st.load_first)
                st.loading = ()
        if invalid_pages:
            for req in self._reqs.values():
                if req.sync and req.loading and not invalid_pages.isdisjoint(req.loading):
                    self._failed(req, invalid_pages)
        for rid in finished_recving:
            st = self._reqs.get(rid)
            if st is None:
                continue
            if invalid_pages and not invalid_pages.isdisjoint(st.loading):
                self._failed(st, invalid_pages)
            st.loading = ()

    def _failed(self, st: _Req, invalid_pages: set[int]) -> None:
        st.failed = True
        self._count("failed_loads")
        # vLLM recomputes from the first failed page: those blocks get saved like any new full
        # block (the cluster's copy was bad or unreachable)
        bad = min(i for i, p in enumerate(st.loading) if p in invalid_pages)
        st.saved_upto = min(st.saved_upto, bad * self.page_tokens // self.block_tokens)
        st.loading = ()

    # ------------------------------------------------------------------ per step
    def build_meta(self, scheduled: dict[str, int], preempted: Sequence[str],
                   page_ids_of: Any, group_pages_of: Any = None) -> KVShareMetadata:
        """This step's loads and saves. ``scheduled``: tokens scheduled per request id;
        ``page_ids_of(req_id)``: the request's pages in token order (with several KV-cache
        groups, the full-attention group's, and ``group_pages_of(req_id)`` every group's: a
        save then starts after the last block that covers a null page,
        :func:`~kvshare.vllm.connector.groups.savable_from`)."""
        self._count("steps")
        self.lookups.step(scheduled)
        self.backlog.step(scheduled)
        meta = KVShareMetadata(loads=self._loads, busy=bool(scheduled),
                               preempted=tuple(preempted),
                               marks=self.marks.path if self.marks is not None else "")
        self._loads = []
        for rid in preempted:
            self.backlog.gone(rid)  # recomputed from the start when it is taken up again
            st = self._reqs.get(rid)
            if st is not None:  # its pages are gone: it will look up (and save) again
                st.saved_upto = 0
        if not self.save:
            return meta
        for rid, n in scheduled.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            self._late_answer(st)
            req = st.request
            done = min(int(req.num_computed_tokens) + int(n), len(req.all_token_ids))
            full = done // self.block_tokens
            if full <= st.saved_upto:
                continue
            if full > len(st.hashes):  # decode filled more blocks: extend the chain
                tokens = list(req.all_token_ids)
                start = len(st.hashes) * self.block_tokens
                parent = st.hashes[-1] if st.hashes else None
                st.hashes += block_hashes(st.root, tokens[start:full * self.block_tokens],
                                          self.block_tokens, parent=parent)
            n_pages = full * self.block_tokens // self.page_tokens
            pages = list(page_ids_of(rid))[:n_pages]
            start = st.saved_upto
            group_pages: tuple[tuple[int, ...], ...] = ()
            if self.groups.grouped and group_pages_of is not None:
                group_pages = tuple(tuple(int(p) for p in list(g)[:n_pages])
                                    for g in group_pages_of(rid))
                start = savable_from(group_pages, start, full,
                                     self.block_tokens // self.page_tokens)
                if start > st.saved_upto:  # behind a sliding window already: never saved
                    self._count("save_blocks_behind_window", start - st.saved_upto)
                if start >= full:
                    st.saved_upto = full
                    continue
            seq = self.marks.next_seq() if self.marks is not None else 0
            st.saved_blocks += full - start
            sync = self.marks is not None and _stop_strings(req) and self._small_saves(st)
            meta.saves.append(SaveSpec(rid, tuple(bytes(h) for h in st.hashes[:full]),
                                       start, tuple(int(p) for p in pages), seq, sync,
                                       group_pages))
            st.save_seqs.append(seq)
            self._count("save_blocks", full - start)
            st.saved_upto = full
            self._sending.add(rid)
        return meta

    def _late_answer(self, st: _Req) -> None:
        """An abandoned lookup that has answered: the blocks the cluster held are not
        stored again (an unanswered or failed one: every new block is saved)."""
        late = st.late
        if late is None or not late.done():
            return
        st.late = None
        if not late.cancelled() and late.exception() is None:
            st.saved_upto = max(st.saved_upto, late.result().available_blocks)

    def request_finished(self, request: Any) -> bool:
        """True when a save was issued for the request: vLLM keeps its pages until the
        workers report it in ``finished_sending``. A request that ends its answer (not
        aborted) first waits for its saves (module docstring: read-after-write)."""
        rid = request.request_id
        self.backlog.gone(rid)
        st = self._reqs.pop(rid, None)
        self._unshared.discard(rid)
        if rid not in self._sending:
            return False
        self._sending.discard(rid)
        if st is not None and st.save_seqs and not _aborted(request):
            self._hold_for_saves(st)
        return True

    def _small_saves(self, st: _Req) -> bool:
        """Whether the request's saves so far are small enough to wait for (``sync_save_bytes``)."""
        return st.saved_blocks * self.keys.layout.bytes_per_block <= self.sync_save_bytes

    def _hold_for_saves(self, st: _Req) -> None:
        """Wait until the request's saves have ended (at most ``SYNC_SAVE_WAIT_S``), when
        they are small enough to wait for; counted as ``sync_saves`` (requests that checked),
        ``sync_save_s`` (seconds held) and ``sync_saves_late`` (still running at the limit);
        ``sync_saves_unmarked`` when no worker maps the marks (nothing to wait on)."""
        marks = self.marks
        if marks is None or not self._small_saves(st):
            return
        if not marks.attached:  # no worker marks its saves here: nothing to wait on
            self._count("sync_saves_unmarked")
            return
        t0 = time.perf_counter()
        done = marks.wait(st.save_seqs, SYNC_SAVE_WAIT_S)
        self._count("sync_saves")
        with self._lock:
            self.counters["sync_save_s"] = (self.counters.get("sync_save_s", 0.0)
                                            + time.perf_counter() - t0)
        if not done:
            self._count("sync_saves_late")

    def close(self) -> None:
        self.lookups.close()
        if self.marks is not None:
            self.marks.close()
            self.marks = None


def _int_lists(lists: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(p) for p in g) for g in lists)


def _stop_strings(request: Any) -> bool:
    """Whether the request has stop strings (found by vLLM's frontend, not the engine)."""
    params = getattr(request, "sampling_params", None)
    return bool(getattr(params, "stop", None))


def _aborted(request: Any) -> bool:
    """Whether vLLM aborted the request (its client went away): no answer to wait for."""
    status = getattr(request, "status", None)
    return getattr(status, "name", "") == "FINISHED_ABORTED"
